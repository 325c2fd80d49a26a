"""DBRX: the pre-norm layer with bias-free LayerNorms, the fused `Wqkv` (q, k, v stacked; GQA with `kv_n_heads`),
its output clamped to +-`clip_qkv`, rope over whole heads, and on every layer an MoE: each token's top k of
`moe_num_experts` SwiGLU experts by a softmax router, their weights divided by their p-norm
(`moe_normalize_expert_weights`), the experts stored in DBRX's own layout (w1 / v1 / w2, see fused_moe); no biases
anywhere, an untied LM head."""
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE, select_experts_pnorm
from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM
from nanoinfer.models.olmo import OlmoDecoderLayer, OlmoModel


class DbrxMoE(nn.Module):
    """A replicated router (`router`) scores the experts; each token goes to its top k (see select_experts_pnorm)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        ffn = config.ffn_config
        self.top_k, self.norm_p = ffn.moe_top_k, ffn.moe_normalize_expert_weights
        self.router = ReplicatedLinear(config.hidden_size, ffn.moe_num_experts)
        self.experts = FusedMoE(ffn.moe_num_experts, ffn.moe_top_k, config.hidden_size, ffn.ffn_hidden_size,
                                renormalize=False)
        # DBRX's files hold w13's two parts (w1, v1) and w2, each for every expert at once.
        self.experts.w13_weight.num_shards, self.experts.w2_weight.num_shards = 2, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *select_experts_pnorm(self.router(x), self.top_k, self.norm_p))


class DbrxBlock(OlmoDecoderLayer):  # OLMo's layer (nn.LayerNorm's default epsilon, not in the config) but its norms
    norm = partial(LayerNorm, bias=False)


class DbrxModel(OlmoModel):
    decoder_layer = DbrxBlock


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    act = config.ffn_config.ffn_act_fn.get("name", "silu")  # transformers reads the name alone
    if act != "silu":
        raise ValueError(f"ffn_config.ffn_act_fn name {act!r} in the model config: only 'silu' is supported for "
                         f"{config.model_type}")


class DbrxForCausalLM(LlamaForCausalLM):
    model_class = DbrxModel
    packed_modules_mapping = {}  # Wqkv holds q, k and v stacked: QKVParallelLinear's loader splits them
    check_config = staticmethod(check_config)
    weight_name_substitutions = {
        "^transformer.blocks.": "model.layers.",
        "^transformer.wte.": "model.embed_tokens.",
        "^transformer.norm_f.": "model.norm.",
        ".norm_attn_norm.norm_1.": ".input_layernorm.",
        ".norm_attn_norm.norm_2.": ".post_attention_layernorm.",
        ".norm_attn_norm.attn.Wqkv.": ".self_attn.qkv_proj.",
        ".norm_attn_norm.attn.out_proj.": ".self_attn.o_proj.",
        ".ffn.router.layer.": ".mlp.router.",
        ".ffn.experts.": ".mlp.experts.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        # The Hub's configs give the rope base as attn_config.rope_theta (500,000), which DBRX was trained with and
        # vLLM rotates by; transformers 5.23 reads it nowhere (its rope_parameters default to 10,000).
        attn = config.attn_config
        return AttentionOptions(clip_qkv=attn.clip_qkv, rope_theta=getattr(attn, "rope_theta", None))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DbrxMoE(config)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
