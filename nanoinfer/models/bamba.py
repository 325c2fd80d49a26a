"""Bamba (`BambaForCausalLM`): Mamba2 layers and attention layers (rope over half of each head), by
`attn_layer_indices`, each followed by a SwiGLU MLP."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.mamba2 import Mamba2Mixer
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def mamba2_or_attention(config: PretrainedConfig, layer_idx: int, options: AttentionOptions
                        ) -> tuple[nn.Module, bool]:
    """The layer's token mixer by `layers_block_type` ("linear_attention": Mamba2), and whether it is attention."""
    layer_type = config.layers_block_type[layer_idx]
    if layer_type == "linear_attention":
        return Mamba2Mixer(config), False
    if layer_type == "full_attention":
        return LlamaAttention(config, options), True
    raise ValueError(f"unsupported layer type {layer_type!r} in layer {layer_idx}")


class BambaForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".mamba.": ".mixer.",
        ".feed_forward.": ".mlp.",
        ".pre_ff_layernorm.": ".post_attention_layernorm.",
        "model.final_layernorm.": "model.norm.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        bias = config.attention_bias
        mixer, is_attention = mamba2_or_attention(config, layer_idx, AttentionOptions(qkv_bias=bias, o_bias=bias))
        return HybridDecoderLayer(config, mixer, is_attention, LlamaMLP(config), config.rms_norm_eps)

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, config.rms_norm_eps)
