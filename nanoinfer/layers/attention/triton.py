"""Paged attention in Triton, the CUDA default without flash-attn: varlen prefill over this step's K/V or the
paged cache, and split-KV decode that a CUDA graph can capture. Triton is imported when the backend is created,
so this module imports anywhere; on CPU tensors the kernels run only in Triton's interpreter (tests)."""
import torch

from nanoinfer.layers.attention.metadata import AttentionMetadata

# Decode programs wanted per SM: when (sequences x KV heads) is fewer than that, contexts are split into segments.
PROGRAMS_PER_SM = 4
# Without a GPU (Triton's interpreter, tests only): small, so that small batches split and the reduce runs too.
INTERPRETER_SPLIT_TARGET = 8


class TritonAttentionBackend:
    """Takes the metadata as built; a decode step reads only block_tables, context_lens and the partial buffers
    (allocated once), all at fixed addresses, and decides its grid from shapes alone: no host sync."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        from nanoinfer.kernels import triton_attention
        from nanoinfer.kernels.triton_kvcache import store_kvcache
        self.kernels, self.store_kvcache = triton_attention, store_kvcache
        self.split_target = (PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else INTERPRETER_SPLIT_TARGET)
        # By (heads, head_dim, programs per sequence).
        self.partials: dict[tuple[int, int, int], triton_attention.DecodePartials] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], this step's k, v [tokens, kv_heads, dim] (already stored) -> [tokens, heads * v
        dim]; without a cached prefix k, v may hold longer contexts, sequence i's from row cu_seqlens_k[i] (MLA's
        decompressed K/V). With a window, a query at position p sees keys at p - window < position <= p, or, in a
        non-causal pass, at p - window < position < p + window. With a chunk (causal only), it sees only the keys from
        p // chunk * chunk on (Llama 4's chunked local attention). With soft_cap, each scaled score s becomes soft_cap *
        tanh(s / soft_cap) before the mask. With sinks [heads], each head's sink logit joins the denominator of its
        softmax. With alibi_slopes [heads] fp32, each head adds -slope * |query position - key position| to its
        scores. A v narrower than k is read as its own (the latent cache's is K's prefix, MLA's decompressed one a
        tensor of its own)."""
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, meta, scale, window, soft_cap, sinks, alibi_slopes, chunk)
        if meta.has_cached_prefix:  # keys come from the cache: the prefix was computed in earlier steps
            k, v = k_cache, v_cache
        return self.kernels.prefill_attention(q, k, v, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                              meta.cu_seqlens_k, meta.max_seqlen_q, scale, meta.causal, window,
                                              soft_cap=soft_cap, sinks=sinks, alibi_slopes=alibi_slopes, chunk=chunk)

    def num_segments(self, num_seqs: int, programs_per_seq: int) -> int:
        """Segments per context: enough (sequence, KV head or tile of heads, segment) programs to fill the GPU. A
        function of the batch's shape only, so each captured graph has its own, fixed number."""
        programs = num_seqs * programs_per_seq
        if programs >= self.split_target:
            return 1
        return min(self.kernels.MAX_SEGMENTS, -(-self.split_target // programs))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None, soft_cap: float | None, sinks: torch.Tensor | None,
                alibi_slopes: torch.Tensor | None, chunk: int | None) -> torch.Tensor:
        num_seqs, num_heads, head_dim = *q.shape[:2], v_cache.shape[-1]
        programs = self.kernels.decode_programs(num_heads, k_cache.shape[2], head_dim, q.element_size())
        segments = self.num_segments(num_seqs, programs)
        partials = None
        if segments > 1:
            partials = self.partials.get((num_heads, head_dim, programs))
            if partials is None:
                # Splitting needs num_seqs * programs < target, so num_seqs * segments < target / programs + num_seqs
                # < 2 * target / programs: one allocation serves every batch, and graphs keep its address (for
                # DeepSeek-V3's 128 heads x 512 latents, 35 MB on an H100, not the 277 of 2 * target rows).
                partials = self.partials[num_heads, head_dim, programs] = self.kernels.DecodePartials.allocate(
                    -(-2 * self.split_target // programs), num_heads, head_dim, q.device)
        return self.kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window,
                                             segments, partials, soft_cap=soft_cap, sinks=sinks,
                                             alibi_slopes=alibi_slopes, chunk=chunk)
