"""Mistral: the Llama decoder with a sliding window on every layer (transformers' Mistral ignores `layer_types`)."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=config.sliding_window, rope_in_dtype=True)
