"""OLMo 3: OLMo 2 with a sliding window on the layers `layer_types` marks "sliding_attention" and the rope settings
of each layer's type (transformers nests them by "sliding_attention" / "full_attention")."""
from transformers import PretrainedConfig

from nanoinfer.models.llama import AttentionOptions, layer_sliding_window
from nanoinfer.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=layer_sliding_window(config, layer_idx),
                                rope_layer_type=config.layer_types[layer_idx])
