"""Seed-OSS: Llama with its own bias flags: q/k/v (`attention_bias`), the output projection (`attention_out_bias`)
and the MLP (`mlp_bias`)."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_out_bias)
