"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): the Llama decoder with q/k/v biases (none on o_proj), optional per-head
q/k RMSNorms (`use_qk_norm`) and rope over the leading `partial_rotary_factor` of each head (neox layout); the first
`first_k_dense_replace` MLPs dense, the rest DeepSeek-V3's MoE (deepseek_v3.py): sigmoid routing with the
correction bias within the best groups, plus ungated shared experts."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import DeepseekV3MoE, mtp_layer_prefixes
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP


class Glm4MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, qk_norm=config.use_qk_norm)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config) if layer_idx < config.first_k_dense_replace else DeepseekV3MoE(config)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)
