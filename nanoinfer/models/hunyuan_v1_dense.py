"""Hunyuan dense (HunYuanDenseV1): Llama with per-head q/k RMSNorms (`query_layernorm`, `key_layernorm`) applied after
rope, not before as Qwen3's, and its NTK-alpha rope (rope_type "dynamic" with a fixed `alpha`)."""
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.models.layernorm_decoder import QKLayerNormAttention
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class HunYuanDenseV1Attention(QKLayerNormAttention):
    rope_first = True

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options, lambda heads, head_dim: RMSNorm(head_dim, config.rms_norm_eps))


class HunYuanDenseV1DecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanDenseV1Attention


class HunYuanDenseV1Model(LlamaModel):
    decoder_layer = HunYuanDenseV1DecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunYuanDenseV1Model
    weight_name_substitutions = {".self_attn.query_layernorm.": ".self_attn.q_layernorm.",
                                 ".self_attn.key_layernorm.": ".self_attn.k_layernorm."}
