"""The attention layer and its backends; the backend is chosen once (selector.py), when the KV cache is allocated."""
import torch
from torch import nn

from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.layers.linear import copy_weight
from nanoinfer.utils.dist import tp_rank, tp_size


def get_backend(name: str, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    """"cpu": PyTorch (SDPA, plus the C decode kernel on CPU tensors), on any device; "flash": flash-attn on CUDA;
    "triton": paged Triton kernels on CUDA (on the CPU in Triton's interpreter)."""
    if name == "cpu":
        return CPUAttentionBackend(dtype, device)
    if name == "flash":
        from nanoinfer.layers.attention.flash import FlashAttentionBackend  # imports flash_attn and triton
        return FlashAttentionBackend(dtype, device)
    if name == "triton":
        from nanoinfer.layers.attention.triton import TritonAttentionBackend  # imports triton
        return TritonAttentionBackend(dtype, device)
    raise ValueError(f"unknown attention backend {name!r}; available: ['cpu', 'flash', 'triton']")


class Attention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends over each sequence's whole context, or over the
    last `sliding_window` positions of it (the query's own included). With `attention_chunk_size` (Llama 4's chunked
    local attention), a query at position p sees only its own chunk's keys, from p // attention_chunk_size *
    attention_chunk_size on (and within its window, where it has both). A non-causal pass (LLM.embed's encoder pass)
    drops a decoder's window and chunks, but keeps an `encoder_only` layer's window on both sides: keys within
    sliding_window - 1 positions of the query (ModernBERT's local layers; vLLM's encoder-only attention). With
    `logits_soft_cap` (Gemma 2), each scaled score s becomes logits_soft_cap * tanh(s / logits_soft_cap) before masking
    and softmax. With `value_prefix_dim` (DeepSeek's latent cache, MLA), each value is its key's first value_prefix_dim
    entries (all of them: DeepSeek-V4's K = V): the layer takes no v, only K is cached, and the output per head is
    value_prefix_dim wide. With `sinks` (GPT-OSS), a learned logit per head, the parameter `sinks` [num_heads], joins
    each softmax's denominator as a key whose value is 0. With `alibi_slopes` [the model's heads] (BLOOM, MPT), each
    head adds -slope * |query position - key position| to its scaled scores (after a soft cap; causally, slope * (key -
    query position)); this rank keeps its own heads' slopes, fp32, in the buffer of that name.
    num_heads, num_kv_heads: this tensor-parallel rank's."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 value_prefix_dim: int | None = None, sinks: bool = False, encoder_only: bool = False,
                 alibi_slopes: torch.Tensor | None = None, attention_chunk_size: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if attention_chunk_size is not None and attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1 or None, got {attention_chunk_size}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        if value_prefix_dim is not None and not 0 < value_prefix_dim <= head_dim:
            raise ValueError(f"value_prefix_dim must be in (0, head_dim={head_dim}] or None, got {value_prefix_dim}")
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.encoder_only, self.attention_chunk_size = encoder_only, attention_chunk_size
        self.value_prefix_dim = value_prefix_dim
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.first_head, self.total_heads = tp_rank() * num_heads, tp_size() * num_heads  # this rank's in the model's
        if alibi_slopes is not None and tuple(alibi_slopes.shape) != (self.total_heads,):
            raise ValueError(f"alibi_slopes must hold one slope per head ({self.total_heads}), got shape "
                             f"{tuple(alibi_slopes.shape)}")
        # Non-persistent: derived from the config, never in a checkpoint; fp32 whatever the model's dtype.
        self.register_buffer("alibi_slopes", None if alibi_slopes is None else alibi_slopes.narrow(
            0, self.first_head, num_heads).to(torch.get_default_device(), torch.float32), persistent=False)
        self.k_cache = self.v_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, head_dim], set by ModelRunner
        self.backend = None  # set by ModelRunner with the cache

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The sinks of this rank's heads, from all heads' [total heads]."""
        if tuple(loaded.shape) != (self.total_heads,):
            raise ValueError(f"shape mismatch: checkpoint sinks {tuple(loaded.shape)}, expected ({self.total_heads},)")
        copy_weight(param, loaded.narrow(0, self.first_head, self.num_heads))

    def cache_values_per_token(self) -> int:
        """What the cache holds per token: K and V of every KV head, or K alone when V is its prefix."""
        return self.num_kv_heads * self.head_dim * (1 if self.value_prefix_dim else 2)

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Zeros, not empty: never-written slots are masked, but NaN garbage would leak through the softmax.
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        # With V as K's prefix, the V cache is a view of the K cache: backends read it like any V cache.
        self.v_cache = (self.k_cache[..., :self.value_prefix_dim] if self.value_prefix_dim
                        else torch.zeros(shape, dtype=dtype, device=device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
                ) -> torch.Tensor:
        self.store(k, v, meta)
        return self.attend(q, k, v, meta)

    def store(self, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata) -> None:
        """This step's K/V into the paged cache (K alone with value_prefix_dim)."""
        # Nothing to store in an encoder pass, nor during the warm-up that sizes the cache on CUDA.
        if meta.slot_mapping is None or not self.k_cache.numel():
            return
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.value_prefix_dim:  # V is K's prefix: the backend stores K alone (v None)
            self.backend.store_kvcache(k, None, self.k_cache, None, meta.slot_mapping)
        else:
            self.backend.store_kvcache(k, v.view(-1, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache,
                                       meta.slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
               ) -> torch.Tensor:
        """Attention over the cache as `meta` describes it, this step's K/V stored already."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = k[..., :self.value_prefix_dim] if self.value_prefix_dim else v.view(-1, self.num_kv_heads, self.head_dim)
        window = self.sliding_window if meta.causal or self.encoder_only else None
        chunk = self.attention_chunk_size if meta.causal else None
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, window,
                                    self.logits_soft_cap, self.sinks, self.alibi_slopes, chunk)

__all__ = ["Attention", "AttentionMetadata", "get_backend"]
