"""Cohere Compass's language model (`CohereCompassForCausalLM`, and the text side of
`CohereCompassForConditionalGeneration`, North-Micro-Vision): Cohere 2's layer (one bias-free LayerNorm feeding the
attention and the MLP in parallel, windows on the layers `layer_types` marks "sliding_attention") with Qwen3-VL's rope
in place of Cohere's: the neox layout, by layer type (`rope_parameters` keyed by it; a type whose settings are None has
no position encoding). A text token's multimodal rope position is the same on every axis: the plain rope."""
from transformers import PretrainedConfig

from nanoinfer.models.cohere2 import Cohere2ForCausalLM
from nanoinfer.models.llama import AttentionOptions, layer_sliding_window


class CohereCompassForCausalLM(Cohere2ForCausalLM):
    wrapper_scales_logits = True  # its conditional-generation model multiplies the logits by logit_scale too

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias, layer_type = config.attention_bias, config.layer_types[layer_idx]
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sliding_window=layer_sliding_window(config, layer_idx),
                                rope=(config.rope_parameters or {}).get(layer_type) is not None,
                                rope_layer_type=layer_type)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.logit_scale = 1.0 if config.logit_scale is None else config.logit_scale
