"""Falcon with rope (not ALiBi): the fused `query_key_value` grouped by KV head; the new decoder architecture
(Falcon-40B/180B, Falcon 2: `num_kv_heads`, the parallel residual with a norm for each sublayer, or one), the 7B
style (multi-query, one norm, parallel) or one after the other (`parallel_attn` false); biases where `bias`, a
dense MLP (dense_h_to_4h, dense_4h_to_h) of `activation`, LayerNorms with biases."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt_neox import GPTNeoXAttention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel, Residual
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    if config.alibi:
        raise ValueError("alibi=True in the model config: ALiBi is not supported for Falcon (rotary variants only)")


def residual(config: PretrainedConfig) -> Residual:
    """transformers' FalconDecoderLayer: the new architecture always adds both sublayers to the input, each after a
    norm of its own unless `num_ln_in_parallel_attn` is 1."""
    if config.new_decoder_architecture:
        return "parallel-one-norm" if config.num_ln_in_parallel_attn == 1 else "parallel"
    return "parallel-one-norm" if config.parallel_attn else "sequential"


def num_kv_heads(config: PretrainedConfig) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconDecoderLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPTNeoXAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon,
                         residual(config))


class FalconModel(LayerNormModel):
    decoder_layer = FalconDecoderLayer


class FalconForCausalLM(LlamaForCausalLM):
    model_class = FalconModel
    packed_modules_mapping = {}  # query_key_value holds q, k and v grouped: its layer's weight_loader splits them
    check_config = staticmethod(check_config)
    weight_name_substitutions = {
        "^transformer.h.": "model.layers.",
        "^transformer.word_embeddings.": "model.embed_tokens.",
        "^transformer.ln_f.": "model.norm.",
        "^transformer.": "model.",
        ".self_attention.query_key_value.": ".self_attn.qkv_proj.",
        ".self_attention.dense.": ".self_attn.o_proj.",
        ".ln_attn.": ".input_layernorm.",
        ".ln_mlp.": ".post_attention_layernorm.",
        ".mlp.dense_h_to_4h.": ".mlp.fc1.",
        ".mlp.dense_4h_to_h.": ".mlp.fc2.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.bias, o_bias=config.bias, num_kv_heads=num_kv_heads(config))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, config.bias, config.ffn_hidden_size, config.activation)

    def __init__(self, config: PretrainedConfig):
        self.check_config(config)
        super().__init__(config)
