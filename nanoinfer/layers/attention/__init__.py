"""The attention layer and its backends; the backend is chosen once (selector.py), when the KV cache is allocated."""
import torch
from torch import nn

from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.attention.metadata import AttentionMetadata


def get_backend(name: str, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    """"cpu": PyTorch (SDPA, plus the C decode kernel on CPU tensors), on any device; "flash": flash-attn on CUDA."""
    if name == "cpu":
        return CPUAttentionBackend(dtype, device)
    if name == "flash":
        from nanoinfer.layers.attention.flash import FlashAttentionBackend  # imports flash_attn and triton
        return FlashAttentionBackend(dtype, device)
    raise ValueError(f"unknown attention backend {name!r}; available: ['cpu', 'flash']")


class Attention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends over each sequence's whole context."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache = self.v_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, head_dim], set by ModelRunner
        self.backend = None  # set by ModelRunner with the cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel():  # no cache yet during the warm-up that sizes it on CUDA
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)


__all__ = ["Attention", "AttentionMetadata", "get_backend"]
