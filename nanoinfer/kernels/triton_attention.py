"""Triton kernels for paged attention (CUDA; importing this module needs triton): one attention kernel for varlen
prefill (over this step's K/V or the paged cache), mixed batches and split-KV decode, and the reduce kernel that
merges a split decode's segments.

Every program handles one KV head and all the query heads of its group (GQA): its tile rows are (query token,
head in group) pairs, so each K/V tile is loaded once per group. K/V tiles are gathered key by key through the
block table, so any KV block size works. Softmax runs online in fp32, in base 2 with the scale folded in. Scores
may be soft-capped (Gemma 2): cap * tanh(score / cap), in natural units, before the mask. Values may be a prefix of
the keys (DeepSeek's latent cache): q and k are then wider than v, their extra dims read by the scores alone, and
the one KV head's many query heads are split over programs. A head's sink logit (GPT-OSS) is a key of value 0 that
every query sees: the online softmax starts from it. ALiBi (BLOOM, MPT) adds -slope * |query position - key position|
to each head's scores, after the cap. Chunked local attention (Llama 4) limits a causal query at position p to the keys
from p // chunk * chunk on: its own chunk's."""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # inside kernels
MAX_SEGMENTS = 16  # split-KV segments per sequence at most (the reduce kernel's tile)


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `tile`; sequence s owns the tiles from cu_seqlens_q[s] // BLOCK_Q + s on
    (at least as many as it needs), so the grid is sized from shapes alone, without a host sync."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh in fp32 to within 2 ulp from tl.exp alone (triton.language has no tanh, and libdevice's does not run in
    the interpreter): Cephes' tanhf, an odd polynomial below 0.625, where 1 - e^-2|x| would lose the leading bits,
    else (1 - e) / (1 + e) with e = e^-2|x|."""
    z = tl.abs(x)
    z2 = z * z
    p = (((-5.70498872745e-3 * z2 + 2.06390887954e-2) * z2 - 5.37397155531e-2) * z2 + 1.33314422036e-1) * z2
    e = tl.exp(-2.0 * z)
    t = tl.where(z < 0.625, (p - 3.33332819422e-1) * z2 * z + z, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


# num_seqs: a loop bound in _find_seq, must stay a tensor, even when 1. stride_bt: the step's block-table width, and
# num_segments, a decode batch's (1, 16 or between as the batch shrinks), which Triton would otherwise specialize (1,
# a multiple of 16, neither), compiling new variants while requests are served.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_segments"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, block_tables_ptr,
                      context_lens_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, qk_scale, cap_scale, window, chunk,
                      num_seqs,
                      num_heads, num_segments, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_bt, sinks_ptr, alibi_ptr,
                      GROUP: tl.constexpr, KV_SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      TAIL_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
                      DECODE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_CHUNK: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                      ALIBI: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (query tiles, KV heads x KV_SPLIT, segments). A tile: BLOCK_Q tokens of one sequence x GROUP query heads
    of one KV head, the whole group or, split over KV_SPLIT programs, a part of it (a group larger than the tile's
    rows: MLA's, or wide heads'); in a decode step, sequence i's single token. A segment: one of num_segments
    equal slices (whole BLOCK_N tiles) of the keys the tile sees; split, its max, sum and unnormalized output go to
    the partial buffers for the reduce kernel, else the output itself. Scores are q.k * qk_scale in base 2; with
    SOFTCAP, qk_scale is scale / cap and the score tanh(q.k * qk_scale) * cap_scale, cap_scale = cap * log2(e).
    HEAD_DIM is the values' (and the output's) width; q and k rows hold TAIL_DIM more, which only the scores read
    (MLA: the rope part after the latent, which is also the value). With HAS_SINKS, segment 0 starts its softmax
    from the head's sink (max = sink, sum = 1), so that split or not, the sink joins the denominator once. With ALIBI,
    each row's score of the key at position t gains its head's -slope * |its position - t|, in base 2. With HAS_CHUNK
    (causal), a row at position p sees no key before p // chunk * chunk, and the tile's keys start at its first
    row's chunk."""
    tile = tl.program_id(0)
    program = tl.program_id(1)
    kv_head = program // KV_SPLIT
    segment = tl.program_id(2)
    if DECODE:  # one token per sequence: tile i is sequence i
        seq = tile
        q_start = tile
        q_len = 1
        first_q = 0
    else:
        seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        first_q = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q
        if first_q >= q_len:  # a spare tile of this sequence
            return
    ctx = tl.load(context_lens_ptr + seq)  # 0 on a row padding a CUDA graph's batch: no key is read

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_idx = first_q + offs_m // GROUP
    head = program * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # Triton's interpreter computes bf16 wrong (triton-lang/triton#11584): there, tiles go fp32
        q = q.to(tl.float32)
    if TAIL_DIM > 0:
        offs_t = HEAD_DIM + tl.arange(0, BLOCK_T)
        t_ok = offs_t < HEAD_DIM + TAIL_DIM
        q_tail = tl.load(q_ptr + (token * stride_qt + head * stride_qh)[:, None] + offs_t[None, :],
                         mask=row_ok[:, None] & t_ok[None, :], other=0.0).to(q.dtype)
    # Bottom-right alignment: query j of a sequence with q_len new tokens and context ctx sits at ctx - q_len + j.
    q_pos = ctx - q_len + q_idx

    lo = 0
    hi = ctx
    end_q = ctx - q_len + tl.minimum(first_q + BLOCK_Q, q_len)  # one past the tile's last query position
    if CAUSAL:
        hi = end_q
    elif HAS_WINDOW:  # both sides: up to window - 1 keys past the last query
        hi = tl.minimum(end_q - 1 + window, ctx)
    if HAS_WINDOW:
        lo = tl.maximum(ctx - q_len + first_q - window + 1, 0)
    if HAS_CHUNK:  # a CUDA graph's padding row sits at -1: the max keeps lo >= 0 whichever way // rounds
        lo = tl.maximum(lo, (ctx - q_len + first_q) // chunk * chunk)
    # Segments of whole tiles, sized from this context: one CUDA graph serves every context length.
    seg_len = tl.cdiv(tl.cdiv(hi - lo, num_segments), BLOCK_N) * BLOCK_N
    lo = lo + segment * seg_len
    hi = tl.minimum(lo + seg_len, hi)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    row_base = tl.load(cu_seqlens_k_ptr + seq)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok & (segment == 0), other=float("-inf")).to(tl.float32) * _LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    if ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + offs_n
        key_ok = key_pos < hi
        if PAGED:  # cache slots through the block table, key by key: any KV block size
            block = tl.load(table + key_pos // KV_BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            rows = block * KV_BLOCK_SIZE + key_pos % KV_BLOCK_SIZE
        else:  # this step's k/v: the sequence's rows from cu_seqlens_k
            rows = (row_base + key_pos).to(tl.int64)
        k = tl.load(k_ptr + kv_head * stride_kh + (rows * stride_kt)[None, :] + offs_d[:, None],
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION)
        if TAIL_DIM > 0:
            k_tail = tl.load(k_ptr + kv_head * stride_kh + (rows * stride_kt)[None, :] + offs_t[:, None],
                             mask=t_ok[:, None] & key_ok[None, :], other=0.0).to(q.dtype)
            s = tl.dot(q_tail, k_tail, s, input_precision=PRECISION)
        s = s * qk_scale
        if SOFTCAP:
            s = _tanh(s) * cap_scale
        if ALIBI:
            s -= slope[:, None] * tl.abs(key_pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = key_ok[None, :]
        if CAUSAL:
            visible &= key_pos[None, :] <= q_pos[:, None]
        elif HAS_WINDOW:
            visible &= key_pos[None, :] < q_pos[:, None] + window
        if HAS_WINDOW:
            visible &= key_pos[None, :] > q_pos[:, None] - window
        if HAS_CHUNK:
            visible &= key_pos[None, :] >= (q_pos // chunk * chunk)[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf: subtract 0 instead, so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + kv_head * stride_vh + (rows * stride_vt)[:, None] + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (token * num_segments + segment) * num_heads + head
        tl.store(part_acc_ptr + (part * HEAD_DIM)[:, None] + offs_d[None, :], acc, mask=mask)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no visible key (context 0): 0
        tl.store(out_ptr + ((token * num_heads + head) * HEAD_DIM)[:, None] + offs_d[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_segments"])  # as _attention_kernel's
def _reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_segments, num_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (query tokens, query heads): merges the segments' partial softmax results into the output."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_segments
    d_ok = offs_d < HEAD_DIM
    part = (token * num_segments + offs_s) * num_heads + head
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    m_all = tl.max(m, 0)
    # Empty segments hold max -inf: weight 0. All empty (context 0): the output is 0.
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(tl.load(part_sum_ptr + part, mask=s_ok, other=0.0) * w, 0)
    acc = tl.load(part_acc_ptr + (part * HEAD_DIM)[:, None] + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (token * num_heads + head) * HEAD_DIM + offs_d, out, mask=d_ok)


@dataclass
class DecodePartials:
    """Per (query token, segment, head) partial results of a split decode; allocated once, at a fixed address."""
    acc: torch.Tensor  # [capacity, heads, head_dim] fp32: unnormalized outputs
    max: torch.Tensor  # [capacity, heads] fp32: running max (log2 domain)
    sum: torch.Tensor  # [capacity, heads] fp32: running sum of exp2

    @classmethod
    def allocate(cls, capacity: int, num_heads: int, head_dim: int, device: torch.device) -> "DecodePartials":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(capacity, num_heads, head_dim, **f32), torch.empty(capacity, num_heads, **f32),
                   torch.empty(capacity, num_heads, **f32))


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every tile side >= 16


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tile rows: (query token, head in group) pairs
    block_n: int  # keys per K/V tile
    num_warps: int
    num_stages: int


# From this value width on (MLA's latent: 512, its keys 576; Gemma 4's full layers: 512), tiles are wide_config's:
# their rows take part of a large group of query heads (heads_per_program), not always a whole one.
WIDE_BLOCK_D = 512


def wide_config(itemsize: int, prefill: bool) -> TileConfig:
    """Tiles of MLA's 512-wide values and 576-wide keys, as compiled for sm_90 (Triton 3.7.1): in 16 bits, decode
    16 rows (one token's 16 heads) x 32 keys in 4 warps (87 KB of shared memory), prefill 32 rows in 8 warps
    (106 KB), neither spilling (64 keys, or 32 rows in 4 warps, do). fp32 16 x 16 in 4 warps (142 KB): tf32x3
    spills there, as on every fp32 tile (exact, not fast). Plain heads of 257 to 512 (no key tail) take the same
    tiles, with less shared memory (83 and 100 KB) and, in 16 bits, no spills either."""
    if itemsize == 4:
        return TileConfig(16, 16, 4, 2)
    return TileConfig(32, 32, 8, 2) if prefill else TileConfig(16, 32, 4, 2)


# fp32 tiles wider than 128 (head_dim 129 to 256) take 256 KB of shared memory at 64 rows (Triton 3.7.1, sm_90), more
# than an H100 has (227 KB): the launch fails. At 32 rows they take 136 KB (prefill) or 160 KB (decode).
FP32_WIDE_ROWS = 32


def _fp32_wide(head_dim: int, itemsize: int) -> bool:
    return itemsize == 4 and _block_d(head_dim) > 128


def _group_rows(group: int, head_dim: int, itemsize: int) -> int:
    """Rows for one token's whole group of query heads (at least 16, for tl.dot); fp32 tiles wider than 128 hold at
    most FP32_WIDE_ROWS, and a larger group is split over programs (heads_per_program)."""
    rows = max(16, triton.next_power_of_2(group))
    return min(rows, FP32_WIDE_ROWS) if _fp32_wide(head_dim, itemsize) else rows


def prefill_config(group: int, head_dim: int, itemsize: int, max_seqlen_q: int) -> TileConfig:
    """Large query tiles for long prompts (the shapes of Triton's fused-attention tutorial on an H100), small
    ones for short chunks; always at least one token's whole group (but for wide heads, see WIDE_BLOCK_D)."""
    if _block_d(head_dim) >= WIDE_BLOCK_D:
        return wide_config(itemsize, prefill=True)
    wide = head_dim <= 128 and itemsize == 2
    top = 128 if wide else FP32_WIDE_ROWS if _fp32_wide(head_dim, itemsize) else 64
    block_m = min(top, max(16, triton.next_power_of_2(max_seqlen_q * group)))
    block_m = max(block_m, _group_rows(group, head_dim, itemsize))
    # 8 warps from a 128 x 128 fp32 accumulator up: with 4, ptxas spills registers (seen for head_dim 256).
    warps = 8 if block_m * _block_d(head_dim) >= 128 * 128 else 4
    return TileConfig(block_m, 64 if wide else 32, warps, 3 if wide else 2)


def prefill_tile_lengths(group: int) -> list[int]:
    """The fewest new tokens (a step's max_seqlen_q, from 2: one is a decode step) that give each query tile height
    prefill_config picks for this group: steps of these lengths launch every prefill tile shape."""
    return sorted({2, *(max(2, rows // group + 1) for rows in (16, 32, 64))})


def decode_config(group: int, head_dim: int, itemsize: int) -> TileConfig:
    """One token's group of heads (rows padded to 16 for tl.dot). num_stages=2 compiles (triton 3.6, sm_90) to one
    shared K and one V buffer per program, not a pipeline: the loads of the next tile overlap through the other
    programs on the SM (5 of Qwen3-0.6B's bf16 tiles fit one)."""
    if _block_d(head_dim) >= WIDE_BLOCK_D:
        return wide_config(itemsize, prefill=False)
    wide = head_dim <= 128 and itemsize == 2
    return TileConfig(_group_rows(group, head_dim, itemsize), 64 if wide else 32, 4, 2)


def heads_per_program(group: int, block_m: int) -> int:
    """A program's query heads: its KV head's whole group, or, for a group larger than the tile's rows (MLA's one
    KV head for all heads; a group over 16 of wide heads), the largest divisor of the group that fits."""
    return group if group <= block_m else max(d for d in range(1, block_m + 1) if group % d == 0)


@functools.cache  # per layer and step, on the eager path
def decode_programs(num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Programs per sequence of an unsplit decode: one per KV head, or per tile of its heads."""
    group = num_heads // num_kv_heads
    return num_heads // heads_per_program(group, decode_config(group, head_dim, itemsize).block_m)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, scale: float, causal: bool = True, window: int | None = None,
                      config: TileConfig | None = None, soft_cap: float | None = None,
                      sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                      chunk: int | None = None) -> torch.Tensor:
    """q [tokens, heads, dim] -> [tokens, heads * v dim]. k, v: the paged caches [blocks, block_size, kv_heads,
    dim] (keys through block_tables), or this step's [tokens, kv_heads, dim] when each context is just this step's
    tokens (rows from cu_seqlens_k); v narrower than q and k: K's prefix (a view of it). Causal: query j of a
    sequence with n new tokens and context c sits at c - n + j and sees the keys at positions <= its own (and > its
    own - window with a window); non-causal, every key (with a window, those within window - 1 positions of its
    own on either side: an encoder's local attention). With soft_cap, each scaled score s becomes soft_cap *
    tanh(s / soft_cap). sinks [heads]: each head's sink logit joins the denominator of its softmax. alibi_slopes [heads]
    fp32: each head's score of a key gains -slope * |query position - key position| (causal: key - query). chunk
    (causal only): a query at p sees no key before p // chunk * chunk (chunked local attention)."""
    group = q.shape[1] // k.shape[-2]
    config = config or prefill_config(group, v.shape[-1], q.element_size(), max_seqlen_q)
    return _attention(q, k, v, block_tables, context_lens, cu_seqlens_q, cu_seqlens_k, scale, soft_cap, causal,
                      window, config, decode=False, sinks=sinks, alibi_slopes=alibi_slopes, chunk=chunk)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None, num_segments: int = 1,
                     partials: DecodePartials | None = None, config: TileConfig | None = None,
                     soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [seqs, heads, dim] over the paged caches -> [seqs, heads * v dim]; a context
    length 0 gives zeros. With num_segments > 1 each context is split into that many segments computed in
    parallel into `partials` (capacity >= seqs * num_segments), then merged by a reduce kernel. soft_cap, sinks,
    alibi_slopes, chunk and a v narrower than k: as in prefill_attention."""
    config = config or decode_config(q.shape[1] // k_cache.shape[2], v_cache.shape[-1], q.element_size())
    return _attention(q, k_cache, v_cache, block_tables, context_lens, None, None, scale, soft_cap, True, window,
                      config, decode=True, num_segments=num_segments, partials=partials, sinks=sinks,
                      alibi_slopes=alibi_slopes, chunk=chunk)


def _score_scales(scale: float, soft_cap: float | None) -> tuple[float, float]:
    """The kernel's (qk_scale, cap_scale): scores in base 2, capped in natural units first with a soft cap."""
    if soft_cap is None:
        return scale * LOG2E, 0.0
    return scale / soft_cap, soft_cap * LOG2E


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
               scale: float, soft_cap: float | None, causal: bool, window: int | None, config: TileConfig,
               decode: bool, num_segments: int = 1, partials: DecodePartials | None = None,
               sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
               chunk: int | None = None) -> torch.Tensor:
    num_tokens, num_heads, qk_dim = q.shape
    head_dim, num_kv_heads = v.shape[-1], k.shape[-2]  # head_dim: the values' and the output's
    paged = k.dim() == 4
    assert num_heads % num_kv_heads == 0 and k.shape[-1] == qk_dim >= head_dim and q.dtype == k.dtype == v.dtype
    # Unit last strides; paged slots address rows as block * size + offset.
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and (
        not paged or k.is_contiguous() and v.stride(0) == v.shape[1] * v.stride(1))
    assert 1 <= num_segments <= MAX_SEGMENTS and (causal or chunk is None) and all(
        x is None or x.shape == (num_heads,) and x.is_contiguous() for x in (sinks, alibi_slopes))
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if num_tokens == 0:
        return out
    split = num_segments > 1
    if split:
        assert partials.acc.shape[0] >= num_tokens * num_segments and partials.acc.shape[1:] == (num_heads, head_dim)
        bufs = (partials.acc, partials.max, partials.sum)
    else:
        bufs = (out, out, out)  # not read
    group = num_heads // num_kv_heads
    tile_heads = heads_per_program(group, config.block_m)
    kv_split, group = group // tile_heads, tile_heads  # programs per KV head, and the query heads of each
    num_tiles = num_tokens if decode else num_tokens // (config.block_m // group) + context_lens.shape[0]
    block_d, tail = _block_d(head_dim), qk_dim - head_dim
    cu_q = context_lens if cu_seqlens_q is None else cu_seqlens_q  # not read in a decode step
    cu_k = context_lens if cu_seqlens_k is None else cu_seqlens_k
    _attention_kernel[(num_tiles, num_kv_heads * kv_split, num_segments)](
        q, k, v, out, *bufs, block_tables, context_lens, cu_q, cu_k, *_score_scales(scale, soft_cap), window or 0,
        chunk or 0, context_lens.shape[0], num_heads, num_segments, q.stride(0), q.stride(1), k.stride(-3),
        k.stride(-2), v.stride(-3), v.stride(-2), block_tables.stride(0), GROUP=group, KV_SPLIT=kv_split,
        HEAD_DIM=head_dim, BLOCK_D=block_d, TAIL_DIM=tail, BLOCK_T=_block_d(tail), BLOCK_M=config.block_m,
        BLOCK_Q=config.block_m // group, BLOCK_N=config.block_n, KV_BLOCK_SIZE=k.shape[1] if paged else 1,
        DECODE=decode, PAGED=paged, CAUSAL=causal, HAS_WINDOW=window is not None, HAS_CHUNK=chunk is not None,
        SPLIT=split, SOFTCAP=soft_cap is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        # Without sinks (ALiBi) the pointer is never read: any tensor will do.
        sinks_ptr=context_lens if sinks is None else sinks, HAS_SINKS=sinks is not None,
        alibi_ptr=context_lens if alibi_slopes is None else alibi_slopes, ALIBI=alibi_slopes is not None,
        # fp32 dots as three TF32 products (fp32-accurate; Triton's default, one TF32 product, is not; "ieee"
        # compiles to FMA loops that spill kilobytes of registers on sm_90). CPU tensors get here only in the
        # interpreter, whose bf16 needs the upcast.
        UPCAST=q.dtype == torch.bfloat16 and q.device.type == "cpu",
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32")
    if split:
        _reduce_kernel[(num_tokens, num_heads)](out, *bufs, num_segments, num_heads, HEAD_DIM=head_dim,
                                                BLOCK_D=block_d, BLOCK_S=MAX_SEGMENTS, num_warps=4)
    return out
