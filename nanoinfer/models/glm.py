"""GLM-4 (9B, the first version, `GlmForCausalLM`): the Llama decoder with biases on q/k/v (none on the output
projection), rope over a leading part of each head (`partial_rotary_factor`) in the interleaved layout, and a gate/up
projection stored fused (`gate_up_proj`). GLM-4-0414 (glm4.py) adds norms after each sublayer."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM

# transformers' GLM-4.1V text attention always has q/k/v biases and GLM-OCR's never, whatever attention_bias says.
_QKV_BIAS = {"glm4v_text": True, "glm_ocr_text": False}


class GlmForCausalLM(LlamaForCausalLM):
    # q/k/v arrive apart and pack into qkv_proj; the fused gate_up_proj loads whole (its weight_loader takes this
    # rank's rows of both halves).

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        qkv_bias = _QKV_BIAS[config.model_type] if config.model_type in _QKV_BIAS else config.attention_bias
        return AttentionOptions(qkv_bias=qkv_bias, rope_interleaved=True)
