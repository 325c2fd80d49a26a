"""GPT-NeoX (Pythia, GPT-NeoX-20B): the fused `query_key_value` projection laid out per head (rows [heads, 3 (q, k,
v), head_dim], regrouped into q, k, v on load), partial rotary (`rotary_pct`), biases, a dense GeLU MLP
(dense_h_to_4h, dense_4h_to_h), two LayerNorms per layer, used in parallel, x + attn(ln1(x)) + mlp(ln2(x)), where
`use_parallel_residual` (else one after the other), and an untied LM head (`embed_out`)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import RegroupedQKVLinear
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM


class GroupedQKVLinear(RegroupedQKVLinear):
    """A fused q/k/v projection stored grouped by KV head: each KV head's query heads, then its k, then its v.
    GPT-NeoX's (one query head per group: [heads, (q, k, v), head_dim]) and Falcon's (multi-query: one group)."""

    def parts(self, loaded: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """loaded: query_key_value's weight or bias, [kv heads x (q per kv head + 2) x head_dim, ...]."""
        per_group = self.total_num_heads // self.total_num_kv_heads + 2
        grouped = loaded.reshape(self.total_num_kv_heads, per_group, self.head_size, *loaded.shape[1:])
        return [("q", grouped[:, :-2]), ("k", grouped[:, -2]), ("v", grouped[:, -1])]


class GPTNeoXAttention(LlamaAttention):
    qkv_class = GroupedQKVLinear


class GPTNeoXLayer(LayerNormDecoderLayer):
    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(GPTNeoXAttention(config, options), mlp, config.hidden_size, config.layer_norm_eps,
                         "parallel" if config.use_parallel_residual else "sequential")


class GPTNeoXModel(LayerNormModel):
    decoder_layer = GPTNeoXLayer


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoXModel
    weight_name_substitutions = {
        "gpt_neox.": "model.",
        ".embed_in.": ".embed_tokens.",
        ".final_layer_norm.": ".norm.",
        "embed_out.": "lm_head.",  # the Hub's name; transformers 5 calls it lm_head
        ".attention.query_key_value.": ".self_attn.qkv_proj.",
        ".attention.dense.": ".self_attn.o_proj.",
        ".mlp.dense_h_to_4h.": ".mlp.fc1.",
        ".mlp.dense_4h_to_h.": ".mlp.fc2.",
    }
    # Older checkpoints (Pythia's) also hold the attention's causal-mask buffers.
    ignored_weight_suffixes = (".attention.bias", ".attention.masked_bias")

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config, bias=True)
