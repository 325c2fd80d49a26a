"""LFM3 (`Lfm3ForCausalLM`, Liquid AI's): LFM2's hybrid (lfm2.py: short-convolution and attention layers by
`layer_types`, each followed by a SwiGLU MLP of `intermediate_size`) with sliding-window attention layers beside the
full ones, each type with its own rope (the full ones' "proportional"), a sigmoid output gate per head of its own
projection (`use_attention_gate`), q/k/v/o biases where `attention_bias`, and (`use_sandwich_norm`) a norm on each
sublayer's output too."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.recurrent import RecurrentBatch
from nanoinfer.layers.short_conv import ShortConv
from nanoinfer.models.config_checks import check_each_in
from nanoinfer.models.hybrid import HybridDecoderLayer
from nanoinfer.models.lfm2 import Lfm2ForCausalLM
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaMLP, layer_sliding_window

_LAYER_TYPES = ("conv", "sliding_attention", "full_attention")


def check_layer_types(config: PretrainedConfig) -> None:
    check_each_in(config, "layer_types", _LAYER_TYPES)


class Lfm3SandwichDecoderLayer(HybridDecoderLayer):
    """LFM2's layer with a norm on the mixer's and the MLP's outputs as well, before they join the residual stream."""

    def __init__(self, config: PretrainedConfig, mixer: nn.Module, is_attention_layer: bool, mlp: nn.Module,
                 eps: float):
        super().__init__(config, mixer, is_attention_layer, mlp, eps)
        self.post_mixer_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, batch: RecurrentBatch
            ) -> torch.Tensor:
        return self.post_mixer_layernorm(super().mix(positions, x, meta, batch))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, batch: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = super().forward(positions, x, residual, meta, batch)
        return self.post_feedforward_layernorm(x), residual


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    # The Hub's names (which transformers' save_pretrained writes back) to the layer's, then LFM2's.
    weight_name_substitutions = {".self_attn.gate_proj.": ".self_attn.g_proj.",
                                 ".post_operator_norm.": ".post_mixer_layernorm.",
                                 ".post_ffn_norm.": ".post_feedforward_layernorm.",
                                 **Lfm2ForCausalLM.weight_name_substitutions}

    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        layer_type = config.layer_types[layer_idx]
        is_attention = layer_type != "conv"
        if is_attention:
            bias = config.attention_bias
            mixer = LlamaAttention(config, AttentionOptions(
                qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=layer_sliding_window(config, layer_idx),
                rope_layer_type=layer_type, gate_activation=torch.sigmoid if config.use_attention_gate else None,
                gate_per_head=True))
        else:
            mixer = ShortConv(config.hidden_size, config.conv_L_cache, config.conv_bias)
        layer_class = Lfm3SandwichDecoderLayer if config.use_sandwich_norm else HybridDecoderLayer
        return layer_class(config, mixer, is_attention, self.make_mlp(config, layer_idx), config.norm_eps)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, config.intermediate_size, "silu")

    def __init__(self, config: PretrainedConfig):
        check_layer_types(config)
        super().__init__(config)
