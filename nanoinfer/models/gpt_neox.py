"""GPT-NeoX (Pythia, GPT-NeoX-20B): the fused `query_key_value` projection laid out per head (rows [heads, 3 (q, k,
v), head_dim], regrouped into q, k, v on load), partial rotary (`rotary_pct`), biases, a dense GeLU MLP
(dense_h_to_4h, dense_4h_to_h), two LayerNorms per layer, used in parallel, x + attn(ln1(x)) + mlp(ln2(x)), where
`use_parallel_residual` (else one after the other), and an untied LM head (`embed_out`)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.linear import QKVParallelLinear
from nanoinfer.models.layernorm_decoder import DenseMLP, LayerNormDecoderLayer, LayerNormModel
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM


class GPTNeoXQKVLinear(QKVParallelLinear):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """loaded: query_key_value's weight or bias, rows grouped by head: [heads x (q, k, v) x head_dim, ...]."""
        heads, rows = self.total_num_heads, 3 * self.total_num_heads * self.head_size
        if loaded.shape[0] != rows:
            raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, expected {rows} "
                             f"({heads} heads x 3 x {self.head_size})")
        per_head = loaded[...].reshape(heads, 3, self.head_size, *loaded.shape[1:])
        for i, shard_id in enumerate(("q", "k", "v")):
            super().weight_loader(param, per_head[:, i].reshape(heads * self.head_size, *loaded.shape[1:]), shard_id)


class GPTNeoXAttention(LlamaAttention):
    qkv_class = GPTNeoXQKVLinear


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
