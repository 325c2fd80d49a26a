"""StarCoder2: pre-norm with LayerNorms (biases), biases on q/k/v/o and on a dense GeLU-tanh MLP (c_fc, c_proj),
rope, and a sliding window on every layer where `sliding_window` is set."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel, norm_eps
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, layer_sliding_window


class Starcoder2DecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(LlamaAttention(config, options), mlp, config.hidden_size, norm_eps(config))


class Starcoder2Model(LayerNormModel):
    decoder_layer = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model
    weight_name_substitutions = {".mlp.c_fc.": ".mlp.fc1.", ".mlp.c_proj.": ".mlp.fc2."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.use_bias, o_bias=config.use_bias,
                                sliding_window=layer_sliding_window(config, layer_idx))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, config.use_bias)
