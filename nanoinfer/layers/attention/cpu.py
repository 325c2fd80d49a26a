"""Paged attention in plain PyTorch: gather each sequence's blocks, one batched SDPA call per layer."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoinfer.layers.attention.metadata import AttentionMetadata


@dataclass
class CPUState:
    mask: torch.Tensor  # [num_seqs, 1, max_seqlen_q, num_key_slots] bool: causal and within the context
    pad_index: torch.Tensor | None  # flat token -> row of the [num_seqs * max_seqlen_q] padded layout
    num_blocks: int  # block-table columns to gather


class CPUAttentionBackend:
    name = "cpu"

    def prepare(self, meta: AttentionMetadata) -> None:
        bs, lq = meta.block_size, meta.max_seqlen_q
        num_blocks = -(-meta.max_seqlen_k // bs)
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
        ctx = meta.context_lens.long()
        q_pos = (ctx - q_lens).unsqueeze(1) + torch.arange(lq)  # [B, lq]; padded rows still see key 0
        k_pos = torch.arange(num_blocks * bs)
        mask = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < ctx.view(-1, 1, 1))
        pad_index = None
        if lq > 1:
            row = torch.arange(meta.num_seqs * lq).view(-1, lq)
            pad_index = row[torch.arange(lq) < q_lens.unsqueeze(1)]
        meta.backend_state = CPUState(mask.unsqueeze(1), pad_index, num_blocks)

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]; K/V already stored."""
        state: CPUState = meta.backend_state
        b, lq, (_, h, d) = meta.num_seqs, meta.max_seqlen_q, q.shape
        if state.pad_index is not None:
            q = q.new_zeros(b * lq, h, d).index_copy_(0, state.pad_index, q)
        q = q.view(b, lq, h, d).transpose(1, 2)
        tables = meta.block_tables[:, :state.num_blocks]
        k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, slots, head_dim]
        v = v_cache[tables].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=state.mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b * lq, h * d)
        return o if state.pad_index is None else o[state.pad_index]
