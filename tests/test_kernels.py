"""The C kernels of the CPU path against PyTorch: paged decode attention (against the gather + SDPA path, on
random paged caches) and the fused small ops (against the op chains they replace)."""
import math
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels import cpu as cpu_kernels
from nanoinfer.kernels.cpu import available, paged_decode_attention
from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers import sampler
from nanoinfer.layers.attention.alibi import alibi_mask, bloom_alibi_slopes
from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.sampler import noise_keys


def decode_metadata(context_lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Decode step over sequences whose blocks are scattered at random through the cache, tables -1 padded."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context_lens]
    blocks = torch.randperm(num_blocks, generator=g)[:sum(per_seq)].tolist()
    width, tables = max(per_seq), []
    for n in per_seq:
        tables.append(blocks[:n] + [-1] * (width - n))
        blocks = blocks[n:]
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=torch.tensor(tables, dtype=torch.int32),
        context_lens=ctx, cu_seqlens_q=torch.arange(len(context_lens) + 1, dtype=torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=max(context_lens), block_size=block_size)


def random_case(heads: int, kv_heads: int, head_dim: int, block_size: int, context_lens: list[int]
                ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = decode_metadata(context_lens, block_size, num_blocks=sum(-(-n // block_size) for n in context_lens) + 5,
                           seed=heads + block_size)
    g = torch.Generator().manual_seed(0)
    num_blocks = meta.block_tables.max().item() + 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(context_lens), heads, head_dim, generator=g) * 2  # sharper softmax than N(0, 1)
    return meta, q, k_cache, v_cache


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_kernel_builds_where_a_compiler_exists():
    assert available()


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", [
    (16, 8, 64, 16, [1, 15, 16, 17, 250, 33]),   # block boundaries, a one-token context
    (4, 4, 32, 4, [7, 1, 64]),                   # MHA
    (12, 3, 40, 8, [9, 100]),                    # 4 query heads per KV head, head_dim not a power of two
    (6, 1, 128, 1, [5, 2, 31]),                  # block size 1, a single KV head
    (8, 2, 64, 16, [2000, 3]),                   # long context next to a short one
    (16, 8, 64, 16, [300]),                      # one sequence: work split across KV heads
    (10, 5, 16, 16, [40, 1, 17]),                # KV heads split unevenly across work items
    (3, 3, 72, 32, [1, 64, 65, 33]),             # odd head count, a vector and a scalar part per row
])
@pytest.mark.parametrize("window", [None, 1, 7, 40])  # sliding window: only the last `window` positions
def test_decode_kernel_matches_sdpa(heads, kv_heads, head_dim, block_size, context_lens, window):
    meta, q, k_cache, v_cache = random_case(heads, kv_heads, head_dim, block_size, context_lens)
    scale = head_dim ** -0.5
    kernel, torch_path = CPUAttentionBackend(torch.float32), CPUAttentionBackend(torch.float32)
    torch_path.decode_kernel = False
    for backend in (kernel, torch_path):
        backend.prepare(meta)
    unused = torch.empty(0)  # this step's k, v: only prefill reads them, decode reads the cache
    ours = kernel.forward(q, unused, unused, k_cache, v_cache, meta, scale, window)
    ref = torch_path.forward(q, unused, unused, k_cache, v_cache, meta, scale, window)
    assert ours.shape == ref.shape == (len(context_lens), heads * head_dim)
    err = (ours - ref).abs().max().item()
    assert err < 1e-5, f"max |kernel - SDPA| = {err:.2e}"
    if window is not None:  # the window really changed the result where the context is longer
        full = kernel.forward(q, unused, unused, k_cache, v_cache, meta, scale)
        longer = meta.context_lens > window
        assert torch.equal(longer, (full - ours).abs().amax(1) > 1e-3)


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("window", [1, 16, 17, 100])
def test_decode_kernel_sliding_window(window):
    """window > 0 attends to each sequence's last `window` tokens, as a sliding-window model's decode step does."""
    context_lens, block_size = [1, 16, 40, 130], 16
    meta, q, k_cache, v_cache = random_case(8, 2, 64, block_size, context_lens)
    scale = 64 ** -0.5
    ours = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window)
    for i, n in enumerate(context_lens):
        blocks = meta.block_tables[i, :-(-n // block_size)].long()
        k, v = (c[blocks].flatten(0, 1)[max(0, n - window):n].transpose(0, 1) for c in (k_cache, v_cache))
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1)
        err = (ours[i] - ref).abs().max().item()
        assert err < 1e-5, f"sequence {i} (context {n}, window {window}): max |kernel - SDPA| = {err:.2e}"


def reference_probs(scores: torch.Tensor, soft_cap: float | None, sinks: torch.Tensor | None,
                    visible: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax probabilities of float64 scores [heads, ..., keys]: capped to soft_cap * tanh(s / soft_cap), plus
    bias (ALiBi's), then masked (visible: True), and with each head's sink as one more logit whose column is dropped
    after the softmax (transformers' GPT-OSS)."""
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if bias is not None:
        scores = scores + bias
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1)
    sink_column = sinks.double().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_column], -1), -1)[..., :-1]


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, soft_cap: float | None, window: int | None, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """float64 decode, sequence by sequence, the scores as reference_probs takes them; with ALiBi, the key at t
    scores slope * (t - (n - 1)) more, the query at the context's last position n - 1; with a chunk, the keys from
    (n - 1) // chunk * chunk on alone."""
    outs = []
    for i, n in enumerate(meta.context_lens.tolist()):
        blocks = meta.block_tables[i, :-(-n // meta.block_size)].long()
        first = 0 if window is None else max(0, n - window)
        if chunk is not None:
            first = max(first, (n - 1) // chunk * chunk)
        k, v = (c[blocks].flatten(0, 1)[first:n].double() for c in (k_cache, v_cache))
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, torch.arange(first, n) - (n - 1))
        probs = reference_probs(torch.einsum("hd,lhd->hl", q[i].double(), k) * scale, soft_cap, sinks, bias=bias)
        outs.append(torch.einsum("hl,lhd->hd", probs, v).flatten())
    return torch.stack(outs)


def decode_against_float64(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           decode_kernel: bool, window: int | None, **option) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch backend's decode step of q over the caches as `meta` describes it, through the C kernel or the
    gather + SDPA path, with `option` (soft_cap, sinks, alibi_slopes or chunk), checked against decode_reference:
    (its output, the output without the option)."""
    scale = q.shape[-1] ** -0.5
    backend = CPUAttentionBackend(torch.float32)
    backend.decode_kernel = decode_kernel
    backend.prepare(meta)
    unused = torch.empty(0)  # this step's k, v: only prefill reads them, decode reads the cache
    ours = backend.forward(q, unused, unused, k_cache, v_cache, meta, scale, window, **option)
    ref = decode_reference(q, k_cache, v_cache, meta, scale, window=window, **{"soft_cap": None, **option})
    err = (ours.double() - ref).abs().max().item()
    assert err < 1e-5, f"max |ours - float64| = {err:.2e}"
    return ours, backend.forward(q, unused, unused, k_cache, v_cache, meta, scale, window)


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", [
    (16, 8, 64, 16, [1, 15, 16, 17, 250, 33]),
    (12, 3, 40, 8, [9, 100]),
    (6, 1, 128, 1, [5, 2, 31]),
])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
def test_decode_with_softcap_matches_float64(heads, kv_heads, head_dim, block_size, context_lens, window,
                                              decode_kernel):
    """Attention-logit softcapping (Gemma 2) in the C kernel and in the PyTorch path that SDPA leaves it to; a cap
    of 2 bends most scores here (their std is ~2), so a missing or misplaced tanh shows."""
    meta, q, k_cache, v_cache = random_case(heads, kv_heads, head_dim, block_size, context_lens)
    ours, uncapped = decode_against_float64(meta, q, k_cache, v_cache, decode_kernel, window, soft_cap=2.0)
    assert (uncapped - ours).abs().max().item() > 1e-2


SINKS = 3.0 * torch.randn(16, generator=torch.Generator().manual_seed(9))  # GPT-OSS's attention sinks, per head


def alibi_bias(slopes: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """float64 -slope_h * |distance| (key position - query position): slopes [heads], distance [...] -> [heads, ...]."""
    return slopes.double().view(-1, *[1] * distance.dim()) * -distance.double().abs()


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", [
    (16, 8, 64, 16, [1, 15, 16, 17, 250, 33]),
    (12, 3, 40, 8, [9, 100]),  # 4 query heads per KV head
    (6, 1, 128, 1, [5, 2, 31]),  # 6 heads: BLOOM's second series of slopes
    (10, 5, 16, 16, [40, 1, 17]),  # KV heads split unevenly across work items: each slice's own slopes
])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
def test_decode_with_alibi_matches_float64(heads, kv_heads, head_dim, block_size, context_lens, window,
                                           decode_kernel):
    """ALiBi (BLOOM's slopes) in the C kernel and in the PyTorch path's float mask: the query at position
    context - 1, each key t positions before it scoring slope * -t more."""
    meta, q, k_cache, v_cache = random_case(heads, kv_heads, head_dim, block_size, context_lens)
    ours, without = decode_against_float64(meta, q, k_cache, v_cache, decode_kernel, window,
                                           alibi_slopes=bloom_alibi_slopes(heads))
    assert (without - ours).abs().max().item() > 1e-2


def prefill_case(heads: int, kv_heads: int, head_dim: int, contexts: list[int], q_lens: list[int], seed: int
                 ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill step over random paged caches: sequence i computes its last q_lens[i] of contexts[i] tokens (the
    rest a cached prefix or earlier chunks), their K/V already stored: (metadata, q, this step's k, v, caches)."""
    block_size = 16
    meta = decode_metadata(contexts, block_size, sum(-(-n // block_size) for n in contexts) + 3, seed)
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(meta.block_tables.max().item() + 4, block_size, kv_heads, head_dim, generator=g)
                        for _ in range(2))
    slots = torch.cat([meta.block_tables[i, torch.arange(n - m, n) // block_size].long() * block_size
                       + torch.arange(n - m, n) % block_size for i, (n, m) in enumerate(zip(contexts, q_lens))])
    k, v = (c.flatten(0, 1)[slots] for c in (k_cache, v_cache))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = replace(meta, slot_mapping=slots, cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens), has_cached_prefix=True)
    return meta, 2 * torch.randn(sum(q_lens), heads, head_dim, generator=g), k, v, k_cache, v_cache


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("q_lens", [[9, 1, 30, 5], [3, 1, 8, 5]], ids=["sdpa", "rows-as-decodes"])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (5, 5)])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_with_alibi_over_a_cached_prefix_matches_float64(q_lens, heads, kv_heads, window):
    """ALiBi in a prefill step: a chunk after a cached prefix, a decode row, a chunk of 30 after 10 cached tokens,
    a whole fresh prompt; query j of n new tokens at context c sits at c - n + j. Steps of long chunks go through
    SDPA with ALiBi's float mask, steps of at most 8 tokens per sequence through the C kernel, a row at a time."""
    contexts = [40, 17, 40, 5]
    meta, q, k, v, k_cache, v_cache = prefill_case(heads, kv_heads, 32, contexts, q_lens, seed=heads)
    scale, slopes = 32 ** -0.5, bloom_alibi_slopes(heads)
    backend = CPUAttentionBackend(torch.float32)
    backend.prepare(meta)
    assert (backend_rows := meta.backend_state.row_context_lens is not None) == (max(q_lens) <= 8)
    ours = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window, alibi_slopes=slopes)
    ref = prefill_reference(q, k_cache, v_cache, meta, q_lens, scale, window, slopes=slopes)
    err = (ours.double() - ref).abs().max().item()
    assert err < 1e-5, f"max |ours - float64| = {err:.2e} ({'rows as decodes' if backend_rows else 'SDPA'})"


def prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      q_lens: list[int], scale: float, window: int | None, chunk: int | None = None,
                      slopes: torch.Tensor | None = None) -> torch.Tensor:
    """float64 causal attention of a prefill step over the paged caches: query j of sequence i's q_lens[i] new
    tokens sits at c - q_lens[i] + j (c its context) and sees the keys at positions up to its own p, with a window
    those above p - window, with a chunk those from p // chunk * chunk on; with ALiBi slopes, scores gain
    -slope * (p - key position)."""
    refs, start = [], 0
    for i, (n, m) in enumerate(zip(meta.context_lens.tolist(), q_lens)):
        blocks = meta.block_tables[i, :-(-n // meta.block_size)].long()
        keys, values = (c[blocks].flatten(0, 1)[:n].double().repeat_interleave(q.shape[1] // c.shape[2], 1)
                        for c in (k_cache, v_cache))
        q_pos, k_pos = torch.arange(n - m, n).unsqueeze(1), torch.arange(n)
        visible = (k_pos <= q_pos) & (k_pos > q_pos - (window or n))
        if chunk is not None:
            visible &= k_pos >= q_pos // chunk * chunk
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + m].double(), keys) * scale
        probs = reference_probs(scores, None, None, visible, None if slopes is None else
                                alibi_bias(slopes, k_pos - q_pos))
        refs.append(torch.einsum("hnl,lhd->nhd", probs, values).flatten(1))
        start += m
    return torch.cat(refs)


# (query heads, KV heads, head dim, KV block size, contexts): contexts ending just before, at and just after chunk
# boundaries (chunks of 12 and 16: inside 16-token blocks and at their edges), a one-token one, a long one.
CHUNK_DECODE_CASES = [(16, 8, 64, 16, [1, 11, 12, 13, 16, 17, 24, 25, 33, 250]),
                      (12, 3, 40, 8, [9, 23, 48, 49, 100]),  # 4 query heads per KV head
                      (6, 1, 128, 1, [5, 12, 13, 31])]  # block size 1, a single KV head


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", CHUNK_DECODE_CASES)
@pytest.mark.parametrize("chunk", [12, 16])
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
def test_decode_with_chunks_matches_float64(heads, kv_heads, head_dim, block_size, context_lens, chunk, window,
                                            decode_kernel):
    """Chunked local attention (Llama 4) in the C kernel and the PyTorch path: the query at position n - 1 sees the
    keys of its own chunk alone; with a window too, the later of the two starts (5: the window binds after a chunk's
    first 5 tokens; 20: the chunk always binds)."""
    meta, q, k_cache, v_cache = random_case(heads, kv_heads, head_dim, block_size, context_lens)
    ours, unchunked = decode_against_float64(meta, q, k_cache, v_cache, decode_kernel, window, chunk=chunk)
    # The chunk changed the output exactly where it starts later than the window (or the context).
    n = meta.context_lens
    binds = (n - 1) // chunk * chunk > (n - (window or n)).clamp_min(0)
    assert torch.equal(binds, (unchunked - ours).abs().amax(1) > 1e-3)


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("contexts, q_lens", [([40, 17, 40, 29], [9, 1, 30, 29]), ([40, 17, 40, 29], [3, 1, 8, 5]),
                                              ([5, 29, 40], [5, 29, 40])], ids=["sdpa", "rows-as-decodes", "fresh"])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (5, 5)])
@pytest.mark.parametrize("chunk", [12, 16])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_with_chunks_matches_float64(contexts, q_lens, heads, kv_heads, chunk, window):
    """Chunked local attention in a prefill step: chunks after a cached prefix crossing chunk boundaries (several:
    30 new tokens), a decode row, whole prompts; through SDPA a chunk's queries at a time, through the C kernel a
    row at a time (steps of at most 8 tokens per sequence), and without a cached prefix over this step's k, v."""
    meta, q, k, v, k_cache, v_cache = prefill_case(heads, kv_heads, 32, contexts, q_lens, seed=heads + chunk)
    meta = replace(meta, has_cached_prefix=contexts != q_lens)
    scale = 32 ** -0.5
    backend = CPUAttentionBackend(torch.float32)
    backend.prepare(meta)
    assert (meta.backend_state.row_context_lens is not None) == (max(q_lens) <= 8)
    ours = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window, chunk=chunk)
    err = (ours.double() - prefill_reference(q, k_cache, v_cache, meta, q_lens, scale, window, chunk)).abs().max()
    assert err.item() < 1e-5, f"max |ours - float64| = {err.item():.2e}"
    unchunked = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window)
    assert (unchunked - ours).abs().max().item() > 1e-2


@pytest.mark.parametrize("window", [None, 5])
def test_non_causal_prefill_with_alibi_matches_float64(window):
    """The non-causal pass (LLM.embed's) with ALiBi: every key (with a window, those within window - 1 positions on
    either side) scores -slope * |query position - key position|, a penalty for distance both ways, as flash-attn's
    alibi_slopes give it."""
    heads, kv_heads, dim, lens = 6, 2, 32, [1, 19, 12]
    g = torch.Generator().manual_seed(8)
    q, k, v = (2 * torch.randn(sum(lens), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=None, block_tables=torch.empty(3, 0, dtype=torch.int32),
                             context_lens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=max(lens), max_seqlen_k=max(lens), block_size=16, causal=False)
    slopes = bloom_alibi_slopes(heads)
    backend = CPUAttentionBackend(torch.float32)
    backend.prepare(meta)
    ours = backend.forward(q, k, v, torch.empty(0), torch.empty(0), meta, dim ** -0.5, window, alibi_slopes=slopes)
    refs = []
    for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
        ks, vs = (x.double().repeat_interleave(heads // kv_heads, 1) for x in (ks, vs))
        pos = torch.arange(len(qs))
        visible = None if window is None else (pos[None, :] - pos[:, None]).abs() < window
        scores = torch.einsum("nhd,lhd->hnl", qs.double(), ks) * dim ** -0.5
        probs = reference_probs(scores, None, None, visible, alibi_bias(slopes, pos[None, :] - pos[:, None]))
        refs.append(torch.einsum("hnl,lhd->nhd", probs, vs).flatten(1))
    err = (ours.double() - torch.cat(refs)).abs().max().item()
    assert err < 1e-5, f"max |ours - float64| = {err:.2e}"


@pytest.mark.skipif(not available(), reason="the C kernel did not build here")
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, context_lens", [
    (16, 8, 64, 16, [1, 15, 16, 17, 250, 33]),
    (8, 1, 64, 16, [300, 2]),  # GPT-OSS's 8 query heads per KV head
    (10, 5, 16, 16, [40, 1, 17]),  # KV heads split unevenly across work items: each slice's own sinks
])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "torch"])
def test_decode_with_sinks_matches_float64(heads, kv_heads, head_dim, block_size, context_lens, window,
                                           decode_kernel):
    """Attention sinks (GPT-OSS) in the C kernel and in the PyTorch path that SDPA leaves them to: each head's sink
    logit (std 3 against scores of std ~2 here) joins its softmax's denominator."""
    meta, q, k_cache, v_cache = random_case(heads, kv_heads, head_dim, block_size, context_lens)
    ours, without = decode_against_float64(meta, q, k_cache, v_cache, decode_kernel, window,
                                           sinks=SINKS[:heads].clone())
    assert (without - ours).abs().max().item() > 1e-2


@pytest.mark.parametrize("soft_cap, sinks, alibi", [(1.5, None, False), (None, SINKS[:6], False),
                                                    (1.5, SINKS[:6], False), (1.5, None, True)],
                         ids=["softcap", "sinks", "both", "softcap-alibi"])
@pytest.mark.parametrize("budget_rows", [None, 3], ids=["whole", "chunked"])
def test_explicit_prefill_attention_matches_float64(soft_cap, sinks, alibi, budget_rows, monkeypatch):
    """The explicit scores that stand in for SDPA in a softcapped prefill or one with sinks: GQA, a bottom-right
    causal mask with a window over a cached prefix (with ALiBi, a float mask per head, added after the cap); with a
    small score budget, computed 3 query rows at a time."""
    from nanoinfer.layers.attention import cpu as cpu_backend

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, n, keys, dim, scale = 6, 2, 10, 25, 32, 32 ** -0.5
    q = 2 * torch.randn(1, heads, n, dim, generator=g)
    k, v = torch.randn(2, 1, kv_heads, keys, dim, generator=g)
    q_pos, k_pos = torch.arange(keys - n, keys).unsqueeze(1), torch.arange(keys)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - 7)
    if budget_rows:
        monkeypatch.setattr(cpu_backend, "EXPLICIT_SCORE_BYTES", 4 * heads * keys * budget_rows)
    slopes, bias = bloom_alibi_slopes(heads), None
    if alibi:
        bias = alibi_bias(slopes, k_pos - q_pos)
        ours = cpu_backend.attention(q, k, v, alibi_mask(slopes, k_pos - q_pos, mask, q.dtype).unsqueeze(0), True,
                                     scale, soft_cap, sinks)
    else:
        ours = cpu_backend.attention(q, k, v, mask, True, scale, soft_cap, sinks)
    kr, vr = (x.double().repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    ref = reference_probs((q.double() @ kr.transpose(-1, -2) * scale)[0], soft_cap, sinks, mask, bias) @ vr[0]
    assert (ours[0].double() - ref).abs().max().item() < 1e-5
    plain = cpu_backend.attention(q, k, v, mask, True, scale, None)
    assert (plain - ours).abs().max().item() > 1e-2


def test_a_failing_build_falls_back_to_pytorch(monkeypatch, tmp_path):
    from nanoinfer.kernels import cpu

    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    cpu._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="falls back to PyTorch"):
            assert not cpu.available()
        assert not CPUAttentionBackend(torch.float32).decode_kernel
    finally:
        cpu._library.cache_clear()


needs_kernels = pytest.mark.skipif(not available(), reason="the C kernels did not build here")


def strided(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as a view whose token rows are `pad` floats wider apart, like a fused projection's slices."""
    wide = torch.randn(x.shape[0], x[0].numel() + pad)
    wide[:, :x[0].numel()] = x.flatten(1)
    return wide[:, :x[0].numel()].view(x.shape)


@needs_kernels
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 24), (1, 1, 1)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(shape, with_residual):
    g = torch.Generator().manual_seed(len(shape))
    x, weight = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    residual = torch.randn(shape, generator=g) if with_residual else None
    ref_in = x + residual if with_residual else x
    ref = weight * (ref_in * torch.rsqrt(ref_in.pow(2).mean(-1, keepdim=True) + 1e-6))
    ours = cpu_kernels.rms_norm(strided(x), weight, 1e-6, strided(residual) if with_residual else None)
    if with_residual:
        ours, new_residual = ours
        assert torch.equal(new_residual, ref_in)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("heads, dim, half", [(4, 64, 32), (3, 10, 5), (2, 16, 4)])  # last: partial rotary
@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_kernel(heads, dim, half, with_norm):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(6, heads, dim, generator=g)
    weight = torch.randn(dim, generator=g)
    angles = torch.outer(torch.arange(50, dtype=torch.float32), torch.rand(half, generator=g))
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 49, 3, 3, 17, 1])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) if with_norm else x
    x1, x2, rest = normed[..., :half], normed[..., half:2 * half], normed[..., 2 * half:]
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), -1)
    norm_args = (weight, 1e-5) if with_norm else ()
    ours = cpu_kernels.rotary_neox(strided(x), positions, cos, sin, *norm_args)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_silu_and_mul_kernel():
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(4, 100, generator=g) * 4, torch.tensor([[0.0, -0.0, 90.0, -90.0] * 25])])
    x = torch.cat([gate, torch.randn(5, 100, generator=g)], -1)
    ref = F.silu(x[:, :100]) * x[:, 100:]
    torch.testing.assert_close(cpu_kernels.silu_and_mul(x), ref, rtol=1e-6, atol=1e-7)


@needs_kernels
def test_store_kvcache_kernel():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(6, 4, 3, 8, generator=g), torch.randn(6, 4, 3, 8, generator=g)
    k, v = torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 8, generator=g)
    slots = torch.tensor([7, 0, 23, -1, 12])  # -1: skipped
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref_k.view(-1, 3, 8)[slots[keep]] = k[keep]
    ref_v.view(-1, 3, 8)[slots[keep]] = v[keep]
    cpu_kernels.store_kvcache(strided(k), strided(v), k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@needs_kernels
def test_argmax_kernel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, :] = 0.0
    x[3, 999] = float("inf")
    x[4, 500] = float("nan")  # NaN counts as the largest, as in torch
    x[5, 0] = 7.0
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    assert cpu_kernels.argmax(x).tolist()[:5] == [x[0].argmax().item(), 10, 0, 999, 500]


# The sampler's noise and exponential race (layers/sampler.py) against its torch ops.

def noise_test_keys() -> torch.Tensor:
    """Rows keyed like the sampler's, plus (0, 0xD629356C), whose hash at token 0 is 0xFFFFFFFF: the largest u,
    1 - 2^-24 (from 24 bits it rounded to 1, and E to -0.0)."""
    seeded = torch.from_numpy(noise_keys(np.array([0, 5, 2**64 - 1, 12345], dtype=np.uint64),
                                         np.array([0, 9, 3, 2**40], dtype=np.uint64)))
    return torch.cat([seeded, torch.tensor([[0, 0xD629356C]])])


def float64_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log u of the torch path's integer hash, in float64 and rounded once: what the C kernel must give."""
    x = sampler._mix32(sampler._mix32(torch.arange(vocab) ^ keys[:, :1]) ^ keys[:, 1:])
    u = ((x >> 9).float() + 0.5) * 2.0 ** -23
    return u.double().log().neg().float()


def torch_path(monkeypatch) -> None:
    """Make the C kernels unavailable, as on a machine without a compiler."""
    monkeypatch.setattr(cpu_kernels, "_library", lambda: None)


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 7, 31, 32003])
def test_exponential_noise_kernel(vocab, monkeypatch):
    keys = noise_test_keys()
    strided_keys = torch.cat([keys, keys], 1)[:, :2]  # rows 4 int64 apart
    ours = sampler.exponential_noise(strided_keys, vocab)
    # Bit for bit the correctly rounded -log u of the same hashes; the smallest E is -log(1 - 2^-24), not 0.
    assert torch.equal(ours.view(torch.int32), float64_noise(keys, vocab).view(torch.int32))
    assert ours.min() == ours[-1, 0] == torch.tensor(-math.log1p(-2.0 ** -24), dtype=torch.float32)
    torch_path(monkeypatch)
    ulps = (ours.view(torch.int32) - sampler.exponential_noise(keys, vocab).view(torch.int32)).abs()
    assert int(ulps.max()) <= 1, "torch's fp32 log is within 1 ulp of the correctly rounded value"


def race_case(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [rows, vocab] and their keys: a softmax row, a tie (equal p and E, far apart), a near-tie the later
    token wins, all zeros (every p / E ties at 0), two NaNs behind a large p, and p = 0 only where E is smallest."""
    g = torch.Generator().manual_seed(vocab)
    keys = torch.cat([noise_test_keys()[:1], torch.tensor([[0, 0]] * 4 + [[0, 0xD629356C]])])
    probs = torch.zeros(6, vocab)
    probs[0] = torch.softmax(torch.randn(vocab, generator=g) * 3, -1)
    probs[5] = 1.0 / vocab
    probs[5, 0] = 0.0
    if vocab >= 38717:  # tokens 169 and 38716 hash to the same top 24 bits under key (0, 0): the same E
        assert sampler.exponential_noise(keys[1:2], vocab)[0, [169, 38716]].unique().numel() == 1
        probs[1, [169, 38716]] = 0.5
        probs[2, [169, 38716]] = torch.tensor([0.5, 0.5000001])
        probs[4, [30000, 35000]] = float("nan")
        probs[4, 7] = 1.0
    return probs, keys


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 7, 31, 1025, 40003])
def test_exponential_race_kernel(vocab, monkeypatch):
    probs, keys = race_case(vocab)
    ours = cpu_kernels.exponential_race(strided(probs), keys)
    # The argmax of the same fp32 quotients, torch's rules (first of equals, the first NaN above all).
    assert torch.equal(ours, (probs / sampler.exponential_noise(keys, vocab)).argmax(-1))
    if vocab == 40003:
        assert ours[1:].tolist() == [169, 38716, 0, 30000, ours[5].item()] and ours[5] != 0
    torch_path(monkeypatch)
    assert torch.equal(ours, sampler.exponential_race(probs.clone(), keys))


@needs_kernels
def test_sampler_noise_runs_in_c_where_the_kernels_are_built_and_in_torch_elsewhere(monkeypatch):
    probs, keys = race_case(100)
    with monkeypatch.context() as m:
        m.setattr(sampler, "_mix32", lambda x: pytest.fail("torch ops used although the C kernels are built"))
        noise, tokens = sampler.exponential_noise(keys, 100), sampler.exponential_race(probs.clone(), keys)
    torch_path(monkeypatch)
    for name in ("exponential_noise", "exponential_race"):
        monkeypatch.setattr(cpu_kernels, name, lambda *a: pytest.fail("C kernel called without the kernels"))
    assert torch.equal(sampler.exponential_race(probs.clone(), keys), tokens)
    assert torch.allclose(sampler.exponential_noise(keys, 100), noise, rtol=2e-7, atol=0)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_filtered_token_is_never_drawn_where_its_hash_is_all_ones(kernels, monkeypatch):
    """Token 0 is outside the top 10, and its hash under this key is 0xFFFFFFFF: its E must stay > 0, or p / E = 0 / 0
    is NaN, and NaN wins the argmax."""
    if not kernels:
        torch_path(monkeypatch)
    logits = torch.zeros(1, 1000)
    logits[0, 0] = -50.0
    m = sampler.SamplingMetadata(temperatures=torch.tensor([1.0]), top_k=torch.tensor([10]), top_p=None,
                                 all_greedy=False, all_random=True, noise_keys=noise_test_keys()[-1:])
    assert sampler.Sampler()(logits, m).token_ids.item() != 0
