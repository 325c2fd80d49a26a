"""Helium: Llama with interleaved rope, RMSNorms that apply their weight in fp32 (OLMo 2's rounding), q/k/v biases
where `attention_bias` (never on the output projection)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.layernorm import OlmoRMSNorm
from nanoinfer.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class HeliumDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp, OlmoRMSNorm)


class HeliumModel(LlamaModel):
    decoder_layer = HeliumDecoderLayer

    @staticmethod
    def final_norm(config: PretrainedConfig) -> nn.Module:
        return OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)


class HeliumForCausalLM(LlamaForCausalLM):
    model_class = HeliumModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, rope_interleaved=True)
