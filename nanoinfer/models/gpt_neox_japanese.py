"""GPT-NeoX-Japanese: GPT-NeoX's per-head fused `query_key_value` and partial rope (`rotary_pct`, now
rope_parameters' partial_rotary_factor) without biases, but for the last layer's output projection
(`attention.dense_bias`, added before the residual); two LayerNorms one after the other; a bias-free dense MLP
`intermediate_multiple_size` times the hidden size; a tied LM head (`embed_out`)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt_neox import GPTNeoXAttention, GPTNeoXForCausalLM
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions


class GPTNeoXJapaneseLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPTNeoXAttention(config, options), mlp, config.hidden_size, config.layer_norm_eps)


class GPTNeoXJapaneseModel(LayerNormModel):
    decoder_layer = GPTNeoXJapaneseLayer


class GPTNeoXJapaneseForCausalLM(GPTNeoXForCausalLM):
    model_class = GPTNeoXJapaneseModel
    weight_name_substitutions = {"^gpt_neox_japanese.": "gpt_neox.", ".attention.dense_bias": ".self_attn.o_proj.bias",
                                 **GPTNeoXForCausalLM.weight_name_substitutions}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(o_bias=layer_idx == config.num_hidden_layers - 1)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, False, int(config.hidden_size * config.intermediate_multiple_size))
