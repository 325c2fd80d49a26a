"""Laguna (`LagunaForCausalLM`, poolside's): AFMoE's attention (afmoe.py: per-head q/k norms applying their weight in
fp32, an output gate of its own projection) with a softplus gate, one per head (`gating` True or "per-head") or per
element ("per-element"), a query head count per layer (`num_attention_heads_per_layer`), sliding and full layers
with a rope each (rotating the leading `partial_rotary_factor` of each head), in pre-norm layers; MLPs dense or, as
`mlp_layer_types` says, experts chosen by softcapped sigmoid scores plus a correction bias, renormalized, scaled by
`moe_routed_scaling_factor`, plus an ungated shared expert."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.config_checks import config_source
from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE, mlp_layer_type
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.gpt_oss import GptOssRMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP, layer_sliding_window

_GATINGS = (True, "per-head", "per-element")


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    if config.gating not in _GATINGS:
        raise ValueError(f"gating={config.gating!r} in {where} is not supported; expected one of {_GATINGS}")
    if config.moe_apply_router_weight_on_input:
        raise ValueError(f"moe_apply_router_weight_on_input={config.moe_apply_router_weight_on_input} in {where} is "
                         "not supported (nor by transformers' Laguna)")
    check_layer_types(config)


class LagunaMoE(UngroupedSigmoidMoE):
    """As transformers' LagunaSparseMoeBlock: the router's logits and correction bias in the model's dtype, the
    routing weights rounded to it, the routed experts' sum (not the weights) times `moe_routed_scaling_factor`."""
    router_in_model_dtype = True
    fp32_router_weight = False

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.num_experts, config.shared_expert_intermediate_size,
                         logit_softcap=config.moe_router_logit_softcapping)
        self.routed_scaling = config.moe_routed_scaling_factor

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().select_experts(x)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.run_experts(x, *self.select_experts(x)) * self.routed_scaling + self.shared_experts(x)


class LagunaForCausalLM(LlamaForCausalLM):
    # The Hub's names (which transformers' save_pretrained writes back).
    weight_name_substitutions = {".mlp.experts.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                                 ".mlp.shared_expert.": ".mlp.shared_experts."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_class=GptOssRMSNorm,
                                sliding_window=layer_sliding_window(config, layer_idx),
                                rope_layer_type=config.layer_types[layer_idx], gate_activation=F.softplus,
                                gate_per_head=config.gating != "per-element",
                                num_heads=config.num_attention_heads_per_layer[layer_idx])

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) != "sparse":
            return LlamaMLP(config)
        return LagunaMoE(config)

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
