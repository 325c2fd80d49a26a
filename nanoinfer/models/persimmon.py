"""Persimmon (Adept's Persimmon-8B; Fuyu's language model): GPT-NeoX's fused `query_key_value` laid out per head
(rows [heads, 3 (q, k, v), head_dim]) with biases, optionally LayerNorms on queries and keys before rope
(`qk_layernorm`, one shared by all heads), partial rotary, two LayerNorms per layer one after the other (pre-norm),
a dense relu^2 MLP (dense_h_to_4h, dense_4h_to_h) with biases, an untied LM head without one."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt_neox import GPTNeoXAttention, GroupedQKVLinear
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormModel, QKLayerNormAttention
from nanoinfer.models.llama import AttentionOptions, LlamaForCausalLM
from nanoinfer.models.phi import PhiDecoderLayer


class PersimmonQKNormAttention(QKLayerNormAttention):
    qkv_class = GroupedQKVLinear


class PersimmonDecoderLayer(PhiDecoderLayer):
    attention_classes = (PersimmonQKNormAttention, GPTNeoXAttention)
    residual = "sequential"


class PersimmonModel(LayerNormModel):
    decoder_layer = PersimmonDecoderLayer


class PersimmonForCausalLM(LlamaForCausalLM):
    model_class = PersimmonModel
    packed_modules_mapping = {}  # query_key_value holds q, k and v per head: its layer's weight_loader splits them
    weight_name_substitutions = {
        ".final_layernorm.": ".norm.",
        ".self_attn.query_key_value.": ".self_attn.qkv_proj.",
        ".self_attn.dense.": ".self_attn.o_proj.",
        ".mlp.dense_h_to_4h.": ".mlp.fc1.",
        ".mlp.dense_4h_to_h.": ".mlp.fc2.",
    }

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, bias=True)
