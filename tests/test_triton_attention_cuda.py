"""The Triton attention backend on a real GPU (skipped without CUDA): against the PyTorch backend at Qwen3-0.6B's
attention sizes, decode replayed from a CUDA graph, and the engine against transformers."""
import pytest
import torch

from models import REFERENCE_MAX_TOKENS, REFERENCE_PROMPTS, cached_hf_greedy, check_against_hf, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.kernels.cuda import compiled_variants, engine_kernels
from nanoinfer.layers.attention import Attention, get_backend
from test_cuda_path import _seq

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16  # Qwen3-0.6B
REL_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _prepare(batch: ScheduledBatch):
    runner = object.__new__(ModelRunner)  # prepare needs only its input batch and the number of state slots
    runner.num_state_slots = 0
    runner.input_batch = InputBatch(256, 4096, 8192, BLOCK, torch.device("cpu"))
    return runner.prepare(batch, batch.samples)


def _table(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


def _batch(kind: str) -> ScheduledBatch:
    """(tokens, computed, new) per sequence; each gets its own run of blocks."""
    shapes = {
        "fresh": [(900, 0, 900), (1, 0, 1), (257, 0, 257), (100, 0, 100)],
        "prefix-and-chunk": [(1200, 1024, 176), (2000, 512, 512), (33, 16, 17)],
        "mixed": [(1500, 1499, 1), (700, 0, 700), (64, 63, 1), (300, 256, 44)],
        "decode-small": [(3000, 2999, 1), (17, 16, 1)],  # split into segments
        "decode-large": [(1024 + i, 1023 + i, 1) for i in range(256)],  # one segment, fills the GPU
    }[kind]
    seqs, first = [], 0
    for tokens, computed, _ in shapes:
        seqs.append(_seq(tokens, computed, _table(first, tokens), BLOCK))
        first += len(seqs[-1].block_table)
    return ScheduledBatch(seqs, [new for _, _, new in shapes])


def _run(name: str, dtype: torch.dtype, meta, q, k, v, caches, window, **options):
    backend = get_backend(name, dtype, torch.device("cuda"))
    k_cache, v_cache = (c.clone() for c in caches)
    backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    backend.prepare(meta)
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, window, **options)


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of a token's output relative to that token's largest value: a batch-wide maximum would
    let a long context's small outputs (a 1-token prompt's is a value row, ~4; a 3,000-token context's ~0.05) be
    wrong unseen."""
    ours, ref = ours.float().flatten(1), ref.float().flatten(1)
    return ((ours - ref).abs().amax(1) / ref.abs().amax(1).clamp_min(1e-30)).max().item()


def _check_against_pytorch_backend(dtype: torch.dtype, kind: str, window: int | None, heads: int = HEADS,
                                   kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, **options) -> None:
    batch = _batch(kind)
    _, _, meta, _ = _prepare(batch)
    meta = meta.to(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, num_blocks = meta.slot_mapping.numel(), sum(len(s.block_table) for s in batch.seqs)
    q = torch.randn(tokens, heads, head_dim, generator=g, device="cuda").to(dtype)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    caches = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    ours = _run("triton", dtype, meta, q, k, v, caches, window, **options)
    ref = _run("cpu", dtype, meta, q, k, v, caches, window, **options)
    rel = _relative_error(ours, ref)
    assert rel < REL_TOLERANCE[dtype], f"relative error {rel:.2e}"


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("kind", ["fresh", "prefix-and-chunk", "mixed", "decode-small", "decode-large"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backend_matches_pytorch_backend_at_real_sizes(dtype, kind, window):
    _check_against_pytorch_backend(dtype, kind, window)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(12, 4, 80), (8, 8, 256), (32, 4, 512), (48, 2, 512)])
@pytest.mark.parametrize("kind", ["prefix-and-chunk", "decode-small"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_other_head_shapes_match_pytorch_backend(dtype, kind, heads, kv_heads, head_dim):
    """Shapes a held-out model may have: head_dim 80 (a padded 128-wide tile) with 3 query heads per KV head, and
    head_dim 256 (whose fp32 prefill tiles once needed more shared memory than an H100 has), and 512 (Gemma 4's full
    layers: the wide tiles), with a group of 24 split over programs."""
    _check_against_pytorch_backend(dtype, kind, None, heads, kv_heads, head_dim)


@pytest.mark.parametrize("options", ["softcap-sinks", "alibi-chunk"])
@pytest.mark.parametrize("kind", ["prefix-and-chunk", "mixed", "decode-small"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_score_options_match_pytorch_backend(dtype, kind, options):
    """Gemma 2's soft cap with GPT-OSS's sinks (a logit per head), and BLOOM's ALiBi with Llama 4's chunked local
    attention (chunks of 256 tokens), compiled: elsewhere only the interpreter and the family engines run them."""
    if options == "softcap-sinks":
        sinks = torch.randn(HEADS, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").to(dtype)
        _check_against_pytorch_backend(dtype, kind, None, soft_cap=2.0, sinks=sinks)
    else:
        slopes = 2.0 ** -torch.linspace(0.5, 8, HEADS, device="cuda")
        _check_against_pytorch_backend(dtype, kind, None, alibi_slopes=slopes, chunk=256)


def _latent_run(name: str, dtype: torch.dtype, meta, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
                ) -> torch.Tensor:
    """An MLA layer over a copy of `cache` (the latent cache: values are each row's first 512 entries)."""
    layer = Attention(q.shape[1], q.shape[2], 192 ** -0.5, 1, value_prefix_dim=512)
    layer.allocate_cache(cache.shape[0], BLOCK, dtype, torch.device("cuda"))
    layer.k_cache.copy_(cache)
    layer.backend = get_backend(name, dtype, torch.device("cuda"))
    layer.backend.prepare(meta)
    return layer(q, k, None, meta).float()


@pytest.mark.parametrize("kind", ["prefix-and-chunk", "mixed", "decode-small", "decode-large"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_latent_cache_matches_pytorch_backend(dtype, kind):
    """DeepSeek-V3's MLA on one GPU: 128 query heads over the one latent KV head (keys 576 wide, the first 512 the
    values), through Triton's wide tiles (16 or 32 heads per program) and through the PyTorch backend."""
    batch = _batch(kind)
    _, _, meta, _ = _prepare(batch)
    meta = meta.to(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(2)
    tokens, num_blocks = meta.slot_mapping.numel(), sum(len(s.block_table) for s in batch.seqs)
    q = torch.randn(tokens, 128, 576, generator=g, device="cuda").to(dtype)
    k = torch.randn(tokens, 1, 576, generator=g, device="cuda").to(dtype)
    cache = torch.randn(num_blocks, BLOCK, 1, 576, generator=g, device="cuda").to(dtype)
    ours, ref = (_latent_run(name, dtype, meta, q, k, cache) for name in ("triton", "cpu"))
    rel = _relative_error(ours, ref)
    assert rel < REL_TOLERANCE[dtype], f"relative error {rel:.2e}"


def test_decode_replays_from_a_cuda_graph():
    """Captured once with fixed buffers, replayed with other contexts and tables: equals an eager step."""
    batch = _batch("decode-small")
    _, _, meta, _ = _prepare(batch)
    meta = meta.to(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = torch.randn(2, 200, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    backend = get_backend("triton", torch.bfloat16, torch.device("cuda"))
    backend.forward(q, None, None, k_cache, v_cache, meta, 0.1)  # warm-up: compile, allocate the partials
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, None, None, k_cache, v_cache, meta, 0.1)
    meta.context_lens.copy_(torch.tensor([1900, 30], dtype=torch.int32))  # the second has 2 blocks
    tables = meta.block_tables
    tables.copy_(torch.where(tables >= 0, 199 - tables, tables))  # other blocks of the 200
    q.normal_(generator=g)
    graph.replay()
    eager = backend.forward(q, None, None, k_cache, v_cache, meta, 0.1)
    assert torch.equal(out, eager)


def test_engine_matches_hf_on_the_gpu(qwen3_dir, captured_logits):
    """fp32 on the GPU, the triton backend with CUDA graphs, against transformers fp32 on the CPU."""
    greedy = SamplingParams(temperature=0, max_tokens=REFERENCE_MAX_TOKENS, ignore_eos=True)
    with LLM(str(qwen3_dir), device="cuda", dtype="float32", attention_backend="triton", max_model_len=256) as llm:
        assert llm.llm_engine.model_runner.graph_runner is not None
        outputs = llm.generate(REFERENCE_PROMPTS, greedy, use_tqdm=False)
    worst = check_against_hf(outputs, cached_hf_greedy(qwen3_dir, REFERENCE_PROMPTS, REFERENCE_MAX_TOKENS),
                             captured_logits)
    assert worst < 1e-3, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_kernel_compiles_while_requests_are_served(qwen3_dir, enforce_eager):
    """Start-up (the runner's compile steps and the decode graphs' capture) compiles every Triton variant that
    serving needs, in bf16 as served: fresh prompts, prefix hits, chunks of every length up to the 64-token budget,
    steps mixing chunks with decode rows, greedy and seeded temperature sampling, decode through graphs or eager. A variant compiled mid-run costs
    about a second on a cold Triton cache."""
    shared = random_prompts(1, 5, 440, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(4, 5, 440, 1, 60, seed=4)] + random_prompts(6, 5, 440, 2, 200,
                                                                                                    seed=5)
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=i)
              for i, t in enumerate([0.0, 0.6] * 5)]
    # Earlier tests in this process compiled most variants: forgotten, each is loaded again (from Triton's disk
    # cache) at its first launch, so that only this engine's start-up can have compiled it.
    for fn in engine_kernels().values():
        fn.device_caches.clear()
    with LLM(str(qwen3_dir), device="cuda", dtype="bfloat16", attention_backend="triton", max_model_len=256,
             max_num_batched_tokens=64, enforce_eager=enforce_eager) as llm:
        assert (llm.llm_engine.model_runner.graph_runner is None) == enforce_eager
        before = compiled_variants()
        for _ in range(2):  # the second time with prefix-cache hits
            llm.generate(prompts, params, use_tqdm=False)
    after = compiled_variants()
    assert after == before, {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
