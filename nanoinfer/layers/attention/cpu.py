"""Paged attention on the CPU: a C kernel for decode steps when it builds; otherwise gather each
sequence's blocks and make one batched SDPA call per layer."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoinfer.kernels.cpu import paged_decode_attention, paged_decode_attention_available
from nanoinfer.layers.attention.metadata import AttentionMetadata


@dataclass
class CPUState:
    mask: torch.Tensor  # [num_seqs, 1, max_seqlen_q, num_key_slots] bool: causal and within the context
    pad_index: torch.Tensor | None  # flat token -> row of the [num_seqs * max_seqlen_q] padded layout
    block_index: torch.Tensor  # [num_seqs * blocks_per_seq] cache blocks to gather (padding -> block 0)


class CPUAttentionBackend:
    name = "cpu"

    def __init__(self, dtype: torch.dtype) -> None:
        # Gathered K/V land in buffers reused by every layer and step: a fresh tensor of this size is
        # a fresh mmap, and its page faults cost several times the copy itself.
        self._buffers: dict[str, torch.Tensor] = {}
        # The kernel reads K/V in place: no gather, no padding, each KV head read once for its query heads.
        self.decode_kernel = dtype == torch.float32 and paged_decode_attention_available()

    def _gather(self, name: str, cache: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
        shape = (block_index.numel(), *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=cache.dtype)
        return torch.index_select(cache, 0, block_index, out=buf[:numel].view(shape))

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.is_decode and self.decode_kernel:
            return  # the kernel reads block_tables and context_lens as they are
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
        block_index = meta.block_tables[:, :num_blocks].clamp_min(0).flatten()
        meta.backend_state = CPUState(mask.unsqueeze(1), pad_index, block_index)

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]; K/V already stored."""
        if meta.is_decode and self.decode_kernel:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          meta.max_seqlen_k, scale).flatten(1)
        state: CPUState = meta.backend_state
        b, lq, (_, h, d) = meta.num_seqs, meta.max_seqlen_q, q.shape
        if state.pad_index is not None:
            q = q.new_zeros(b * lq, h, d).index_copy_(0, state.pad_index, q)
        q = q.view(b, lq, h, d).transpose(1, 2)
        slots = state.mask.shape[-1]
        k = self._gather("k", k_cache, state.block_index).view(b, slots, *k_cache.shape[2:]).transpose(1, 2)
        v = self._gather("v", v_cache, state.block_index).view(b, slots, *v_cache.shape[2:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=state.mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b * lq, h * d)
        return o if state.pad_index is None else o[state.pad_index]
