"""PhiMoE (`PhimoeForCausalLM`, Phi-3.5-MoE): Mixtral's layout (a window on every layer where the config sets one,
experts under `block_sparse_moe`) with LayerNorms (weight and bias; epsilon `rms_norm_eps`), biases on q/k/v/o and
the LM head where the config says, and the sparsemixer routing to two experts. Its rope is transformers' PhiMoE
rotary: the rope type's frequencies as computed without a sequence length (longrope's short factors at every
position), times `short_mscale` up to `original_max_position_embeddings` and `long_mscale` beyond."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import SparseMoeBlock, select_experts_sparsemixer
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.rotary_embedding import RotaryEmbedding, inv_frequencies, rope_parameters
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaModel
from nanoinfer.models.mixtral import MixtralForCausalLM


def phimoe_rope(config: PretrainedConfig, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(config)
    with torch.device("cpu"):  # transformers' rope functions need data; the table is built where the model is
        inv_freq, scaling = inv_frequencies(config, int(head_dim * params.get("partial_rotary_factor", 1.0)))
    max_position = config.max_position_embeddings
    if params["rope_type"] != "default":  # transformers' config validation requires both factors then
        beyond = torch.arange(max_position) >= params["original_max_position_embeddings"]
        scaling = torch.where(beyond, float(params["long_mscale"]), float(params["short_mscale"]))[:, None]
    return RotaryEmbedding(head_dim, max_position, inv_freq, scaling)


class PhimoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: PretrainedConfig):
        if config.num_experts_per_tok != 2:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} in the model config: PhiMoE's "
                             "sparsemixer routes each token to 2 experts")
        super().__init__(config, config.num_local_experts, config.intermediate_size, renormalize=False)
        self.jitter_eps = config.router_jitter_noise  # the sparsemixer's threshold at inference too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *select_experts_sparsemixer(self.gate(x), self.jitter_eps))


class PhimoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, norm=LayerNorm)


class PhimoeModel(LlamaModel):
    decoder_layer = PhimoeDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, config.rms_norm_eps)


class PhimoeForCausalLM(MixtralForCausalLM):
    model_class = PhimoeModel
    # transformers' own layout names the router `mlp.router` (the Hub's: `block_sparse_moe.gate`).
    weight_name_substitutions = MixtralForCausalLM.weight_name_substitutions | {".mlp.router.": ".mlp.gate."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        # rope=False: the layers take the PhiMoE rotary below instead of building Llama's.
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=config.sliding_window, rope=False)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return PhimoeSparseMoeBlock(config)

    def __init__(self, config: PretrainedConfig):
        self.lm_head_bias = config.lm_head_bias
        super().__init__(config)
        attentions = [layer.self_attn for layer in self.model.layers]
        rope = phimoe_rope(config, attentions[0].head_dim)
        for attention in attentions:
            attention.rotary_emb = rope
