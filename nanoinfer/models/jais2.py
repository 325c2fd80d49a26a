"""Jais 2: Nemotron's layer (pre-norm LayerNorms, the non-gated relu^2 MLP with biases where `mlp_bias`, q/k/v/o
biases where `attention_bias`) with plain LayerNorms (`layer_norm_eps`) and rope over the whole head."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention
from nanoinfer.models.nemotron import NemotronForCausalLM


class Jais2DecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, config.layer_norm_eps)


class Jais2Model(LayerNormModel):
    decoder_layer = Jais2DecoderLayer


class Jais2ForCausalLM(NemotronForCausalLM):
    model_class = Jais2Model
