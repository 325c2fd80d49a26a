"""LFM2 (`Lfm2ForCausalLM`): gated short-convolution layers and attention layers with per-head q/k norms, by
`layer_types`, each followed by a SwiGLU MLP; the final norm is the checkpoint's `embedding_norm`. LFM2-MoE
(`Lfm2MoeForCausalLM`): the same layers, the MLPs after the first `num_dense_layers` routed experts (sigmoid scores,
chosen with an `expert_bias`, renormalized and scaled, in the model's dtype as transformers routes them)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.linear import ReplicatedLinear
from nanoinfer.layers.short_conv import ShortConv
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def lfm2_intermediate_size(config: PretrainedConfig) -> int:
    """transformers' Lfm2MLP: with block_auto_adjust_ff_dim, 2/3 of intermediate_size, times the multiplier, rounded
    up to a multiple of block_multiple_of."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * -(-size // config.block_multiple_of)
    return size


class Lfm2ForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".conv.conv.weight": ".mixer.conv_weight",
        ".conv.conv.bias": ".mixer.conv_bias",
        ".conv.": ".mixer.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".q_layernorm.": ".q_norm.",
        ".k_layernorm.": ".k_norm.",
        ".feed_forward.w1.": ".mlp.gate_proj.",
        ".feed_forward.w3.": ".mlp.up_proj.",
        ".feed_forward.w2.": ".mlp.down_proj.",
        ".feed_forward.": ".mlp.",  # LFM2-MoE's experts, router and expert_bias
        ".operator_norm.": ".input_layernorm.",
        ".ffn_norm.": ".post_attention_layernorm.",
        "model.embedding_norm.": "model.norm.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        is_attention = config.layer_types[layer_idx] != "conv"  # transformers' rule
        if is_attention:
            mixer = LlamaAttention(config, AttentionOptions(qk_norm=True))
        else:
            mixer = ShortConv(config.hidden_size, config.conv_L_cache, config.conv_bias)
        return HybridDecoderLayer(config, mixer, is_attention, self.make_mlp(config, layer_idx), config.norm_eps)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, lfm2_intermediate_size(config), "silu")

    def __init__(self, config: PretrainedConfig):
        config.rms_norm_eps = config.norm_eps  # what LlamaAttention's q/k norms read
        super().__init__(config, config.norm_eps)


def select_experts_lfm2_moe(router_logits: torch.Tensor, top_k: int, expert_bias: torch.Tensor | None,
                            renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LFM2-MoE, as transformers' Lfm2MoeTopKRouter computes it, in the logits' dtype: sigmoid scores; the top k of
    score + expert_bias (fp32; None: of the scores); the weights the chosen scores, optionally rescaled to sum to 1
    (1e-6 added to the sum), times `scaling`."""
    scores = router_logits.sigmoid()
    if expert_bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(scores + expert_bias, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * scaling, ids


class Lfm2MoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = (config.num_experts_per_tok, config.norm_topk_prob,
                                                      config.routed_scaling_factor)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        # A float32 buffer in transformers, as DeepSeek-V3's correction bias.
        self.expert_bias = (nn.Parameter(torch.empty(config.num_experts, dtype=torch.float32), requires_grad=False)
                            if config.use_expert_bias else None)
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                renormalize=False)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_lfm2_moe(self.gate(x), self.top_k, self.expert_bias, self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if layer_idx < config.num_dense_layers:
            return LlamaMLP(config, config.intermediate_size, "silu")  # without LFM2's width adjustment
        return Lfm2MoeBlock(config)
