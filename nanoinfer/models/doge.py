"""Doge (`DogeForCausalLM`, SmallDoge's): the Llama decoder with per-head q/k RMSNorms before rope and dynamic mask
attention: each key's score gains, per KV head, exp(A * softplus(dt_proj(all heads' values))), computed from the
key's own value and so cached with it; each sublayer's residual stream scaled per channel (`input_residual`,
`post_attention_residual`) before the sublayer's output joins it. Dense MLPs only."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.linear import RowParallelLinear
from nanoinfer.layers.recurrent import load_rank_rows
from nanoinfer.models.config_checks import config_source
from nanoinfer.models.llama import (AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                    LlamaModel, layer_sliding_window)
from nanoinfer.utils.dist import tp_rank, tp_size

# Key widths gained by the attention's cache: one for the score bias, the rest zeros keeping widths multiples of 8.
KEY_BIAS_PAD = 8  # the registry's cache head pad for Doge


def check_config(config: PretrainedConfig) -> None:
    """What this implementation cannot do, refused by name rather than run differently from transformers."""
    where = config_source(config)
    if config.is_moe:
        raise ValueError(f"is_moe={config.is_moe} in {where} is not supported: transformers' CDMoE routes each token "
                         "on router logits mixed across the batch's tokens (its own note), which no engine batch "
                         "reproduces")
    window = config.sliding_window or config.max_position_embeddings
    if min(window, config.max_position_embeddings) > config.keep_window_size:
        raise ValueError(f"keep_window_size={config.keep_window_size} in {where} is not supported below the keys a "
                         f"query sees (max_position_embeddings={config.max_position_embeddings}, sliding_window="
                         f"{config.sliding_window}): its top-k dynamic mask is not implemented")
    if config.num_key_value_heads % tp_size():
        raise ValueError(f"tensor_parallel_size={tp_size()} does not divide num_key_value_heads="
                         f"{config.num_key_value_heads} in {where}: dt_proj reads every KV head's values")


class DogeAttention(LlamaAttention):
    """The score bias of key j, KV head h: b[j, h] = exp(A[h] * softplus(dt_proj(v_j)[h])), rides in the attention
    as an extra key entry b / scale against a query entry of 1 (q . k * scale + b; the 1 exact in every dtype),
    values zero-padded alike and each head's output cut back: every backend and the paged cache serve it as plain
    attention. dt_proj is row-parallel (each rank holds its KV heads' value columns; the all-reduce gives every
    head's dt)."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions):
        super().__init__(config, options)
        total_kv_heads = config.num_key_value_heads
        self.dt_proj = RowParallelLinear(total_kv_heads * self.head_dim, total_kv_heads, config.attention_bias)
        self.A = nn.Parameter(torch.empty(self.num_kv_heads), requires_grad=False)
        self.first_kv_head = tp_rank() * self.num_kv_heads
        self.scale = self.head_dim ** -0.5
        # The query's extra entries: 1 against the bias, zeros against the padding.
        self.register_buffer("query_pad", torch.eye(1, KEY_BIAS_PAD)[0], persistent=False)
        self.attn = Attention(self.num_heads, self.head_dim + KEY_BIAS_PAD, self.scale, self.num_kv_heads,
                              options.sliding_window)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A: this rank's KV heads."""
        load_rank_rows(param, loaded)

    def key_bias(self, v: torch.Tensor) -> torch.Tensor:
        """v [tokens, this rank's KV heads * head_dim] -> each key's score bias [tokens, this rank's KV heads]."""
        dt = self.dt_proj(v).narrow(1, self.first_kv_head, self.num_kv_heads)
        return torch.exp(self.A * F.softplus(dt))

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if positions is not None:  # None: an encoder pass (see LLM.embed)
            q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        bias = self.key_bias(v)
        q = torch.cat([q, self.query_pad.to(q.dtype).expand(*q.shape[:2], -1)], -1)
        k = torch.cat([k, F.pad((bias / self.scale).to(k.dtype)[..., None], (0, KEY_BIAS_PAD - 1))], -1)
        v = F.pad(v.view(-1, self.num_kv_heads, self.head_dim), (0, KEY_BIAS_PAD))
        o = self.attn(q, k, v, meta).view(-1, self.num_heads, self.head_dim + KEY_BIAS_PAD)
        return self.o_proj(o[..., :self.head_dim].flatten(1))


class DogeDecoderLayer(LlamaDecoderLayer):
    """Each sublayer's output joins the residual stream scaled per channel: the scaled stream is handed on, and the
    next norm adds the two (transformers' `scale * residual + h`)."""
    attention_class = DogeAttention

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, mlp: nn.Module):
        super().__init__(config, options, mlp)
        self.input_residual = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.post_attention_residual = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)

    def forward(self, positions: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.attention(positions, x, residual, meta)
        x, residual = self.post_attention_layernorm(x, residual * self.input_residual)
        return self.mlp(x), residual * self.post_attention_residual


class DogeModel(LlamaModel):
    decoder_layer = DogeDecoderLayer


class DogeForCausalLM(LlamaForCausalLM):
    model_class = DogeModel

    @staticmethod
    def attention_options(config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                                sliding_window=layer_sliding_window(config, layer_idx))

    def __init__(self, config: PretrainedConfig):
        check_config(config)
        super().__init__(config)
