"""Persimmon (Adept's Persimmon-8B; Fuyu's language model): GPT-NeoX's fused `query_key_value` laid out per head
(rows [heads, 3 (q, k, v), head_dim]) with biases, optionally LayerNorms on queries and keys before rope
(`qk_layernorm`, one shared by all heads), partial rotary, two LayerNorms per layer one after the other (pre-norm),
a dense relu^2 MLP (dense_h_to_4h, dense_4h_to_h) with biases, an untied LM head without one."""
from nanoinfer.models.gpt_neox import GPTNeoXAttention, GroupedQKVLinear
from nanoinfer.models.layernorm_decoder import QKLayerNormAttention
from nanoinfer.models.phi import PhiDecoderLayer, PhiForCausalLM, PhiModel


class PersimmonQKNormAttention(QKLayerNormAttention):
    qkv_class = GroupedQKVLinear


class PersimmonDecoderLayer(PhiDecoderLayer):
    attention_classes = (PersimmonQKNormAttention, GPTNeoXAttention)
    residual = "sequential"


class PersimmonModel(PhiModel):
    decoder_layer = PersimmonDecoderLayer


class PersimmonForCausalLM(PhiForCausalLM):  # Phi's biases but the LM head's
    model_class = PersimmonModel
    lm_head_bias = False
    packed_modules_mapping = {}  # query_key_value holds q, k and v per head: its layer's weight_loader splits them
    weight_name_substitutions = {
        **PhiForCausalLM.weight_name_substitutions,
        ".self_attn.query_key_value.": ".self_attn.qkv_proj.",
        ".mlp.dense_h_to_4h.": ".mlp.fc1.",
        ".mlp.dense_4h_to_h.": ".mlp.fc2.",
    }
