"""SmolLM3: the Llama decoder where every `no_rope_layer_interval`-th layer has no position encoding (NoPE:
`no_rope_layers[i] == 0`), and windows only where `use_sliding_window` and `layer_types` both say so."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        windowed = config.use_sliding_window and config.layer_types[layer_idx] == "sliding_attention"
        return AttentionOptions(qkv_bias=bias, o_bias=bias, rope=bool(config.no_rope_layers[layer_idx]),
                                sliding_window=config.sliding_window if windowed else None)
