"""OLMo (OLMo 1): Llama's attention and gated SiLU MLP with LayerNorms that have neither weight nor bias (epsilon
1e-5), q/k/v clamped to [-clip_qkv, clip_qkv] where the config sets it, optional biases on q/k/v/o."""
from collections.abc import Callable
from functools import partial

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM

OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: fixed, not in the config


class OlmoDecoderLayer(LayerNormDecoderLayer):
    norm: Callable[[int, float], LayerNorm] = partial(LayerNorm, affine=False)  # DBRX's: weight, no bias

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, OLMO_NORM_EPS, norm=self.norm)


class OlmoModel(LayerNormModel):
    decoder_layer = OlmoDecoderLayer

    @classmethod
    def final_norm(cls, config: PretrainedConfig) -> nn.Module:
        return cls.decoder_layer.norm(config.hidden_size, OLMO_NORM_EPS)


class OlmoForCausalLM(LlamaForCausalLM):
    model_class = OlmoModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, clip_qkv=config.clip_qkv)
