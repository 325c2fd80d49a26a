"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`; Solar Open, whose config has neither q/k norms nor dense layers): the Llama
decoder with q/k/v biases (none on o_proj), optional per-head q/k RMSNorms (`use_qk_norm`) and rope over the leading
`partial_rotary_factor` of each head (neox layout); the first `first_k_dense_replace` MLPs dense, the rest
DeepSeek-V3's MoE (deepseek_v3.py): sigmoid routing with the correction bias within the best groups, plus ungated
shared experts."""
from transformers import PretrainedConfig

from nanoinfer.models.deepseek_v3 import deepseek_v3_mlp, mtp_layer_prefixes
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        # Solar Open's config (this model without q/k norms) has no use_qk_norm.
        return AttentionOptions(qkv_bias=config.attention_bias, qk_norm=getattr(config, "use_qk_norm", False))

    make_mlp = staticmethod(deepseek_v3_mlp)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.ignored_weight_prefixes = mtp_layer_prefixes(config)
