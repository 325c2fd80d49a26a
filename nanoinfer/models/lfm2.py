"""LFM2 (`Lfm2ForCausalLM`): gated short-convolution layers and attention layers with per-head q/k norms, by
`layer_types`, each followed by a SwiGLU MLP; the final norm is the checkpoint's `embedding_norm`."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.short_conv import ShortConv
from nanoinfer.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP


def lfm2_intermediate_size(config: PretrainedConfig) -> int:
    """transformers' Lfm2MLP: with block_auto_adjust_ff_dim, 2/3 of intermediate_size, times the multiplier, rounded
    up to a multiple of block_multiple_of."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * -(-size // config.block_multiple_of)
    return size


class Lfm2ForCausalLM(HybridForCausalLM):
    weight_name_substitutions = {
        ".conv.conv.weight": ".mixer.conv_weight",
        ".conv.conv.bias": ".mixer.conv_bias",
        ".conv.": ".mixer.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".q_layernorm.": ".q_norm.",
        ".k_layernorm.": ".k_norm.",
        ".feed_forward.w1.": ".mlp.gate_proj.",
        ".feed_forward.w3.": ".mlp.up_proj.",
        ".feed_forward.w2.": ".mlp.down_proj.",
        ".operator_norm.": ".input_layernorm.",
        ".ffn_norm.": ".post_attention_layernorm.",
        "model.embedding_norm.": "model.norm.",
    }

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        is_attention = config.layer_types[layer_idx] != "conv"  # transformers' rule
        if is_attention:
            mixer = LlamaAttention(config, AttentionOptions(qk_norm=True))
        else:
            mixer = ShortConv(config.hidden_size, config.conv_L_cache, config.conv_bias)
        mlp = LlamaMLP(config, lfm2_intermediate_size(config), "silu")
        return HybridDecoderLayer(config, mixer, is_attention, mlp, config.norm_eps)

    def __init__(self, config: PretrainedConfig):
        config.rms_norm_eps = config.norm_eps  # what LlamaAttention's q/k norms read
        super().__init__(config, config.norm_eps)
