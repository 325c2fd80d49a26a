"""Lara Mini (`LaraMiniForCausalLM`, Translated's): Qwen3.5's hybrid layers (qwen3_5.py) by `layer_types`: its Gated
DeltaNet on the linear ones (its projections fused in one `in_proj`, GLM-5-Next's gated norm, in fp32), Qwen3's
attention (per-head q/k norms, no output gate) with rope and a window on the sliding ones, NoPE on the full ones;
Helium's norms (the weight applied in fp32); every MLP Flint's block (experts plus an ungated shared expert) with a
softmax top-k router in fp32."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import Fp32Router, FusedMoE, select_experts
from nanoinfer.layers.layernorm import GatedRMSNorm, OlmoRMSNorm, RMSNorm
from nanoinfer.layers.linear import SegmentedColumnParallelLinear
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM, check_layer_config
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP
from nanoinfer.models.qwen3_next import Qwen3NextGatedDeltaNet

LAYER_TYPES = ("linear_attention", "sliding_attention", "full_attention")


class LaraMiniGatedDeltaNet(Qwen3NextGatedDeltaNet):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, weight_in_fp32=True)

    def init_projections(self, hidden_size: int, key_dim: int, value_dim: int, num_v_heads: int) -> None:
        # The checkpoint's rows [q | k | v | z | b | a], each segment split by heads: a rank's share of each is its
        # key heads' and the value heads they serve, as Qwen3.5's separate projections.
        self.in_proj = SegmentedColumnParallelLinear(hidden_size, [(key_dim, True), (key_dim, True), (value_dim, True),
                                                                   (value_dim, True), (num_v_heads, True),
                                                                   (num_v_heads, True)])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim  # this rank's
        mixed_qkv, z, b, a = self.in_proj(x).split([2 * key_dim + value_dim, value_dim, self.num_v_heads,
                                                    self.num_v_heads], -1)
        return mixed_qkv, z.view(x.shape[0], self.num_v_heads, self.head_v_dim), b, a


class LaraMiniMoE(nn.Module):
    """Routed experts plus an ungated shared expert. The router scores in fp32 (its weight in the model's dtype), and
    transformers rounds the routing weights back to the model's dtype."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate = Fp32Router(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob)
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select_experts(self.gate(x), self.experts.top_k, self.experts.renormalize)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x)) + self.shared_expert(x)


class LaraMiniForCausalLM(HybridForCausalLM):
    # The Hub's names (which transformers' save_pretrained writes back) to HybridDecoderLayer's and the norm's.
    weight_name_substitutions = {".linear_attn.": ".mixer.", ".mixer.out_norm.": ".mixer.norm."}

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        layer_type = config.layer_types[layer_idx]
        if layer_type == "linear_attention":
            mixer = LaraMiniGatedDeltaNet(config)
        else:
            sliding, bias = layer_type == "sliding_attention", config.attention_bias
            # rotary_dim: transformers' default rope turns whole heads, whatever partial_rotary_factor says.
            mixer = LlamaAttention(config, AttentionOptions(
                qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=OlmoRMSNorm, rope=sliding,
                rotary_dim=config.head_dim, sliding_window=config.sliding_window if sliding else None))
        return HybridDecoderLayer(config, mixer, layer_type != "linear_attention", LaraMiniMoE(config),
                                  config.rms_norm_eps, norm=OlmoRMSNorm)

    def make_final_norm(self, config: PretrainedConfig, eps: float) -> RMSNorm:
        return OlmoRMSNorm(config.hidden_size, eps)

    def __init__(self, config: PretrainedConfig):
        # SiLU: the delta rule's conv and the experts apply it.
        check_layer_config(config, "linear_num_key_heads", silu=True, layer_types=LAYER_TYPES)
        super().__init__(config, config.rms_norm_eps)
