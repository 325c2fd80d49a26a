"""The Triton attention backend run by Triton's interpreter on CPU tensors: each kernel against a float64
reference, the backend against the PyTorch one on ModelRunner's metadata, and the whole engine against
transformers (plain, prefix-cache hits, chunked prefill, sliding windows, the CUDA-graph runner, the encoder
pass). TRITON_INTERPRET=1 must be set before triton defines a kernel, so tests/test_triton.py runs this file in
a pytest process of its own."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run through tests/test_triton.py (needs TRITON_INTERPRET=1 from the start)", returncode=4)

import cuda_fakes  # noqa: E402  (tests/cuda_fakes.py)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from models import (build_encoder, check_against_hf, hf_encoder_states, hf_greedy, load_hf_encoder,  # noqa: E402
                    random_prompts)
from triton_interpreted import _seq as page_seq  # noqa: E402  (tests/triton_interpreted.py: 256-token blocks)
from triton_interpreted import backends_on_the_same_metadata, flash_on_cpu  # noqa: E402, F401  (a fixture)

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.engine.input_batch import InputBatch  # noqa: E402
from nanoinfer.engine.model_runner import ModelRunner  # noqa: E402
from nanoinfer.engine.scheduler import ScheduledBatch  # noqa: E402
from nanoinfer.engine.sequence import Sequence  # noqa: E402
from nanoinfer.kernels import triton_attention  # noqa: E402
from nanoinfer.kernels.triton_attention import (DecodePartials, TileConfig, decode_attention,  # noqa: E402
                                                prefill_attention)
from nanoinfer.layers.attention import Attention, get_backend  # noqa: E402
from nanoinfer.layers.attention.alibi import bloom_alibi_slopes  # noqa: E402

# Worst |ours - reference| / (1 + |reference|): fp32 differs in summation order only; fp16/bf16 by about one
# rounding of the output, plus (fp16) the probabilities rounded to fp16 for the P @ V product.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
DTYPES = list(TOLERANCE)
# Small tiles, so that the tiny contexts here still span several K/V tiles and segments.
SMALL = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape and bool(torch.isfinite(ours).all())
    return ((ours.double() - ref).abs() / (1 + ref.abs())).max().item()


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int],
              scale: float, causal: bool = True, window: int | None = None, soft_cap: float | None = None,
              sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
              chunk: int | None = None) -> torch.Tensor:
    """float64 attention, sequence by sequence: q [tokens, heads, dim], keys[i]/values[i] [ctx_i, kv_heads, dim]
    -> [tokens, heads * dim]; query j of n new tokens sits at ctx - n + j; a row seeing no key gives 0; non-causal
    with a window, each query sees the keys within window - 1 positions of its own on either side. With soft_cap,
    scores s become soft_cap * tanh(s / soft_cap) before the mask. With sinks [heads], each head's softmax takes its
    sink as one more logit, whose column is dropped after it (transformers' GPT-OSS). With alibi_slopes [heads], each
    head's scores gain -slope * |query position - key position| after the cap. With a chunk (causal), a query at p
    sees no key before p // chunk * chunk."""
    out, start = [], 0
    for k, v, n in zip(keys, values, q_lens):
        ctx, group = k.shape[0], q.shape[1] // k.shape[1]
        k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + n].double(), k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos, k_pos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        if alibi_slopes is not None:
            scores = scores - alibi_slopes.double().view(-1, 1, 1) * (k_pos - q_pos).abs()
        if causal:
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            if chunk is not None:
                visible &= k_pos >= q_pos // chunk * chunk
            scores = scores.masked_fill(~visible, float("-inf"))
        elif window is not None:
            scores = scores.masked_fill((k_pos - q_pos).abs() >= window, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
            scores = torch.cat([scores, sink_column], -1)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)[..., :ctx]
        out.append(torch.einsum("hnl,lhd->nhd", probs, v).flatten(1))
        start += n
    return torch.cat(out)


def paged_cache(contexts: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, list]:
    """Random caches, and block tables giving each sequence shuffled blocks (-1 padded; a context 0 gets none);
    the keys and values each sequence sees, gathered in Python for the reference."""
    counts = [-(-c // block_size) for c in contexts]
    num_blocks = sum(counts) + 2  # two blocks nobody owns
    k_cache, v_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
                        for _ in range(2))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(contexts), max(counts) + 1), -1, dtype=torch.int32)
    keys, values = [], []
    for i, (ctx, count) in enumerate(zip(contexts, counts)):
        blocks, order = order[:count], order[count:]
        tables[i, :count] = torch.tensor(blocks, dtype=torch.int32)
        keys.append(k_cache[blocks].flatten(0, 1)[:ctx])
        values.append(v_cache[blocks].flatten(0, 1)[:ctx])
    return k_cache, v_cache, tables, keys, values


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# (query heads, KV heads, head dim, KV block size): GQA ratios 1 to 8, odd head counts, head dims that are not
# powers of two, block sizes 16 (the default), 5 and 1. Each in fp32, and the other dtypes in turn.
SHAPES = [(4, 4, 64, 16), (6, 2, 80, 16), (8, 1, 96, 5), (3, 1, 128, 16), (5, 5, 32, 1), (8, 2, 64, 16)]
SHAPE_DTYPES = [(shape, dtype) for i, shape in enumerate(SHAPES)
                for dtype in dict.fromkeys([torch.float32, DTYPES[1 + i % 2]])]


@pytest.mark.parametrize("shape, dtype", SHAPE_DTYPES, ids=str)
def test_prefill_kernel_over_the_paged_cache(shape, dtype):
    """A mixed batch as the scheduler makes them: (context, new tokens) = a one-token prompt, a decode row just
    past a block boundary, a chunk after a cached prefix, a fresh prompt of just over two blocks, a sequence
    with no new token. A window shorter than the contexts, and one longer."""
    heads, kv_heads, head_dim, block_size = shape
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    contexts, q_lens = [1, 17, 40, 33, 16], [1, 1, 9, 33, 0]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, block_size, dtype, g)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = _cu(q_lens)
    scale = head_dim ** -0.5
    for window, config in [(7, SMALL), (100, None)]:  # None: the tiles the backend picks
        ours = prefill_attention(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), cu,
                                 _cu(contexts), max(q_lens), scale, window=window, config=config)
        err = _error(ours, reference(q, keys, values, q_lens, scale, window=window))
        assert err < TOLERANCE[dtype], f"window {window}: max error {err:.2e}"


@pytest.mark.parametrize("dtype, alibi", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=str)
@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, None), (False, 5)])
def test_prefill_kernel_over_this_steps_kv(dtype, alibi, causal, window):
    """No cached prefix: keys are this step's k, v, row-strided views into one fused qkv tensor (Qwen3's k is
    normed into a tensor of its own, v stays a view: both layouts). Non-causal (the encoder pass) with a window:
    on both sides (an encoder's local attention, ModernBERT's), over several key tiles and query tiles. With ALiBi,
    non-causal keys on either side are penalized by distance."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, lens = 6, 2, 48, [1, 19, 40]
    qkv = torch.randn(sum(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    q, v = q.view(-1, heads, head_dim), v.view(-1, kv_heads, head_dim)
    k = k.reshape(-1, kv_heads, head_dim).clone()
    cu, extra = _cu(lens), score_option("alibi", heads, g, dtype) if alibi else {}
    ours = prefill_attention(q, k, v, torch.empty(3, 0, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             cu, cu, max(lens), 0.3, causal, window, config=SMALL, **extra)
    keys, values = k.split(lens), v.split(lens)
    err = _error(ours, reference(q, keys, values, lens, 0.3, causal, window, **extra))
    assert err < TOLERANCE[dtype], f"max error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 1, 80), (3, 3, 96)], ids=str)
def test_decode_kernel_split_kv(dtype, heads, kv_heads, head_dim):
    """Contexts: 0 (a row padding a graph's batch: no block, output 0), 1, a full block, one past it, and
    several tiles; 1 segment (no reduce), 2, 5; windows shorter and longer than the contexts.
    The partial buffers start as NaN: every entry the reduce reads must have been written."""
    g = torch.Generator().manual_seed(heads + head_dim)
    contexts = [0, 1, 16, 17, 150]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, dtype, g)
    q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    for window, segments in [(None, 1), (10, 2), (200, 5)]:
        partials = DecodePartials.allocate(len(contexts) * segments, heads, head_dim, q.device)
        for t in (partials.acc, partials.max, partials.sum):
            t.fill_(float("nan"))
        ours = decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2, window, segments, partials,
                                config=SMALL)
        assert torch.equal(ours[0], torch.zeros_like(ours[0]))
        err = _error(ours, reference(q, keys, values, [1] * len(contexts), 0.2, window=window))
        assert err < TOLERANCE[dtype], f"window {window}, {segments} segments: max error {err:.2e}"


# (context, new tokens): a one-token prompt, decode rows just before, at and past chunk boundaries (12: inside
# 16-token blocks; 16: at their edges), a chunk after a cached prefix crossing boundaries, a fresh prompt of several
# chunks, a sequence with no new token.
CHUNK_CONTEXTS, CHUNK_Q_LENS = [1, 12, 13, 17, 33, 40, 50, 16], [1, 1, 1, 1, 1, 27, 50, 0]


@pytest.mark.parametrize("dtype, chunk, window", [(torch.float32, 12, None), (torch.float32, 16, 20),
                                                  (torch.bfloat16, 12, 5)], ids=str)
def test_kernels_with_chunks(dtype, chunk, window):
    """Chunked local attention (Llama 4) in the prefill kernel over the paged cache (GQA: 6 query heads, 2 KV
    heads), over this step's k, v, and in split-KV decode (1 and 3 segments): against float64, and different from
    attention without the chunks."""
    heads, kv_heads, head_dim = 6, 2, 32
    g = torch.Generator().manual_seed(chunk)
    contexts, q_lens = CHUNK_CONTEXTS, CHUNK_Q_LENS
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, dtype, g)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    context_lens, scale = torch.tensor(contexts, dtype=torch.int32), head_dim ** -0.5
    paged = prefill_attention(q, k_cache, v_cache, tables, context_lens, _cu(q_lens), _cu(contexts), max(q_lens),
                              scale, window=window, config=SMALL, chunk=chunk)
    ref = reference(q, keys, values, q_lens, scale, window=window, chunk=chunk)
    assert _error(paged, ref) < TOLERANCE[dtype]
    assert _error(paged, reference(q, keys, values, q_lens, scale, window=window)) > 1e-2
    fresh = [i for i, (c, n) in enumerate(zip(contexts, q_lens)) if c == n]  # this step's k, v: whole prompts
    starts = _cu(q_lens).tolist()
    rows = [r for i in fresh for r in range(starts[i], starts[i + 1])]
    lens = _cu([contexts[i] for i in fresh])
    step = prefill_attention(q[rows], torch.cat([keys[i] for i in fresh]), torch.cat([values[i] for i in fresh]),
                             tables[fresh], context_lens[fresh], lens, lens, max(contexts[i] for i in fresh), scale,
                             window=window, config=SMALL, chunk=chunk)
    assert _error(step, ref[rows]) < TOLERANCE[dtype]
    decode_q = torch.randn(len(contexts), heads, head_dim, generator=g).to(dtype)
    decode_ref = reference(decode_q, keys, values, [1] * len(contexts), scale, window=window, chunk=chunk)
    for segments in (1, 3):
        partials = DecodePartials.allocate(len(contexts) * segments, heads, head_dim, q.device)
        ours = decode_attention(decode_q, k_cache, v_cache, tables, context_lens, scale, window, segments, partials,
                                config=SMALL, chunk=chunk)
        assert _error(ours, decode_ref) < TOLERANCE[dtype], f"{segments} segments"


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, triton_attention._tanh(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_tanh_is_exact_to_fp32():
    """The kernels' tanh (Triton has none of its own that runs here) within 2 ulp of float64's over the range where
    it is not 0 or +-1 in fp32, both sides of the switch from polynomial to exponential at 0.625 included."""
    x = torch.cat([torch.linspace(-10, 10, 200_001), torch.tensor([0.0, 0.625, -0.625, 1e-30, 50.0, -50.0]),
                   torch.linspace(0.62, 0.63, 1001)])
    out = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    ref = torch.tanh(x.double())
    ulp = (out.double() - ref).abs() / torch.finfo(torch.float32).eps / ref.abs().clamp_min(1e-38)
    assert ulp.max().item() <= 2.0, f"{ulp.max().item():.2f} ulp at x = {x[ulp.argmax()].item()}"


SOFT_CAP = 1.5  # below most of the random scores here (std ~2): the cap bends them, a missing tanh shows
SINK_STD = 3.0  # against the same scores: some heads' sinks take most of the softmax, some little


def score_option(option: str, heads: int, g: torch.Generator, dtype: torch.dtype) -> dict:
    """The kernels' (and the reference's) argument for attention-logit softcapping (Gemma 2), for attention sinks
    (GPT-OSS; a logit per head, in the model's dtype) or for ALiBi (BLOOM's slopes for this many heads, fp32)."""
    if option == "softcap":
        return {"soft_cap": SOFT_CAP}
    if option == "alibi":
        return {"alibi_slopes": bloom_alibi_slopes(heads)}
    return {"sinks": (SINK_STD * torch.randn(heads, generator=g)).to(dtype)}


@pytest.mark.parametrize("option", ["softcap", "sinks", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_kernel_softcap_or_sinks(option, dtype, window):
    """Softcapped scores, sinks, or ALiBi (3 query heads per KV head), on a mixed batch over the paged cache: a
    cached prefix before a chunk, a decode row, a fresh prompt."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, contexts, q_lens = 6, 2, 80, [40, 17, 33], [9, 1, 33]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, dtype, g)
    q = (2 * torch.randn(sum(q_lens), heads, head_dim, generator=g)).to(dtype)
    scale, extra = head_dim ** -0.5, score_option(option, heads, g, dtype)
    ours = prefill_attention(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), _cu(q_lens),
                             _cu(contexts), max(q_lens), scale, window=window, config=SMALL, **extra)
    err = _error(ours, reference(q, keys, values, q_lens, scale, window=window, **extra))
    assert err < TOLERANCE[dtype], f"max error {err:.2e}"
    assert _error(ours, reference(q, keys, values, q_lens, scale, window=window)) > 1e-2


@pytest.mark.parametrize("option", ["softcap", "sinks", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_kernel_softcap_or_sinks_split_kv(option, dtype):
    """Softcapped decode, with sinks or with ALiBi, whole and split into segments merged by the reduce kernel, which
    needs no change: the partial maxima are of the capped (biased) scores, and only segment 0 starts from the sink, so
    that it counts once. A context 0 (a graph's padding row) still gives 0."""
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, head_dim, contexts = 4, 2, 64, [0, 1, 17, 150]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, dtype, g)
    q = (2 * torch.randn(len(contexts), heads, head_dim, generator=g)).to(dtype)
    context_lens, extra = torch.tensor(contexts, dtype=torch.int32), score_option(option, heads, g, dtype)
    for window, segments in [(None, 1), (None, 3), (10, 2)]:
        partials = DecodePartials.allocate(len(contexts) * segments, heads, head_dim, q.device)
        ours = decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125, window, segments, partials,
                                config=SMALL, **extra)
        assert torch.equal(ours[0], torch.zeros_like(ours[0]))
        err = _error(ours, reference(q, keys, values, [1] * len(contexts), 0.125, window=window, **extra))
        assert err < TOLERANCE[dtype], f"window {window}, {segments} segments: max error {err:.2e}"
    assert _error(ours, reference(q, keys, values, [1] * len(contexts), 0.125, window=10)) > 1e-2


LATENT, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_latent_cache_kernels(dtype):
    """MLA's latent cache at DeepSeek's widths: one KV head of [latent, rope key] rows whose values are the latents
    (a view of the keys' first 512 entries), 32 query heads taken 16 per program, the tiles the backend picks for
    them; prefill over the paged cache (a cached prefix before a chunk, a decode row, a fresh prompt), then decode
    whole and split, against float64 attention with V = K[..., :512]."""
    g = torch.Generator().manual_seed(13)
    heads, contexts, q_lens = 32, [40, 17, 33], [9, 1, 33]
    k_cache, _, tables, keys, _ = paged_cache(contexts, 1, LATENT + ROPE, 16, dtype, g)
    v_cache, values = k_cache[..., :LATENT], [k[..., :LATENT] for k in keys]
    scale = 192 ** -0.5
    q = torch.randn(sum(q_lens), heads, LATENT + ROPE, generator=g).to(dtype)
    _check_paged_prefill_and_decode(q, k_cache, v_cache, tables, keys, values, q_lens, scale)


def _check_paged_prefill_and_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    tables: torch.Tensor, keys: list, values: list, q_lens: list[int],
                                    scale: float) -> None:
    """Prefill of q over the paged caches with the tiles the backend picks, then decode of each sequence's first
    query, whole and in 3 segments, against float64 attention."""
    contexts = [k.shape[0] for k in keys]
    context_lens, tolerance = torch.tensor(contexts, dtype=torch.int32), TOLERANCE[q.dtype]
    ours = prefill_attention(q, k_cache, v_cache, tables, context_lens, _cu(q_lens), _cu(contexts), max(q_lens),
                             scale)
    err = _error(ours, reference(q, keys, values, q_lens, scale))
    assert err < tolerance, f"prefill: max error {err:.2e}"
    q = q[:len(contexts)]
    for segments in (1, 3):
        partials = DecodePartials.allocate(len(contexts) * segments, q.shape[1], v_cache.shape[-1], q.device)
        ours = decode_attention(q, k_cache, v_cache, tables, context_lens, scale, None, segments, partials)
        err = _error(ours, reference(q, keys, values, [1] * len(contexts), scale))
        assert err < tolerance, f"decode, {segments} segments: max error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (48, 2)], ids=str)
def test_wide_head_kernels(dtype, heads, kv_heads):
    """Heads of 512 (Gemma 4's full layers), with the tiles the backend picks for them: a group of 4 in one program,
    and one of 24, larger than the tiles' rows, split over programs (12 or 24 heads each) for each of the 2 KV heads;
    prefill over the paged cache (a cached prefix before a chunk, a decode row, a fresh prompt) and over this step's
    K/V, then decode whole and split, against float64 attention."""
    g = torch.Generator().manual_seed(heads + 512)
    contexts, q_lens, head_dim = [40, 17, 33], [9, 1, 33], 512
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, dtype, g)
    scale = 1.0  # Gemma 4's unscaled scores (of normed q and k)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype) / 8
    _check_paged_prefill_and_decode(q, k_cache, v_cache, tables, keys, values, q_lens, scale)
    step_k, step_v = (torch.cat([x[-n:] for x, n in zip(xs, q_lens)]) for xs in (keys, values))
    cu = _cu(q_lens)
    ours = prefill_attention(q, step_k, step_v, tables, torch.tensor(q_lens, dtype=torch.int32), cu, cu,
                             max(q_lens), scale)
    err = _error(ours, reference(q, step_k.split(q_lens), step_v.split(q_lens), q_lens, scale))
    assert err < TOLERANCE[dtype], f"prefill over this step's K/V: max error {err:.2e}"


def test_large_fp32_group_of_wide_heads_splits_over_programs():
    """fp32 heads of 160 (tiles 256 wide) in a group of 40 per KV head (multi-query attention): the tiles the backend
    picks hold 32 rows, which an H100's shared memory takes, so the group splits into 2 programs of 20 heads, over
    the paged cache and in decode, whole and split, against float64 attention."""
    heads, kv_heads, head_dim = 80, 2, 160
    config = triton_attention.decode_config(heads // kv_heads, head_dim, 4)
    assert (config.block_m, triton_attention.heads_per_program(heads // kv_heads, config.block_m)) == (32, 20)
    g = torch.Generator().manual_seed(heads + head_dim)
    contexts, q_lens = [21, 3], [5, 3]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, kv_heads, head_dim, 16, torch.float32, g)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    _check_paged_prefill_and_decode(q, k_cache, v_cache, tables, keys, values, q_lens, head_dim ** -0.5)


def test_decode_segments_really_split():
    """The 150-token context over 5 segments of 32-key tiles fills all 5 partial rows; the 17-token one fits in
    the first segment and leaves the others empty (max -inf, sum 0). The most segments give the same output."""
    g = torch.Generator().manual_seed(0)
    contexts = [17, 150]
    k_cache, v_cache, tables, keys, values = paged_cache(contexts, 1, 32, 16, torch.float32, g)
    q = torch.randn(2, 2, 32, generator=g)
    ref = reference(q, keys, values, [1, 1], 0.2)
    partials = DecodePartials.allocate(2 * triton_attention.MAX_SEGMENTS, 2, 32, torch.device("cpu"))
    for segments in (5, triton_attention.MAX_SEGMENTS):
        ours = decode_attention(q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.2, None,
                                segments, partials, config=TileConfig(16, 32, 4, 1))
        assert _error(ours, ref) < TOLERANCE[torch.float32]
        if segments == 5:
            sums = partials.sum[:10, 0].view(2, 5).clone()
            maxes = partials.max[:10, 0].view(2, 5).clone()
    assert bool((sums[1] > 0).all()) and sums[0, 0] > 0
    assert bool((sums[0, 1:] == 0).all()) and bool((maxes[0, 1:] == float("-inf")).all())


def _seq(num_tokens: int, computed: int, table: list[int], block_size: int = 16) -> Sequence:
    seq = Sequence(list(range(num_tokens)), SamplingParams(), block_size)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


BATCHES = {
    # 40 tokens with 32 cached; a chunk (tokens 16..43 of 70) after a first one; a fresh 37-token prompt.
    "prefix-and-chunk": ScheduledBatch([_seq(40, 32, [4, 1, 9]), _seq(70, 16, [0, 3, 5, 7, 8]),
                                        _seq(37, 0, [2, 6, 10])], [8, 28, 37]),
    "fresh": ScheduledBatch([_seq(5, 0, [1]), _seq(33, 0, [0, 3, 2])], [5, 33]),
    "decode": ScheduledBatch([_seq(17, 16, [2, 5]), _seq(9, 8, [0]), _seq(60, 59, [1, 3, 4, 6])], [1, 1, 1]),
    # Decode rows beside a prompt chunk: one step, one kernel.
    "mixed": ScheduledBatch([_seq(17, 16, [2, 5]), _seq(30, 0, [0, 3]), _seq(60, 59, [1, 4, 6, 7])], [1, 30, 1]),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_backend_equals_pytorch_backend_on_the_same_metadata(kind, window):
    """One metadata, built by ModelRunner.prepare, fed to the triton and the PyTorch backends: same caches
    (the store kernel), same outputs."""
    (ours, tk, tv), (cpu, ck, cv) = backends_on_the_same_metadata(("triton", "cpu"), BATCHES[kind], 16, 11, window)
    assert torch.equal(tk, ck) and torch.equal(tv, cv)
    err = (ours - cpu).abs().max().item()
    assert err < 1e-5, f"max |triton - cpu| = {err:.2e}"


def latent_attention(backend_name: str, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA layer (Attention with value_prefix_dim, DeepSeek's widths, 32 heads) on ModelRunner.prepare's metadata
    for `batch` through one backend, over stale caches standing in for earlier steps: (output, cache after)."""
    runner = object.__new__(ModelRunner)  # prepare needs only its input batch and the number of state slots
    runner.num_state_slots = 0
    runner.input_batch = InputBatch(8, 1024, 1024, 16, torch.device("cpu"))
    _, _, meta, _ = runner.prepare(batch, batch.samples)
    g = torch.Generator().manual_seed(5)
    layer = Attention(32, LATENT + ROPE, 0.07, 1, value_prefix_dim=LATENT)
    layer.allocate_cache(11, 16, torch.float32, torch.device("cpu"))
    layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=g))
    q = torch.randn(meta.slot_mapping.numel(), 32, LATENT + ROPE, generator=g)
    k = torch.randn(meta.slot_mapping.numel(), 1, LATENT + ROPE, generator=g)
    layer.backend = get_backend(backend_name, torch.float32)
    layer.backend.prepare(meta)
    return layer(q, k, None, meta), layer.k_cache


@pytest.mark.parametrize("kind", ["prefix-and-chunk", "decode", "mixed"])
def test_latent_cache_backend_equals_pytorch_backend(kind):
    """MLA's latent cache through the triton backend and the PyTorch one (SDPA prefill, the C kernel's decode reading
    whole rows as values): the same cache (K stored alone) and outputs of 32 heads x the 512 latent values."""
    (ours, ours_cache), (cpu, cpu_cache) = (latent_attention(name, BATCHES[kind]) for name in ("triton", "cpu"))
    assert torch.equal(ours_cache, cpu_cache) and ours.shape == cpu.shape and ours.shape[1] == 32 * LATENT
    err = (ours - cpu).abs().max().item()
    assert err < 1e-5, f"max |triton - cpu| = {err:.2e}"


# The backends' arguments for each score option, on backends_on_the_same_metadata's 6 heads: (soft_cap, slopes).
SCORE_OPTIONS = {"softcap": {"soft_cap": SOFT_CAP}, "alibi": {"alibi_slopes": bloom_alibi_slopes(6)}}


@pytest.mark.parametrize("option", sorted(SCORE_OPTIONS))
@pytest.mark.parametrize("kind", ["prefix-and-chunk", "decode", "mixed"])
def test_softcap_or_alibi_backend_equals_pytorch_backend_on_the_same_metadata(kind, option):
    """Softcapped scores, or ALiBi, with a window, through the triton backend and the PyTorch one (explicit scores,
    or SDPA with ALiBi's float mask, in prefill; the C kernel in decode)."""
    (ours, _, _), (cpu, _, _) = backends_on_the_same_metadata(("triton", "cpu"), BATCHES[kind], 16, 11, 6,
                                                              **SCORE_OPTIONS[option])
    [(plain, _, _)] = backends_on_the_same_metadata(("cpu",), BATCHES[kind], 16, 11, 6)
    err = (ours - cpu).abs().max().item()
    assert err < 1e-5, f"max |triton - cpu| = {err:.2e}"
    assert (plain - cpu).abs().max().item() > 1e-2


@pytest.mark.parametrize("option", sorted(SCORE_OPTIONS))
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_flash_backend_passes_the_softcap_and_alibi_slopes(decode, option, flash_on_cpu):
    """flash-attn's softcap and alibi_slopes (its fake here computes flash-attn's documented result) in both of its
    entry points."""
    batch = (ScheduledBatch([page_seq(257, 256, [2, 5]), page_seq(600, 599, [1, 3, 4])], [1, 1]) if decode else
             ScheduledBatch([page_seq(300, 256, [4, 1]), page_seq(37, 0, [2])], [44, 37]))
    (flash, _, _), (cpu, _, _) = backends_on_the_same_metadata(("flash", "cpu"), batch, 256, 6, None,
                                                               **SCORE_OPTIONS[option])
    [(plain, _, _)] = backends_on_the_same_metadata(("cpu",), batch, 256, 6)
    assert (flash - cpu).abs().max().item() < 1e-5 and (plain - cpu).abs().max().item() > 1e-2
    assert [c["fn"] for c in flash_on_cpu] == ["kvcache" if decode else "varlen"]


def test_backend_segment_policy_and_one_partial_buffer():
    """Small batches split (up to MAX_SEGMENTS), large ones do not; one partial buffer per head shape serves
    every batch size, so the addresses captured in CUDA graphs stay valid."""
    backend = get_backend("triton", torch.float32)
    target = backend.split_target
    assert backend.num_segments(target, 1) == backend.num_segments(1, target) == 1
    assert backend.num_segments(1, 1) == min(target, triton_attention.MAX_SEGMENTS)
    for num_seqs in range(1, target + 1):
        for programs in (1, 2, 3, 8):  # per sequence: its KV heads, or its tiles of heads (MLA)
            segments = backend.num_segments(num_seqs, programs)  # split: partial rows for every (seq, segment)
            assert segments == 1 or num_seqs * segments <= -(-2 * target // programs)
    runner = object.__new__(ModelRunner)  # prepare needs only its input batch and the number of state slots
    runner.num_state_slots = 0
    runner.input_batch = InputBatch(8, 64, 64, 16, torch.device("cpu"))
    k_cache = v_cache = torch.randn(11, 16, 1, 32)
    buffers = set()
    for n in (1, 2, 3):
        batch = ScheduledBatch([_seq(20 + i, 19 + i, [i, i + 1]) for i in range(n)], [1] * n)
        _, _, meta, _ = runner.prepare(batch, batch.samples)
        backend.forward(torch.randn(n, 4, 32), None, None, k_cache, v_cache, meta, 0.2)
        buffers |= {p.acc.data_ptr() for p in backend.partials.values()}
    assert len(buffers) == 1


# ---- the whole engine against transformers ----

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def triton_llm(model_dir, **kwargs) -> LLM:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=8, **kwargs)
    runner = llm.llm_engine.model_runner
    assert type(runner.backend).__name__ == "TritonAttentionBackend" and runner.block_size == 16
    assert runner.graph_runner is None  # a CPU device: no CUDA graphs
    return llm


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph-runner", "eager"])
def test_engine_matches_hf(graphs, qwen3_dir, captured_logits, report_logit_diff, monkeypatch):
    """Prompts of lengths around block boundaries and a one-token one. Eager, the 3-row decode batches split
    their contexts (3 x 2 KV heads < the interpreter's target of 8 programs); with the stand-in graphs they
    replay the 4-row graph, captured unsplit (4 x 2 fill the target), the padding row with context 0."""
    prompts = random_prompts(2, 5, 440, 15, 33, seed=21) + [[17]]
    llm = triton_llm(qwen3_dir, max_model_len=128)
    runner = llm.llm_engine.model_runner
    if graphs:
        cuda_fakes.capture_recorded_graphs(runner)
    segments = []
    policy = runner.backend.num_segments
    monkeypatch.setattr(runner.backend, "num_segments", lambda *a: segments.append(policy(*a)) or segments[-1])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    worst = check_against_hf(outputs, hf_greedy(qwen3_dir, prompts, MAX_TOKENS), captured_logits)
    report_logit_diff(f"qwen3, triton backend ({'CUDA-graph runner' if graphs else 'eager'})", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"
    # From the graphs no Python of the backend runs: the split is the one capture chose.
    assert (segments == [] and policy(4, 2) == 1) if graphs else set(segments) == {2}


def twice_against_hf(llm: LLM, model_dir, prompts: list[list[int]], cached: int, captured_logits) -> float:
    """Generates the prompts twice (the second time from the prefix cache) and compares both with transformers:
    the max |logit difference|."""
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= cached for o in second)
    refs = hf_greedy(model_dir, prompts, MAX_TOKENS)
    return max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))


def test_engine_prefix_hits_and_chunked_prefill_match_hf(qwen3_dir, captured_logits, report_logit_diff):
    """Shared 40-token prefix (two full blocks cached), a 24-token budget: chunks that end mid-block, and steps
    mixing prompt chunks with decode rows."""
    shared = random_prompts(1, 5, 440, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 1, 20, seed=4)]
    llm = triton_llm(qwen3_dir, max_model_len=128, max_num_batched_tokens=24)
    worst = twice_against_hf(llm, qwen3_dir, prompts, 32, captured_logits)
    report_logit_diff("qwen3, triton backend, prefix hits + chunked prefill", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


class LaunchRecorder:
    """Stands in for the attention kernel: records the compile-time constants of each launch (those that pick a
    compiled variant; the integer arguments that could are not specialized), then launches the real one."""

    def __init__(self, kernel) -> None:
        self.kernel, self.variants = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.variants.append(tuple(sorted(
                (k, v) for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages"))))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "deepseek-v3"])
def test_start_up_compiles_the_variants_a_workload_launches(kind, model_dir, captured_logits, monkeypatch):
    """On CUDA the runner's start-up runs _compile_kernels, so that Triton compiles no attention variant while
    requests are served: every launch of a workload of fresh prompts, prefix hits, chunks of every length up to the
    24-token budget, mixed batches and eager decode of batches from 6 sequences down to 1 (qwen3's split into
    segments below 4) has the constants of a launch the start-up made (qwen3: 2 query heads per KV head; mistral: 4, and a
    window; deepseek-v3: MLA, chunks over short prefixes decompressed, over long ones absorbed); and outputs still
    equal transformers' after it (its dummy steps leave nothing behind)."""
    recorder = LaunchRecorder(triton_attention._attention_kernel)
    monkeypatch.setattr(triton_attention, "_attention_kernel", recorder)
    d = model_dir(kind)
    llm = triton_llm(d, max_model_len=128, max_num_batched_tokens=24)
    llm.llm_engine.model_runner._compile_kernels()
    compiled = set(recorder.variants)
    recorder.variants.clear()
    shared = random_prompts(1, 5, 440, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 1, 20, seed=4)] + random_prompts(3, 5, 440, 2, 30,
                                                                                                    seed=5)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in second[:3])
    refs = hf_greedy(d, prompts, MAX_TOKENS)
    assert max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits)) < 1e-4
    launched = set(recorder.variants)
    splits = {dict(v)["SPLIT"] for v in launched if dict(v)["DECODE"]}  # qwen3's 6 sequences fill 8 programs
    assert splits == {False, True} if kind == "qwen3" else splits
    assert len(launched) > 1 and launched <= compiled, launched - compiled


def chunked_then_cached_against_hf(kind: str, model_dir, captured_logits) -> float:
    """Prompts sharing 24 tokens through the triton backend, prefilled in 7-token chunks with 8-token blocks, then
    again with a cached prefix (decode under the CUDA-graph runner stand-in): the max |logit
    difference| from transformers."""
    d = model_dir(kind)
    shared = random_prompts(1, 5, 440, 24, 24, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(2, 5, 440, 1, 12, seed=9)]
    llm = LLM(str(d), device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4,
              max_model_len=64, max_num_batched_tokens=7, kvcache_block_size=8)
    cuda_fakes.capture_recorded_graphs(llm.llm_engine.model_runner)
    return twice_against_hf(llm, d, prompts, 16, captured_logits)


@pytest.mark.parametrize("kind", ["qwen3-swa", "gemma3", "olmo3", "gemma2", "gpt-oss", "gemma4-e", "gemma3n",
                                  "mimo-v2-flash"])
def test_engine_sliding_window_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """Windowed (qwen3-swa: 9, gemma3: 10, olmo3: 11, gemma2: 11, gpt-oss: 12, gemma4-e and gemma3n: 10, mimo-v2-flash:
    11) and full layers (gemma3, olmo3: with their own rope; gemma3, gemma2: a score scale that is not head_dim **
    -0.5; gemma2: softcapped scores; gpt-oss: attention sinks; gemma4-e: full layers' heads twice as wide, layers over
    other layers' caches; gemma3n: those layers inside AltUp's streams; mimo-v2-flash: sinks, values zero-padded to
    the keys' width, KV heads by layer);
    contexts a few windows long, prefilled in chunks, then again with a cached prefix, decode under the CUDA-graph
    runner stand-in."""
    worst = chunked_then_cached_against_hf(kind, model_dir, captured_logits)
    report_logit_diff(f"{kind}, triton backend, sliding window", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


def test_engine_chunked_attention_matches_hf(model_dir, captured_logits, report_logit_diff):
    """Llama 4's chunked local attention (chunks of 12 on layers 0-2) over contexts of several chunks, in 7-token
    chunks of prefill, then from the prefix cache, decode under the CUDA-graph runner stand-in (each row's chunk
    found from its context length alone)."""
    worst = chunked_then_cached_against_hf("llama4", model_dir, captured_logits)
    report_logit_diff("llama4, triton backend, chunked local attention", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_engine_alibi_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """ALiBi (BLOOM's 6 heads, MPT's 4) in chunks, over a cached prefix, and in decode under the CUDA-graph runner
    stand-in (the slopes a buffer at a fixed address)."""
    worst = chunked_then_cached_against_hf(kind, model_dir, captured_logits)
    report_logit_diff(f"{kind}, triton backend, ALiBi", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


def test_engine_doge_key_biases_match_hf(model_dir, captured_logits, report_logit_diff):
    """Doge's dynamic mask: each key's score bias one more key dimension (24-wide heads: 16 + 8), cached with the key,
    in chunks, over a cached prefix, and in decode under the CUDA-graph runner stand-in."""
    worst = chunked_then_cached_against_hf("doge", model_dir, captured_logits)
    report_logit_diff("doge, triton backend, key biases", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("kind", ["diffllama", "hrm-text"])
def test_engine_reshaped_attention_matches_hf(kind, model_dir, captured_logits, report_logit_diff):
    """DiffLlama's doubled heads (keys zero-padded, values paired) and HRM-Text's layers with a cache per run, in
    chunks, over a cached prefix, and in decode under the CUDA-graph runner stand-in (HRM-Text's runs replayed in
    order)."""
    worst = chunked_then_cached_against_hf(kind, model_dir, captured_logits)
    report_logit_diff(f"{kind}, triton backend", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


def test_engine_mla_matches_hf(model_dir, captured_logits, report_logit_diff):
    """DeepSeek-V3's MLA over the latent cache (rows of 32 latents + 8 rope dims, the latents as values), prefilled
    in 7-token chunks, then again from the prefix cache, decode under the CUDA-graph runner stand-in."""
    kind = "deepseek-v3"
    d = model_dir(kind)
    shared = random_prompts(1, 5, 440, 24, 24, seed=12)[0]
    prompts = [shared + tail for tail in random_prompts(2, 5, 440, 1, 12, seed=13)]
    llm = triton_llm(d, max_model_len=64, max_num_batched_tokens=7)
    attention = llm.llm_engine.model_runner.model.model.layers[0].self_attn.attn
    assert attention.k_cache.shape[2:] == (1, 32 + 8) and attention.v_cache.shape[2:] == (1, 32)
    cuda_fakes.capture_recorded_graphs(llm.llm_engine.model_runner)
    worst = twice_against_hf(llm, d, prompts, 16, captured_logits)
    report_logit_diff(f"{kind}, triton backend, MLA", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


@torch.inference_mode()
def test_mixed_mla_step_matches_transformers_and_the_absorbed_path(monkeypatch):
    """test_deepseek.py's mixed MLA step through the Triton backend: the prefill sequences through the prefill
    kernel over decompressed, non-paged K/V (values 16 wide, keys 16 + 8, one sequence's context longer than its
    new tokens), the decode and the short chunk absorbed over the latent cache."""
    from test_deepseek import mixed_step_against_hf_and_absorbed

    mixed_step_against_hf_and_absorbed("deepseek-v3", "triton", monkeypatch)


def test_encoder_pass_matches_hf(llama_dir, report_logit_diff):
    """LLM.embed: non-causal, nothing cached (no slot mapping), keys are this step's k, v."""
    prompts = random_prompts(3, 5, 440, 1, 40, seed=11)
    llm = triton_llm(llama_dir, max_model_len=64)
    outputs = llm.embed(prompts, pooling="last")
    worst = max((torch.tensor(o.outputs.embedding) - hf_encoder_states(llama_dir, p)[-1]).abs().max().item()
                for o, p in zip(outputs, prompts))
    report_logit_diff("llama, triton backend, embeddings (max |diff|)", worst)
    assert worst < 1e-4, f"max |embedding diff| {worst:.2e}"


def test_bert_cross_encoder_matches_hf(tmp_path, report_logit_diff):
    """An encoder (BERT, models/bert.py): non-causal over this step's k, v with absolute positions and token types;
    its [CLS] hidden states and cross-encoder logits of text pairs."""
    d = build_encoder("bert", tmp_path / "bert", num_labels=1)
    llm = triton_llm(d, max_model_len=64)
    docs = ["Paris is the capital of France.", "Bananas are yellow."]
    scores = llm.score("What is the capital of France?", docs, use_activation=False)
    embeddings = llm.embed([o.prompt_token_ids for o in scores], pooling="cls")
    model = load_hf_encoder(d)
    worst = 0.0
    for doc, score, embedding in zip(docs, scores, embeddings):
        encoding = llm.tokenizer("What is the capital of France?", doc, return_tensors="pt")
        with torch.no_grad():
            logit = model(**encoding).logits[0, 0].item()
            cls_state = model.bert(encoding["input_ids"]).last_hidden_state[0, 0]  # embed passes no token types
        worst = max(worst, abs(score.outputs.score - logit),
                    (torch.tensor(embedding.outputs.embedding) - cls_state).abs().max().item())
    report_logit_diff("bert, triton backend, cross-encoder logits and embeddings (max |diff|)", worst)
    assert worst < 1e-4, f"max |diff| {worst:.2e}"


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_modernbert_cross_encoder_matches_hf(backend, tmp_path, report_logit_diff, request):
    """ModernBERT (models/modernbert.py): local layers windowed on both sides in the non-causal pass, each layer
    type with its rope theta; a mean-pooling cross-encoder's logits of token-id pairs longer than the window, and
    the cls embeddings of its encoder. Through the Triton kernels, and through the flash backend (flash-attn's
    window_size, by its fake)."""
    d = build_encoder("modernbert", tmp_path / "modernbert", num_labels=1)
    if backend == "triton":
        llm = triton_llm(d, max_model_len=64)
    else:
        calls = request.getfixturevalue("flash_on_cpu")
        llm = LLM(str(d), device="cpu", dtype="float32", attention_backend="flash", max_model_len=64)
    pairs = [(a, b[:12]) for a, b in zip(random_prompts(3, 5, 440, 10, 40, seed=12),
                                          random_prompts(3, 5, 440, 1, 20, seed=13))]
    scores = llm.score([a for a, _ in pairs], [b for _, b in pairs], use_activation=False)
    embeddings = llm.embed([o.prompt_token_ids for o in scores], pooling="cls")
    model = load_hf_encoder(d)
    worst = 0.0
    for (a, b), score, embedding in zip(pairs, scores, embeddings):
        with torch.no_grad():
            logit = model(torch.tensor([a + b])).logits[0, 0].item()
            cls_state = model.model(torch.tensor([a + b])).last_hidden_state[0, 0]
        worst = max(worst, abs(score.outputs.score - logit),
                    (torch.tensor(embedding.outputs.embedding) - cls_state).abs().max().item())
    report_logit_diff(f"modernbert, {backend} backend, cross-encoder logits and embeddings (max |diff|)", worst)
    assert worst < 1e-4, f"max |diff| {worst:.2e}"
    if backend == "flash":
        assert {c["fn"] for c in calls} == {"varlen"}


def test_engine_with_ngram_drafts_matches_hf(qwen3_dir):
    """Speculative decoding through the Triton backend: steps verifying drafts run the varlen prefill kernel over
    the cached prefix; the greedy tokens are transformers'."""
    prompt = random_prompts(40, 5, 440, 2, 24, seed=11)[15]  # a prompt whose greedy output loops
    llm = triton_llm(qwen3_dir, max_model_len=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    check_against_hf(llm.generate([prompt], params, use_tqdm=False), hf_greedy(qwen3_dir, [prompt], 12))
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
