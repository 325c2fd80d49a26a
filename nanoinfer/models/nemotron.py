"""Nemotron (Nemotron-4, Minitron): pre-norm LayerNorms that scale by 1 + weight ("layernorm1p", with biases),
partial rotary (`partial_rotary_factor`, half the head by default), Arcee's non-gated relu^2 MLP, biases on q/k/v/o
where `attention_bias`."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.layers.linear import copy_weight
from nanoinfer.models.arcee import ArceeForCausalLM
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention


class LayerNorm1P(LayerNorm):
    """transformers' NemotronLayerNorm1P: nn.LayerNorm with weight + 1, the 1 added in the model's dtype (on load
    here, once)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.weight:
            loaded = loaded[...].to(param.dtype) + 1.0
        copy_weight(param, loaded)


class NemotronDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.norm_eps, norm=LayerNorm1P)


class NemotronModel(LayerNormModel):
    decoder_layer = NemotronDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return LayerNorm1P(config.hidden_size, config.norm_eps)


class NemotronForCausalLM(ArceeForCausalLM):
    model_class = NemotronModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias)
