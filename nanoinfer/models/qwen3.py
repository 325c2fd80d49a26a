"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, layer_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                                sliding_window=layer_sliding_window(config, layer_idx), rope_in_dtype=True)
