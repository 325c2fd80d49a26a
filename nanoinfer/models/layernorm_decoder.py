"""The decoder parts of the LayerNorm families (StarCoder2, StableLM, Phi, GPT-NeoX, Cohere, OPT): LayerNorms (with
biases but Cohere's), dense (ungated) MLPs, LayerNorms on queries and keys, the parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) and the post-norm layer ln2(h + mlp(h)), h = ln1(x + attn(x))."""
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.activation import get_act
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.layernorm import LayerNorm, PerHeadLayerNorm
from nanoinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from nanoinfer.models.llama import AttentionOptions, LlamaAttention, LlamaModel


def norm_eps(config: PretrainedConfig) -> float:
    """The LayerNorms' epsilon: StarCoder2 names it `norm_epsilon`, GPT-2 `layer_norm_epsilon`, the others
    `layer_norm_eps`."""
    for name in ("norm_epsilon", "layer_norm_epsilon"):
        if hasattr(config, name):
            return getattr(config, name)
    return config.layer_norm_eps


class DenseMLP(nn.Module):
    """fc2(act(fc1(x))): StarCoder2's and GPT-2's c_fc / c_proj, Phi's fc1 / fc2, GPT-NeoX's dense_h_to_4h /
    dense_4h_to_h."""

    fc1_class: type[ColumnParallelLinear] = ColumnParallelLinear  # GPT-2's load their transposed weights
    fc2_class: type[RowParallelLinear] = RowParallelLinear

    def __init__(self, config: PretrainedConfig, bias: bool, intermediate_size: int | None = None,
                 hidden_act: str | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.fc1 = self.fc1_class(config.hidden_size, inter, bias)
        self.fc2 = self.fc2_class(inter, config.hidden_size, bias)
        self.act = get_act(hidden_act or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# (total heads, head_dim) -> the LayerNorm of those heads' queries (or keys), over x [tokens, heads, head_dim].
QKNormFactory = Callable[[int, int], nn.Module]


class QKLayerNormAttention(LlamaAttention):
    """The Llama attention with LayerNorms on each head's query and key before rope: one shared by all heads (Phi)
    or one per head (StableLM)."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, qk_norm: QKNormFactory):
        super().__init__(config, options)
        self.q_layernorm = qk_norm(self.qkv_proj.total_num_heads, self.head_dim)
        self.k_layernorm = qk_norm(self.qkv_proj.total_num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        if positions is not None:  # None: an encoder pass (see LLM.embed), no position encoding
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


def shared_qk_norm(eps: float) -> QKNormFactory:
    """One LayerNorm (weight and bias) over head_dim for all the heads (Phi's, Persimmon's q/k norms)."""
    return lambda heads, head_dim: LayerNorm(head_dim, eps)


def maybe_per_head_qk_norm_attention(config: PretrainedConfig, options: AttentionOptions, qk_norm: bool,
                                     eps: float) -> LlamaAttention:
    """The Llama attention, with a LayerNorm of each head's own on its query and key where qk_norm (StableLM,
    Cohere)."""
    if qk_norm:
        return QKLayerNormAttention(config, options, partial(PerHeadLayerNorm, eps=eps))
    return LlamaAttention(config, options)


# How a layer adds its sublayers: one after the other, or both from its input, with two norms or one; or one after
# the other with each norm after its add (post-norm).
Residual = Literal["sequential", "parallel", "parallel-one-norm", "post-norm"]


class LayerNormDecoderLayer(nn.Module):
    """Pre-norm with LayerNorms. Sequential: h = x + attn(ln1(x)); out = h + mlp(ln2(h)) (LlamaDecoderLayer's order).
    Parallel: out = x + attn(ln1(x)) + mlp(ln2(x)), with ln2 = ln1 where the family has a single norm (Phi,
    StableLM). Post-norm (OPT-350m): h = ln1(x + attn(x)); out = ln2(h + mlp(h)), no residual carried. Otherwise, as
    in LlamaDecoderLayer, the stream is x + residual, the add left to the next norm. norm: the
    LayerNorm class (hidden_size, eps), without bias (Cohere) or any parameter (OLMo) where the family's has none."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 residual: Residual = "sequential", norm: Callable[[int, float], nn.Module] = LayerNorm):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.parallel = residual.startswith("parallel")
        self.post_norm = residual == "post-norm"
        self.input_layernorm = norm(hidden_size, eps)
        self.post_attention_layernorm = (None if residual == "parallel-one-norm"
                                         else norm(hidden_size, eps))

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.post_norm:
            return self.forward_post_norm(positions, x, meta), None  # residual: None, after a post-norm layer
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(positions, x, meta)
        if not self.parallel:
            x, residual = self.post_attention_layernorm(attn, residual)
            return self.mlp(x), residual
        if self.post_attention_layernorm is not None:
            x = self.post_attention_layernorm(residual)
        return attn + self.mlp(x), residual

    def forward_post_norm(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata
                          ) -> torch.Tensor:
        x, _ = self.input_layernorm(self.self_attn(positions, x, meta), x)
        x, _ = self.post_attention_layernorm(self.mlp(x), x)
        return x


class ResidualSum(nn.Module):
    """In place of a final norm where a family has none (OPT-350m's post-norm layers): the stream x + residual, called
    as a norm is."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return (x if residual is None else x + residual), None


class LayerNormModel(LlamaModel):
    """LlamaModel with a final LayerNorm, bias-free where `norm_bias` is False (Cohere, MPT); subclasses set
    `decoder_layer`."""

    norm_bias = True

    @classmethod
    def final_norm(cls, config: PretrainedConfig) -> nn.Module:
        return LayerNorm(config.hidden_size, norm_eps(config), bias=cls.norm_bias)
