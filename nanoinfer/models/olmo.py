"""OLMo (OLMo 1): Llama's attention and gated SiLU MLP with LayerNorms that have neither weight nor bias (epsilon
1e-5), q/k/v clamped to [-clip_qkv, clip_qkv] where the config sets it, optional biases on q/k/v/o."""
from functools import partial

from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import LayerNorm
from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM

OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: fixed, not in the config


class OlmoDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, OLMO_NORM_EPS,
                         norm=partial(LayerNorm, affine=False))


class OlmoModel(LayerNormModel):
    decoder_layer = OlmoDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, OLMO_NORM_EPS, affine=False)


class OlmoForCausalLM(LlamaForCausalLM):
    model_class = OlmoModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, clip_qkv=config.clip_qkv)
