"""DiffLlama: Llama with differential attention (arXiv 2410.05258) as transformers computes it. Its value heads come
in pairs (p, p + kv/2); every query head h attends with its own key head's softmax map to the two values of its KV
head's pair, giving a 2 x head_dim output, and query heads h and h + heads/2 combine as o_h - lambda o_{h + heads/2},
normalized (weightless RMSNorm over 2 x head_dim) and scaled by 1 - lambda_init, with lambda = exp(q1 . k1) -
exp(q2 . k2) + lambda_init from the layer's learned vectors and lambda_init = 0.8 - 0.6 exp(-0.3 layer).

On the paged cache this is one ordinary attention call of head size 2 x head_dim: each key is zero-padded to that
width (the scores are unchanged), each KV head's value is its pair's two value heads side by side. The heads load in
pair order (KV heads p and p + kv/2 adjacent, each query group with its KV head), so the two heads a combination
takes sit side by side, and under tensor parallelism on one rank, with the value heads they read."""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.layernorm import rms_normalize
from nanoinfer.layers.linear import QKVParallelLinear, copy_weight
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from nanoinfer.utils.dist import tp_size


@dataclass(frozen=True)
class DifferentialAttentionOptions(AttentionOptions):
    lambda_init: float = 0.0


def check_config(config: PretrainedConfig) -> None:
    """What the pairing needs, refused by name (transformers refuses an odd num_key_value_heads as well)."""
    kv_heads = config.num_key_value_heads
    if kv_heads % 2 or (kv_heads // 2) % tp_size():
        raise ValueError(f"num_key_value_heads={kv_heads} in the model config: differential attention pairs the KV "
                         f"heads, and each of the tensor_parallel_size={tp_size()} ranks must hold whole pairs")
    if config.attention_dropout:
        raise ValueError(f"attention_dropout={config.attention_dropout} in the model config: transformers refuses it")


def pair_order(loaded: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A q, k or v projection's rows (grouped by KV head, in order) with KV groups p and p + num_kv_heads / 2
    adjacent."""
    return loaded.reshape(2, num_kv_heads // 2, -1, *loaded.shape[1:]).transpose(0, 1).reshape(loaded.shape)


class PairedQKVParallelLinear(QKVParallelLinear):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is not None:
            loaded = pair_order(loaded[...], self.total_num_kv_heads)
        super().weight_loader(param, loaded, shard_id)


class DifferentialAttention(Attention):
    """Built as Attention is (head_dim: the model's); attends over heads twice as wide (see the module's docstring)
    and returns the differential combination, [tokens, heads * head_dim]."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, *args, **kwargs):
        super().__init__(num_heads, 2 * head_dim, scale, num_kv_heads, *args, **kwargs)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.empty(head_dim), requires_grad=False) for _ in range(4))
        self.lambda_init, self.eps = 0.0, 1e-6  # the layer's, set by DiffLlamaAttention

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param, loaded)  # the lambda vectors, whole on every rank (Attention's loader is for sinks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens, half = q.shape[0], self.head_dim // 2
        q = F.pad(q.view(tokens, self.num_heads, half), (0, half))
        k = F.pad(k.view(tokens, self.num_kv_heads, half), (0, half))
        pairs = self.num_kv_heads // 2
        v = v.reshape(tokens, pairs, 1, self.head_dim).expand(-1, -1, 2, -1).reshape(tokens, -1, self.head_dim)
        o = super().forward(q, k, v, meta).view(tokens, pairs, 2, -1)
        o = (o[:, :, 0] - self.differential_lambda(q.dtype) * o[:, :, 1]).view(tokens, -1, self.head_dim)
        return ((1 - self.lambda_init) * rms_normalize(o, self.eps)).flatten(1)

    def differential_lambda(self, dtype: torch.dtype) -> torch.Tensor:
        """exp(q1 . k1) - exp(q2 . k2) + lambda_init, each exponential rounded to the model's dtype, as transformers
        rounds them."""
        def term(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.exp(torch.sum(a * b, dim=-1, dtype=torch.float32)).to(dtype)
        return term(self.lambda_q1, self.lambda_k1) - term(self.lambda_q2, self.lambda_k2) + self.lambda_init


class DiffLlamaAttention(LlamaAttention):
    qkv_class = PairedQKVParallelLinear
    attn_class = DifferentialAttention

    def __init__(self, config: PretrainedConfig, options: DifferentialAttentionOptions):
        check_config(config)
        super().__init__(config, options)
        self.attn.lambda_init, self.attn.eps = options.lambda_init, config.rms_norm_eps


class DiffLlamaDecoderLayer(LlamaDecoderLayer):
    attention_class = DiffLlamaAttention


class DiffLlamaModel(LlamaModel):
    decoder_layer = DiffLlamaDecoderLayer


class DiffLlamaForCausalLM(LlamaForCausalLM):
    model_class = DiffLlamaModel
    weight_name_substitutions = {".self_attn.lambda_": ".self_attn.attn.lambda_"}

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return DifferentialAttentionOptions(qkv_bias=bias, o_bias=bias,
                                            lambda_init=0.8 - 0.6 * math.exp(-0.3 * layer_idx))
