"""Bamba (`BambaForCausalLM`): Mamba2 layers and attention layers (rope over half of each head), by
`attn_layer_indices`, each followed by a SwiGLU MLP."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.mamba2 import Mamba2Mixer, Mamba2Settings
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def mamba2_settings(config: PretrainedConfig) -> Mamba2Settings:
    """Bamba's and Granite 4.0-H's mamba_* names."""
    heads, head_dim = config.mamba_n_heads, config.mamba_d_head
    intermediate_size = int(config.mamba_expand * config.hidden_size)
    if heads * head_dim != intermediate_size:
        raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must be mamba_expand x hidden_size="
                         f"{intermediate_size}")
    return Mamba2Settings(config.hidden_size, heads, head_dim, config.mamba_n_groups, config.mamba_d_state,
                          config.mamba_d_conv, config.mamba_chunk_size, config.rms_norm_eps, config.mamba_conv_bias,
                          config.mamba_proj_bias, config.mamba_proj_bias,
                          tuple(config.time_step_limit or (0.0, float("inf"))), config.hidden_act)


def mamba2_or_attention(config: PretrainedConfig, layer_idx: int, options: AttentionOptions
                        ) -> tuple[nn.Module, bool]:
    """The layer's token mixer by `layers_block_type` ("linear_attention": Mamba2), and whether it is attention."""
    layer_type = config.layers_block_type[layer_idx]
    if layer_type == "linear_attention":
        return Mamba2Mixer(mamba2_settings(config)), False
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
