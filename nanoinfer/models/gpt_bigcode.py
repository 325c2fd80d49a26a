"""GPTBigCode (StarCoder 1, SantaCoder): GPT-2's layout (learned absolute positions, pre-norm LayerNorms, biases
everywhere, the fused c_attn, tied embeddings) with nn.Linear weights (not Conv1D) and multi-query attention
(`multi_query`: one KV head, c_attn's rows q | k | v; without it, grouped per head as GPT-NeoX's)."""
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.models.gpt2 import GPT2LMHeadModel, GPT2Model
from nanoinfer.models.gpt_neox import GPTNeoXAttention
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer
from nanoinfer.models.llama import AttentionOptions


class GPTBigCodeBlock(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPTNeoXAttention(config, options), mlp, config.hidden_size, config.layer_norm_epsilon)


class GPTBigCodeModel(GPT2Model):
    decoder_layer = GPTBigCodeBlock


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    model_class = GPTBigCodeModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        scale = None if config.scale_attn_weights else 1.0
        return AttentionOptions(qkv_bias=True, o_bias=True, rope=False, scale=scale,
                                num_kv_heads=1 if config.multi_query else None)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, True, config.n_inner or 4 * config.hidden_size, config.activation_function)
