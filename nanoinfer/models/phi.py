"""Phi (phi-1, phi-1.5, phi-2): one LayerNorm feeding the attention and the MLP in parallel, x + attn(ln(x)) +
mlp(ln(x)); biases on q/k/v, the output projection (`dense`), the dense "gelu_new" MLP (fc1, fc2) and the LM head;
partial rotary; optionally LayerNorms on queries and keys (`qk_layernorm`, one shared by all heads)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.layernorm_decoder import (DenseMLP, LayerNormDecoderLayer, LayerNormModel, QKLayerNormAttention,
                                                Residual, shared_qk_norm)
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM


class PhiDecoderLayer(LayerNormDecoderLayer):
    # Persimmon's: GPT-NeoX's per-head query_key_value, one sublayer after the other.
    attention_classes: tuple[type[QKLayerNormAttention], type[LlamaAttention]] = (QKLayerNormAttention, LlamaAttention)
    residual: Residual = "parallel-one-norm"

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        eps = config.layer_norm_eps
        with_qk_norm, without = self.attention_classes
        if config.qk_layernorm:
            attention = with_qk_norm(config, options, shared_qk_norm(eps))
        else:
            attention = without(config, options)
        super().__init__(attention, mlp, config.hidden_size, eps, self.residual)


class PhiModel(LayerNormModel):
    decoder_layer = PhiDecoderLayer


class PhiForCausalLM(LlamaForCausalLM):
    model_class = PhiModel
    lm_head_bias = True
    weight_name_substitutions = {".final_layernorm.": ".norm.", ".self_attn.dense.": ".self_attn.o_proj."}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, bias=True)
