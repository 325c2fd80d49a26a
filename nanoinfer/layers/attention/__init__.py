"""The attention layer and its backends; the backend is chosen once, when the KV cache is allocated."""
import torch
from torch import nn

from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.attention.metadata import AttentionMetadata

BACKENDS = {"cpu": CPUAttentionBackend}


def get_backend(name: str, dtype: torch.dtype) -> CPUAttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name](dtype)


class Attention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends over each sequence's whole context, or over the
    last `sliding_window` positions of it (the query's own included)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, head_dim], set by ModelRunner
        self.backend: CPUAttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if meta.slot_mapping is not None:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)


__all__ = ["Attention", "AttentionMetadata", "get_backend"]
