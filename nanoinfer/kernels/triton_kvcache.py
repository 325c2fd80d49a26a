"""Triton kernel writing this step's K/V into the paged cache by slot_mapping (CUDA; importing it needs triton)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_stride, v_stride,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_V: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # token * stride and slot * D in int64: large steps and caches
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == -1:  # a padded row (CUDA-graph batch padding): nothing to store
        return
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    k = tl.load(k_ptr + token * k_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * D + offs, k, mask=mask)
    if HAS_V:  # else a cache whose values are its keys' prefix: K alone
        v = tl.load(v_ptr + token * v_stride + offs, mask=mask)
        tl.store(v_cache_ptr + slot * D + offs, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] (rows may be strided, heads packed); caches [blocks, block_size,
    kv_heads, head_dim] contiguous; slot_mapping [tokens] int, -1 = skip. v None: k alone."""
    num_tokens, num_heads, head_dim = k.shape
    d = num_heads * head_dim
    has_v = v is not None
    v, v_cache = (v, v_cache) if has_v else (k, k_cache)  # not read without V
    assert k.stride(-1) == v.stride(-1) == 1 and k.stride(1) == v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (num_heads, head_dim)
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                         D=d, BLOCK_D=triton.next_power_of_2(d), HAS_V=has_v)
