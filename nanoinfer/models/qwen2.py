"""Qwen2: the Llama decoder with biases on the q, k and v projections."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)
