"""Hunyuan dense (HunYuanDenseV1): Llama with per-head q/k RMSNorms (`query_layernorm`, `key_layernorm`) applied after
rope, not before as Qwen3's, and its NTK-alpha rope (rope_type "dynamic" with a fixed `alpha`)."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, layer_sliding_window


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    weight_name_substitutions = {".self_attn.query_layernorm.": ".self_attn.q_norm.",
                                 ".self_attn.key_layernorm.": ".self_attn.k_norm."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = getattr(config, "attention_bias", False)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=layer_sliding_window(config, layer_idx),
                                qk_norm=True, qk_norm_after_rope=True)
