"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
