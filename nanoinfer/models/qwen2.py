"""Qwen2: the Llama decoder with biases on the q, k and v projections."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, layer_sliding_window


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, sliding_window=layer_sliding_window(config, layer_idx),
                                rope_in_dtype=True)
