"""DeepSeek-V3 (and R1): DeepSeek-V2's MLA and MoE (deepseek_v2.py) with sigmoid scores, chosen on score +
`e_score_correction_bias` within the best groups ("noaux_tc"), and the rope layout set by `rope_interleave`."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import GatedActivation, select_experts_sigmoid_biased, silu_and_mul
from nanoinfer.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE, check_moe_config
from nanoinfer.models.llama import AttentionOptions, LlamaMLP


def mtp_layer_prefixes(config: PretrainedConfig) -> tuple[str, ...]:
    """The checkpoints' multi-token-prediction layers (numbered after the last decoder layer): not used here."""
    mtp_layers = getattr(config, "num_nextn_predict_layers", 0) or 0
    return tuple(f"model.layers.{config.num_hidden_layers + i}." for i in range(mtp_layers))


class DeepseekV3MoE(DeepseekV2MoE):
    correction_bias = True
    sorted_topk = False  # see select_experts_sigmoid_biased (AFMoE's, Laguna's, Flint's and Beam's sorted)

    def configure_routing(self, config: PretrainedConfig) -> None:
        # transformers' V3 router always routes this way, whatever `topk_method` says.
        check_moe_config(config, grouped=True)
        self.num_groups, self.topk_group, self.renormalize = config.n_group, config.topk_group, config.norm_topk_prob
        self.scaling = config.routed_scaling_factor

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_sigmoid_biased(self.gate(x), self.top_k, self.gate.e_score_correction_bias,
                                             self.num_groups, self.topk_group, self.renormalize, self.scaling,
                                             self.sorted_topk)


class UngroupedSigmoidMoE(DeepseekV3MoE):
    """AFMoE's, Laguna's, HY3's and Flint's MoE (Kolibri-1's chooses otherwise): V3's routing without a group limit
    (one group), the correction bias where the class has one (Flint's has none), renormalized unless told not to
    (`norm_topk_prob`), times the family's `scaling` (Laguna's scales the routed output instead); the router logits
    first softcapped to cap * tanh(logit / cap) where logit_softcap > 0 (Laguna); `activation`: the routed experts'
    (Step-3.5's clamps)."""

    sorted_topk = True  # HY3's unsorted

    def __init__(self, config: PretrainedConfig, num_experts: int, shared_intermediate_size: int,
                 scaling: float = 1.0, logit_softcap: float = 0.0, renormalize: bool = True,
                 activation: GatedActivation = silu_and_mul):
        super().__init__(config, num_experts, shared_intermediate_size, activation)
        self.scaling, self.logit_softcap, self.renormalize = scaling, logit_softcap, renormalize

    def configure_routing(self, config: PretrainedConfig) -> None:
        check_moe_config(config, grouped=False)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        if self.logit_softcap > 0:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        bias = self.gate.e_score_correction_bias if self.correction_bias else None
        return select_experts_sigmoid_biased(logits, self.top_k, bias, 1, 1, self.renormalize, self.scaling,
                                             self.sorted_topk)


def deepseek_v3_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """DeepSeek-V3's layer rule, which GLM-4.5 and dots.llm1 follow: the first `first_k_dense_replace` MLPs dense, the
    others its MoE (every one where the config has no such setting: Solar Open's)."""
    return LlamaMLP(config) if layer_idx < getattr(config, "first_k_dense_replace", 0) else DeepseekV3MoE(config)


_MLP_TYPES = ("dense", "sparse")


def mlp_layer_type(config: PretrainedConfig, layer_idx: int) -> str:
    """`mlp_layer_types[layer_idx]`, "dense" or "sparse" (anything else refused by name)."""
    mlp_type = config.mlp_layer_types[layer_idx]
    if mlp_type not in _MLP_TYPES:
        raise ValueError(f"mlp_layer_types[{layer_idx}]={mlp_type!r} in the model config; expected one of "
                         f"{_MLP_TYPES}")
    return mlp_type


def mlp_by_layer_type(config: PretrainedConfig, layer_idx: int,
                      moe_class: type[DeepseekV2MoE] = DeepseekV3MoE) -> nn.Module:
    """GLM-4.7-Flash's and EXAONE-MoE's rule: each MLP dense or DeepSeek-V3's MoE (`moe_class`; DeepSeek-OCR 2's:
    V2's) as `mlp_layer_types` says."""
    return moe_class(config) if mlp_layer_type(config, layer_idx) == "sparse" else LlamaMLP(config)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    moe_class = DeepseekV3MoE

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        # transformers' interleaved variant writes the rotated pairs de-interleaved (evens, then odds), this one in
        # place: the same permutation of q's and k's rope dimensions, so the same scores.
        return AttentionOptions(rope_interleaved=bool(config.rope_interleave))

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)
