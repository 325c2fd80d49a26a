"""HY3 (`HYV3ForCausalLM`, Tencent's Hy3): the Llama decoder with per-head q/k norms before rope (Apertus's attention)
and, as `mlp_layer_types` says, dense MLPs or experts chosen by sigmoid scores plus an `e_score_correction_bias`,
renormalized and scaled by `router_scaling_factor`, plus ungated shared experts (DeepSeek-V3's MoE without groups).
`enable_moe_fp32_combine` adds the shared experts' output in fp32 and rounds once: what a 16-bit add computes too.
The checkpoints' multi-token-prediction layers, numbered after the last decoder layer, are unused."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.apertus import ApertusForCausalLM
from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE, mlp_layer_type
from nanoinfer.models.llama import LlamaForCausalLM, LlamaMLP


class HYV3MoE(UngroupedSigmoidMoE):
    sorted_topk = False  # as transformers' HYV3TopKRouter


class HYV3ForCausalLM(LlamaForCausalLM):
    attention_options = staticmethod(ApertusForCausalLM.attention_options)
    # The Hub's names (which transformers' save_pretrained writes back) and transformers' own.
    weight_name_substitutions = {".mlp.router.gate.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_experts.",
                                 ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                                 ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) != "sparse":
            return LlamaMLP(config)
        return HYV3MoE(config, config.num_experts, config.moe_intermediate_size * config.num_shared_experts,
                       config.router_scaling_factor)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        # transformers' rule (any layer numbered from num_hidden_layers on): each such number starts with its digits.
        self.ignored_weight_prefixes = (f"model.layers.{config.num_hidden_layers}",)
