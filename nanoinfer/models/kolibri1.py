"""Kolibri-1 (`Kolibri1ForCausalLM`, Aleph Alpha's): EXAONE 4's attention (per-head q/k norms, no biases, windows on
the layers `layer_types` marks sliding, where the config has a window rope on those alone) in GLM-4's layer (norms
before and after both sublayers), every MLP experts plus an ungated shared expert: the top k of the router logits
plus a correction bias, weighted by the sigmoid of their logits, renormalized where `norm_topk_prob`."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.fused_moe import select_experts_biased_logits
from nanoinfer.models.deepseek_v3 import UngroupedSigmoidMoE
from nanoinfer.models.exaone4 import Exaone4ForCausalLM
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.glm4 import Glm4ForCausalLM, Glm4Model
from nanoinfer.models.llama import LlamaForCausalLM


class Kolibri1MoE(UngroupedSigmoidMoE):
    fp32_router_weight = False  # transformers keeps its correction bias alone in fp32

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts_biased_logits(self.gate(x), self.top_k, self.gate.e_score_correction_bias,
                                            self.renormalize)


class Kolibri1ForCausalLM(LlamaForCausalLM):
    model_class = Glm4Model
    # The Hub's names (which transformers' save_pretrained writes back) to GLM-4's, then GLM-4's to the layer's.
    weight_name_substitutions = {".moe.router.expert_bias": ".mlp.gate.e_score_correction_bias",
                                 ".post_attn_norm.": ".post_self_attn_layernorm.",
                                 ".post_ffn_norm.": ".post_mlp_layernorm.", **Glm4ForCausalLM.weight_name_substitutions}
    attention_options = staticmethod(Exaone4ForCausalLM.attention_options)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return Kolibri1MoE(config, config.num_experts, config.shared_expert_intermediate_size,
                           renormalize=config.norm_topk_prob)

    check_config = staticmethod(check_layer_types)  # what the family cannot run, refused by name

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
