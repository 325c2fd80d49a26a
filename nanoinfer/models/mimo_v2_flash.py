"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, Xiaomi's): the Llama decoder with sliding-window layers (twice the KV heads,
attention sinks) and full ones, each type with its rope over the leading `partial_rotary_factor` (0.334 unless given)
of each head; value heads narrower than the query and key heads (`v_head_dim`), the values scaled by
`attention_value_scale`; MLPs dense or, as `mlp_layer_types` says, DeepSeek-V3's routed experts without shared
ones."""
from dataclasses import replace

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.rotary_embedding import rope_parameters
from nanoinfer.models.deepseek_v3 import DeepseekV3MoE, mlp_layer_type
from nanoinfer.models.gemma2 import check_layer_types
from nanoinfer.models.gpt_oss import GptOssForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM, LlamaMLP

# transformers' MiMoV2FlashRotaryEmbedding: the rotated share of each head where the layer's rope settings omit it
# (for the default rope type; transformers' functions for the others rotate whole heads).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334


class MiMoV2FlashForCausalLM(LlamaForCausalLM):
    # The Hub's name for the sinks (which transformers' save_pretrained writes back), then GPT-OSS's place for them.
    weight_name_substitutions = {".self_attn.attention_sink_bias": ".self_attn.sinks",
                                 **GptOssForCausalLM.weight_name_substitutions}
    ignored_weight_prefixes = ("model.mtp.",)  # the multi-token-prediction layers: not used here

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        options = LlamaForCausalLM.attention_options(config, layer_idx)
        layer_type = config.layer_types[layer_idx]
        sliding = layer_type == "sliding_attention"
        params = rope_parameters(config, layer_type)
        factor = params.get("partial_rotary_factor",
                            DEFAULT_PARTIAL_ROTARY_FACTOR if params["rope_type"] == "default" else 1.0)
        return replace(options, o_bias=False, sinks=sliding, rope_layer_type=layer_type,
                       rotary_dim=int(config.head_dim * factor), v_head_dim=config.v_head_dim,
                       num_kv_heads=config.num_key_value_heads * (2 if sliding else 1),
                       value_scale=config.attention_value_scale)  # None: unscaled, as transformers'

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if mlp_layer_type(config, layer_idx) == "dense":
            return LlamaMLP(config)
        return DeepseekV3MoE(config, shared_intermediate_size=0)

    def __init__(self, config: PretrainedConfig):
        check_layer_types(config)
        super().__init__(config)
