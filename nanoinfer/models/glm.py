"""GLM-4 (9B, the first version, `GlmForCausalLM`): the Llama decoder with biases on q/k/v (none on the output
projection), rope over a leading part of each head (`partial_rotary_factor`) in the interleaved layout, and a gate/up
projection stored fused (`gate_up_proj`). GLM-4-0414 (glm4.py) adds norms after each sublayer."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class GlmForCausalLM(LlamaForCausalLM):
    # q/k/v arrive apart and pack into qkv_proj; the fused gate_up_proj loads whole (its weight_loader takes this
    # rank's rows of both halves).

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, rope_interleaved=True)
