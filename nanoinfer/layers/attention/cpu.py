"""Paged attention in PyTorch, for the CPU (and the fallback on CUDA without flash-attn). Decode: a C kernel
reading K/V in place on CPU fp32 (else one batched SDPA over gathered blocks). Prefill: one SDPA per sequence, or,
for steps of a few tokens per sequence (speculative verification), every query row through the decode kernel.
SDPA cannot soft-cap scores nor add attention sinks: such layers compute the scores explicitly instead. ALiBi's
biases go into SDPA as a float mask (alibi.py)."""
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cpu import paged_decode_attention, store_kvcache, use_cpu_kernels
from nanoinfer.layers.attention.alibi import alibi_mask
from nanoinfer.layers.attention.metadata import AttentionMetadata

# Decode without the kernel gathers each sequence's K/V, padded to the longest context: for a whole batch that is
# GiBs (batch 256 x context 4k x 8 KV heads x 128 x bf16 = 2 GiB for K alone), which the KV cache, sized from what
# gpu_memory_utilization leaves after a prefill warm-up, does not leave room for. Sequences go through in groups
# whose gathered K and V stay under this many bytes together.
DECODE_GATHER_BYTES = 256 << 20
# Softcapped scores, or scores with sinks, are materialized (SDPA can do neither): a long prompt's are computed this
# many bytes of fp32 scores at a time, query rows by query rows.
EXPLICIT_SCORE_BYTES = 256 << 20
# A step whose sequences each compute at most this many tokens (a speculative verification: the last token and its
# drafts; a small chunk) runs each query row as a decode query over its own prefix, all rows in one C kernel call,
# in place of one SDPA (and one K/V gather) per sequence and layer.
KERNEL_MAX_QUERY_ROWS = 8


@dataclass
class CPUState:
    # Prefill: each sequence's rows of q, its context length and its first row of k/v (without a cached prefix).
    spans: list[tuple[int, int, int, int]]
    # Decode without the kernel: blocks to gather (padding -> block 0) and which gathered keys are real.
    block_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_seqs, 1, 1, num_key_slots] bool
    # Short query runs through the decode kernel: each query row's block table and context (its position + 1).
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float, soft_cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [batch, heads, n, dim], k, v [batch, kv_heads, keys, dim] -> [batch, heads, n, dim]; mask (True: visible)
    broadcasts to [batch, 1, n, keys], or None for all keys (causal: the square causal mask); or a float mask added to
    the scaled scores, [batch, heads or 1, n, keys] (ALiBi's, -inf where not visible)."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal, scale=scale,
                                              enable_gqa=True)
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return explicit_attention(q, k, v, mask, scale, soft_cap, sinks)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """attention() over materialized scores, in the order of transformers' eager attention, softmax in fp32: with
    soft_cap, each scaled score s capped to soft_cap * tanh(s / soft_cap) before the mask (Gemma 2); with sinks
    [heads], each head's sink logit joins its softmax as one more column, dropped after it (GPT-OSS). Each KV head
    serves its group of query heads as a broadcast dim: no repeated K/V. A float mask is added after the cap."""
    b, heads, n, dim = q.shape
    rows = max(1, EXPLICIT_SCORE_BYTES // (4 * b * heads * k.shape[2]))
    if n > rows:  # chunks of query rows, each with its rows of the mask
        mask = None if mask is None else mask.expand(*mask.shape[:-2], n, mask.shape[-1])
        return torch.cat([explicit_attention(q[:, :, i:i + rows], k, v, None if mask is None else
                                             mask[..., i:i + rows, :], scale, soft_cap, sinks)
                          for i in range(0, n, rows)], 2)
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, heads // kv_heads, n, dim)
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None and mask.dim() == 4:  # [batch, heads or 1, n, keys] -> [batch, KV heads or 1, group or 1, ...]
        mask = mask.unflatten(1, (kv_heads if mask.shape[1] == heads else 1, -1))
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, -1, dtype=torch.float32)
    else:
        # fp32 sinks (HY-V4's, DeepSeek-V4's: kept so by transformers) join 16-bit scores unrounded: cat promotes.
        sink_column = sinks.view(1, kv_heads, -1, 1, 1).expand(b, -1, -1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], -1), -1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v.unsqueeze(2)).view(b, heads, n, v.shape[-1])


class CPUAttentionBackend:
    def __init__(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> None:
        # Gathered K/V land in buffers reused by every layer and step: a fresh tensor of this size is
        # a fresh mmap, and its page faults cost several times the copy itself.
        self._buffers: dict[str, torch.Tensor] = {}
        # The kernel reads K/V in place: no gather, no padding, each block read once for all heads.
        self.decode_kernel = (device.type == "cpu" and dtype == torch.float32
                              and cpu_kernels.available())

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.is_decode:
            if not self.decode_kernel:
                num_blocks = -(-meta.max_seqlen_k // meta.block_size)
                slots = torch.arange(num_blocks * meta.block_size, device=meta.context_lens.device)
                meta.backend_state = CPUState(
                    [], meta.block_tables[:, :num_blocks].clamp_min(0).flatten(),
                    (slots < meta.context_lens.unsqueeze(1)).view(meta.num_seqs, 1, 1, -1))
            return
        # Only over a cached prefix: a step of fresh prompts may be the warm-up that runs before the cache exists.
        if (self.decode_kernel and meta.causal and meta.has_cached_prefix and meta.slot_mapping is not None
                and meta.max_seqlen_q <= KERNEL_MAX_QUERY_ROWS):
            meta.backend_state = _query_rows_as_decodes(meta)
            return
        host = meta.on_host  # read where the host wrote them: no sync with the device
        cu, ctx, cu_k = host.cu_seqlens_q.tolist(), host.context_lens.tolist(), host.cu_seqlens_k.tolist()
        meta.backend_state = CPUState([(cu[i], cu[i + 1], ctx[i], cu_k[i]) for i in range(meta.num_seqs)])

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """v None: k alone (a cache whose values are its keys' prefix)."""
        if use_cpu_kernels(k):
            return store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        if v is not None:
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """q [tokens, heads, dim] and this step's k, v [tokens, kv_heads, dim], already stored in the cache
        -> [tokens, heads * v dim]; without a cached prefix k, v may hold longer contexts, sequence i's from row
        cu_seqlens_k[i] (MLA's decompressed K/V, never stored). With a window, a query at position p sees keys at
        p - window < position <= p, or, in a non-causal pass, at p - window < position < p + window. With a chunk
        (causal only), it sees only keys from p // chunk * chunk on, its own chunk's. With soft_cap,
        each scaled score s becomes soft_cap * tanh(s / soft_cap) before the mask. With sinks [heads], each head's
        sink logit joins the denominator of its softmax. With alibi_slopes [heads] fp32, each head adds -slope *
        |query position - key position| to its scores. A V cache narrower than the K cache is K's prefix (a view of
        it: Attention's value_prefix_dim)."""
        state: CPUState = meta.backend_state
        if state is not None and state.row_context_lens is not None:
            return _kernel_decode(q, k_cache, v_cache, state.row_block_tables, state.row_context_lens, scale, window,
                                  soft_cap, sinks, alibi_slopes, chunk)
        if not meta.is_decode:
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale, window, soft_cap, sinks, alibi_slopes, chunk)
        if self.decode_kernel:
            return _kernel_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window, soft_cap,
                                  sinks, alibi_slopes, chunk)
        b, slots = meta.num_seqs, state.mask.shape[-1]
        mask = state.mask
        slot = torch.arange(slots, device=mask.device)
        if window is not None:
            mask = mask & (slot >= (meta.context_lens - window).view(-1, 1, 1, 1))
        if chunk is not None:  # the query sits at context - 1 (>= 0: padding rows see no key anyway)
            mask = mask & (slot >= ((meta.context_lens - 1).clamp_min(0) // chunk * chunk).view(-1, 1, 1, 1))
        if alibi_slopes is not None:  # the query sits at context - 1
            mask = alibi_mask(alibi_slopes, (slot - (meta.context_lens.view(-1, 1) - 1)).unsqueeze(1), mask[:, 0],
                              q.dtype)
        blocks = state.block_index.view(b, -1)
        rows = max(1, DECODE_GATHER_BYTES // (2 * slots * k_cache[0, 0].nbytes))
        outs = []
        for i in range(0, b, rows):
            n = min(rows, b - i)
            k = self._gather("k", k_cache, blocks[i:i + n].flatten()).view(n, slots, *k_cache.shape[2:])
            v = self._gather("v", v_cache, blocks[i:i + n].flatten()).view(n, slots, *v_cache.shape[2:])
            outs.append(attention(q[i:i + n].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[i:i + n], True,
                                  scale, soft_cap, sinks))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).flatten(1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                 soft_cap: float | None, sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                 chunk: int | None) -> torch.Tensor:
        # This step's v may be None where every sequence attends over the cache alone.
        out = q.new_empty(q.shape[0], q.shape[1] * (v_cache if v is None else v).shape[-1])
        for i, (start, end, ctx, k_start) in _split_at_chunks(meta.backend_state.spans, chunk):
            n = end - start
            # Query j sits at position ctx - n + j; the earliest key any of them sees is first (a non-causal pass
            # has no cached prefix: ctx == n, first 0). With chunks, all of them sit in one chunk.
            first = 0 if window is None else max(0, ctx - n - window + 1)
            if chunk is not None:
                first = max(first, (ctx - n) // chunk * chunk)
            if not meta.has_cached_prefix:  # k, v hold every context (MLA's decompressed ones may exceed the step's)
                ks, vs = k[k_start + first:k_start + ctx], v[k_start + first:k_start + ctx]
            elif first >= ctx - n:  # every key seen is this step's: its rows from the first query's on
                ks, vs = k[start + first - (ctx - n):end], v[start + first - (ctx - n):end]
            else:
                blocks = meta.block_tables[i, first // meta.block_size:-(-ctx // meta.block_size)]
                skip = first % meta.block_size
                ks = self._gather("k", k_cache, blocks).flatten(0, 1)[skip:skip + ctx - first]
                vs = (ks[..., :v_cache.shape[-1]] if v_cache.shape[-1] < k_cache.shape[-1]  # V is K's prefix
                      else self._gather("v", v_cache, blocks).flatten(0, 1)[skip:skip + ctx - first])
            mask = None
            # Without a mask, SDPA's causal mask is square: right where the keys are exactly the queries' positions.
            if ctx - first != n or (window is not None and window < n) or alibi_slopes is not None:
                q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                k_pos = torch.arange(first, ctx, device=q.device)
                mask = _visible(q_pos, k_pos, meta.causal, window)
                if alibi_slopes is not None:
                    mask = alibi_mask(alibi_slopes, k_pos - q_pos, mask, q.dtype).unsqueeze(0)
            # 4-D inputs: with 3-D ones SDPA skips its fused CPU kernel for the slow math path.
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[start:end], ks, vs))
            o = attention(qs, ks, vs, mask, meta.causal, scale, soft_cap, sinks)
            out[start:end] = o[0].transpose(0, 1).flatten(1)
        return out

    def _gather(self, name: str, cache: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
        shape = (block_index.numel(), *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            buf = self._buffers[name] = cache.new_empty(numel)
        return torch.index_select(cache, 0, block_index, out=buf[:numel].view(shape))


def _split_at_chunks(spans: list[tuple[int, int, int, int]], chunk: int | None
                     ) -> Iterator[tuple[int, tuple[int, int, int, int]]]:
    """(sequence, span) for each span (start row, end row, context, first k row) cut where its queries cross into a
    new chunk: each piece's queries see the keys of one chunk alone, so they attend as a span of their own whose
    context ends at its last query (+ 1)."""
    for i, (start, end, ctx, k_start) in enumerate(spans):
        if chunk is None:
            yield i, (start, end, ctx, k_start)
            continue
        first_pos = ctx - (end - start)  # the position of row `start`
        while start < end:
            piece_end = min(end, start + chunk - first_pos % chunk)
            yield i, (start, piece_end, first_pos + piece_end - start, k_start)
            first_pos, start = first_pos + piece_end - start, piece_end


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor | None:
    """Which keys each query sees (q_pos [n, 1], k_pos [keys]): causally those up to its own position, else all of
    them; with a window only the last `window` of those (non-causal: within window - 1 on either side). None: all."""
    if causal:
        visible = k_pos <= q_pos
    elif window is not None:
        visible = k_pos < q_pos + window
    else:
        return None
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def _kernel_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, window: int | None, soft_cap: float | None,
                   sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None = None, chunk: int | None = None
                   ) -> torch.Tensor:
    """The C decode kernel -> [seqs, heads * v dim]. With V as K's prefix, the kernel (whose V rows are laid out
    as K's) reads the whole K rows as values and each head's output keeps the prefix: the rest (MLA's rope part,
    64 of 576 for DeepSeek-V3) is ~10% more accumulation for no new kernel."""
    if v_cache.shape[-1] == k_cache.shape[-1]:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, soft_cap,
                                      sinks, alibi_slopes, chunk).flatten(1)
    out = paged_decode_attention(q, k_cache, k_cache, block_tables, context_lens, scale, window, soft_cap, sinks,
                                 alibi_slopes, chunk)
    return out[..., :v_cache.shape[-1]].flatten(1)


def _query_rows_as_decodes(meta: AttentionMetadata) -> CPUState:
    """Row r of sequence i sits at position context_lens[i] - cu_seqlens_q[i + 1] + r: causally it attends to the
    cached keys up to there (this step's K/V are stored before attention), as a decode query with that context."""
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long())
    lens = meta.context_lens.long()[seq] - meta.cu_seqlens_q[1:].long()[seq] + torch.arange(len(seq)) + 1
    return CPUState([], row_block_tables=meta.block_tables[seq], row_context_lens=lens.int())
