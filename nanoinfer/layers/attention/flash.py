"""Paged attention on CUDA through flash-attn: varlen prefill (over the paged cache through block_table when a
prefix is cached), kv-cache decode, and a Triton kernel storing new K/V. flash_attn and triton are imported
when the backend is created, so this module imports anywhere."""
import torch

from nanoinfer.layers.attention.metadata import AttentionMetadata


class FlashAttentionBackend:
    """Takes the metadata as built: cu_seqlens_q/k, max_seqlen_q/k, block_tables and context_lens
    (flash-attn's cache_seqlens) are already in its format. A decode step reads only tensors that the
    CUDA-graph runner keeps at fixed addresses (block_tables, context_lens, slot_mapping)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanoinfer.kernels.triton_kvcache import store_kvcache
        self.dtype, self.device = dtype, device
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        self.store_kvcache = store_kvcache

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], this step's k, v [tokens, kv_heads, dim] (already stored) -> [tokens, heads*dim].
        With a window, a query at position p sees keys at p - window < position <= p (flash-attn: left window-1),
        or, in a non-causal pass, at p - window < position < p + window (window-1 on both sides).
        With soft_cap, scores are capped to soft_cap * tanh(score / soft_cap) (flash-attn: softcap, 0 for none).
        With alibi_slopes [heads] fp32, flash-attn adds -slope * |query position - key position| to each score, as the
        other backends do, positions aligned to the bottom right as above.
        flash-attn 2 has no attention sinks nor chunked local attention: select_backend never picks this backend for
        a model with either."""
        if sinks is not None:
            raise ValueError("the flash backend cannot run attention sinks (flash-attn 2 has none): use 'triton'")
        if chunk is not None:
            raise ValueError("the flash backend cannot run chunked local attention (flash-attn 2 has none): use "
                             "'triton'")
        window_size = (-1, -1) if window is None else (window - 1, 0 if meta.causal else window - 1)
        softcap = soft_cap or 0.0
        if meta.is_decode:
            # One query per sequence; causal is moot for a single query row.
            o = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                  block_table=meta.block_tables, softmax_scale=scale, causal=True,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
            return o.flatten(1)
        table = None
        if meta.has_cached_prefix:  # keys come from the cache: the prefix was computed in earlier steps
            k, v, table = k_cache, v_cache, meta.block_tables
        # causal=True aligns the mask to the bottom right: query j of a sequence with n new tokens and
        # context c sits at position c - n + j, as in the CPU backend.
        o = self.varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
                        causal=meta.causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        block_table=table)
        return o.flatten(1)
