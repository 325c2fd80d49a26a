"""nanoinfer on a CUDA GPU against transformers on the same GPU: every family in fp32 token for token, bf16 up to
genuine bf16 near-ties, prefix-cache hits, chunked prefill and preemption, the KV cache sized from free memory,
and GPU memory given back on close. Each test runs with every attention backend this build offers (skipped where
one cannot run, and 'auto' as the backend it takes). All are marked `cuda`: skipped, with the reason, where no CUDA
device is visible."""
import gc
import json
import pathlib
import weakref

import pytest
import torch

from models import (DENSE_KINDS, EXTRA_KINDS, LAYERNORM_KINDS, MODEL_KINDS, NEWEST_DENSE_KINDS, causal_lm_class,
                    check_against_hf, check_bf16_outputs, hf_attention, hf_greedy, hf_reordering_noise,
                    random_prompts)
from models import REFERENCE_MAX_TOKENS as MAX_TOKENS
from models import REFERENCE_PROMPTS as PROMPTS
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.attention.selector import BACKEND_CHOICES, flash_attn_available

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
FP32_LOGIT_ATOL = 2e-4  # the CPU suite sees ~2e-5; GPU reductions run in other orders
MIB = 1 << 20
# The families the GPU issues name (Qwen3 tied and untied, Qwen2, Llama with llama3 rope, Mistral with a window,
# Qwen3-MoE, Qwen3-Next) run in every CUDA check; the other families are the wide net, marked `wide`, which
# scripts/gpu_check.sh's first call leaves for a call of its own (a task's device time is short).
CORE_KINDS = MODEL_KINDS + ("mistral", "qwen3-moe", "qwen3-next")


def families(kinds) -> list:
    return [kind if kind in CORE_KINDS else pytest.param(kind, marks=pytest.mark.wide) for kind in kinds]


@pytest.fixture(params=BACKEND_CHOICES)
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def ieee_fp32(monkeypatch):
    """fp32 means fp32 on both sides: matmuls use no TF32 unless asked to, but cuDNN convolutions (transformers'
    Qwen3-Next) do by default."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def small_cache_utilization() -> float:
    """A gpu_memory_utilization leaving about 2 GiB for the KV cache: sized by the warm-up as by default, without
    the millions of blocks 90% of a GPU makes for these tiny models."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return min(0.95, (total - free + (2 << 30)) / total)


def make_llm(model_dir, backend: str, dtype: str, **kwargs) -> LLM:
    """An engine on CUDA with this attention backend; the test is skipped where the backend cannot run here (not
    installed, or not in this dtype or block size), as Config says, and for 'auto', which runs what the id of the
    backend it takes runs (the default engine's test checks which one that is). Where the model's decode can be
    captured, an engine whose capture failed fails the test."""
    kwargs.setdefault("max_model_len", 256)
    # At most 8 sequences (PROMPTS are 7): four decode graphs to capture per engine, not twenty; the default of
    # 256 is the default engine's, test_random_schedules' CUDA twin and test_example's.
    kwargs.setdefault("max_num_seqs", 8)
    if "num_kvcache_blocks" not in kwargs:
        kwargs["gpu_memory_utilization"] = small_cache_utilization()
    try:
        config = Config(model_dir, device="cuda", dtype=dtype, attention_backend=backend, **kwargs)
    except ValueError as e:
        pytest.skip(f"attention_backend={backend!r}, dtype={dtype}: {e}")
    if backend == "auto":
        pytest.skip(f"attention_backend='auto' takes {config.attention_backend!r} here (dtype={dtype}): the same run "
                    f"as that backend's id")
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, attention_backend=backend, **kwargs)
    # A refused capture leaves decode eager with a warning, and correct: it must not pass unseen.
    runner = llm.llm_engine.model_runner
    if (backend != "cpu" and not kwargs.get("enforce_eager") and runner.model_capturable()
            and runner.graph_runner is None):
        llm.close()
        pytest.fail("the decode graphs' capture failed: its warning in the log says why")
    return llm


_HF_MODELS: dict[tuple, torch.nn.Module] = {}
_REFERENCES: dict[tuple, list[dict]] = {}


def hf_model(model_dir, dtype: torch.dtype, attn_implementation: str | None = None) -> torch.nn.Module:
    """transformers' model on the GPU in `dtype` (loaded once per session), its attention as hf_attention says."""
    key = (str(model_dir), dtype, attn_implementation)
    if key not in _HF_MODELS:
        model_type = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["model_type"]
        _HF_MODELS[key] = causal_lm_class(model_type).from_pretrained(
            model_dir, dtype=dtype, **hf_attention(model_dir, attn_implementation)).to("cuda").eval()
    return _HF_MODELS[key]


def reference(model_dir, dtype: torch.dtype, prompts=PROMPTS) -> list[dict]:
    """transformers' greedy tokens and logits, computed on the GPU in `dtype` (once per session)."""
    key = (str(model_dir), dtype, tuple(map(tuple, prompts)))
    if key not in _REFERENCES:
        _REFERENCES[key] = hf_greedy(hf_model(model_dir, dtype), prompts, MAX_TOKENS)
    return _REFERENCES[key]


# ---- correctness against transformers on the GPU ----

def test_prefix_cache_hits_on_cuda(backend, qwen3_dir, captured_logits, report_logit_diff):
    shared = random_prompts(1, 5, 440, 300, 300, seed=3)[0]  # a full page even for 256-token blocks
    prompts = [shared + tail for tail in random_prompts(4, 5, 440, 1, 20, seed=4)] + [shared]
    with make_llm(qwen3_dir, backend, "float32", max_model_len=512) as llm:
        block_size = llm.llm_engine.config.kvcache_block_size
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        # Admitted in the same step, the later prompts share the first one's full prefix blocks.
        assert [o.num_cached_tokens for o in first] == [0] + [300 // block_size * block_size] * 4
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 300 // block_size * block_size for o in second)
        refs = reference(qwen3_dir, torch.float32, prompts)
        worst = max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))
        report_logit_diff(f"qwen3, CUDA fp32 prefix-cache hits, {backend}", worst)
        assert worst < FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_chunked_prefill_on_cuda(backend, qwen2_dir, captured_logits, report_logit_diff):
    with make_llm(qwen2_dir, backend, "float32", max_num_batched_tokens=7) as llm:  # every prompt in many chunks
        worst = check_against_hf(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference(qwen2_dir, torch.float32),
                                 captured_logits)
        report_logit_diff(f"qwen2, CUDA fp32 chunked prefill, {backend}", worst)
        assert worst < FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_preemption_on_cuda(backend, llama_dir, captured_logits, report_logit_diff):
    # 8 blocks of 16 tokens cannot hold all sequences at once: decode must preempt and recompute.
    with make_llm(llama_dir, backend, "float32", max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=8,
                  max_num_batched_tokens=64) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        worst = check_against_hf(outputs, reference(llama_dir, torch.float32), captured_logits)
        report_logit_diff(f"llama, CUDA fp32 preemption, {backend}", worst)
        assert worst < FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3", "gpt-oss", "llama4"])
def test_moe_decodes_from_graphs_in_bf16_on_sm90(kind, model_dir):
    """Mixture-of-experts models decode from CUDA graphs in bf16 on sm90 (fused_moe.experts_capturable; a refused
    capture would leave them eager with a warning): the same tokens as eager decode, 8 sequences decoding together at
    a captured batch size, so the same kernels on the same shapes. The families: plain, MLA's latent cache, attention
    sinks with expert biases, chunked attention."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"MoE decode graphs are captured in bf16 on sm90 only, this GPU is sm"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}")
    d, prompts, tokens = model_dir(kind), random_prompts(8, 5, 440, 2, 90, seed=8), []
    for eager in (False, True):
        with make_llm(d, "triton", "bfloat16", enforce_eager=eager) as llm:
            assert (llm.llm_engine.model_runner.graph_runner is None) == eager
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("kind", ["qwen3.5", "lfm2", "mamba2", "rwkv"])
def test_recurrent_models_decode_from_graphs(kind, model_dir):
    """Models with recurrent state decode from CUDA graphs (each sequence's slot from a static buffer), in fp32 at
    any capability: the same tokens as eager decode, 8 sequences (a one-token prompt among them) decoding together at
    a captured batch size, so the same kernels on the same shapes. Linear attention, short convolutions, Mamba2,
    RWKV."""
    d, prompts, tokens = model_dir(kind), random_prompts(7, 5, 440, 2, 90, seed=8) + [[17]], []
    for eager in (False, True):
        with make_llm(d, "triton", "float32", enforce_eager=eager) as llm:
            assert (llm.llm_engine.model_runner.graph_runner is None) == eager
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_prompt_embeds_logits_processors_and_processed_logprobs_on_cuda(backend, qwen3_dir):
    """Prompt embeddings, custom logits processors and processed logprobs where they meet the device.
    - The embeddings replace the embedding's output on the GPU, and one-token prompts (a decode-shaped first step)
      run eagerly beside the decode graphs.
    - A processor changes device logits.
    - Processed logprobs come from the same draws as raw ones."""
    from test_logits_processors import ForcedCount
    from test_prompt_embeds import embedded
    from test_random_schedules import assert_same, completions
    prompts, single = random_prompts(5, 5, 440, 4, 40, seed=9), [[17], [230]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    with make_llm(qwen3_dir, backend, "float32", enable_prompt_embeds=True, logits_processors=[ForcedCount]) as llm:
        want = llm.generate(prompts + single, greedy, use_tqdm=False)
        got = (llm.generate(embedded(qwen3_dir, prompts), greedy, use_tqdm=False)
               + llm.generate(embedded(qwen3_dir, single), greedy, use_tqdm=False))
        forced = llm.generate(prompts[:2], SamplingParams(temperature=0.8, seed=1, max_tokens=6,
                                                          extra_args={"count_from": 40}), use_tqdm=False)
    assert_same(completions(got), completions(want), f"{backend}: prompt embeddings on CUDA")
    assert [o.outputs[0].token_ids for o in forced] == [list(range(40, 46))] * 2
    sampled = SamplingParams(temperature=0.7, top_k=20, seed=2, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for mode in ("raw_logprobs", "processed_logprobs"):
        with make_llm(qwen3_dir, backend, "float32", logprobs_mode=mode) as llm:
            runs.append([o.outputs[0] for o in llm.generate(prompts, sampled, use_tqdm=False)])
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    raw, processed = ([lp[t].logprob for c in run for lp, t in zip(c.logprobs, c.token_ids)] for run in runs)
    assert all(-1e9 < p <= 0 for p in processed) and max(abs(a - b) for a, b in zip(raw, processed)) > 1e-3


def test_one_token_budget_on_cuda(backend, qwen3_dir, captured_logits, report_logit_diff):
    """max_num_batched_tokens=1: the warm-up sizing the cache is one 1-token prompt (not a decode over the cache it
    is sizing), and every later step one token."""
    with make_llm(qwen3_dir, backend, "float32", max_num_batched_tokens=1, max_num_seqs=4) as llm:
        worst = check_against_hf(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False),
                                 reference(qwen3_dir, torch.float32, PROMPTS[:3]), captured_logits)
        report_logit_diff(f"qwen3, CUDA fp32 one-token budget, {backend}", worst)
        assert worst < FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


def test_sliding_window_chunked_prefill_and_prefix_cache_on_cuda(backend, model_dir, captured_logits,
                                                                 report_logit_diff):
    d = model_dir("mistral")  # window 20, not a multiple of the 8-token blocks
    shared = random_prompts(1, 5, 440, 40, 40, seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(3, 5, 440, 1, 30, seed=9)]
    with make_llm(d, backend, "float32", max_model_len=128, max_num_batched_tokens=7, kvcache_block_size=8) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 40 for o in second)
        refs = reference(d, torch.float32, prompts)
        worst = max(check_against_hf(first, refs, captured_logits), check_against_hf(second, refs, captured_logits))
        report_logit_diff(f"mistral, CUDA fp32 window + chunks + prefix cache, {backend}", worst)
        assert worst < FP32_LOGIT_ATOL, f"max |logit diff| {worst:.2e}"


# ---- KV cache sizing and GPU memory ----

def kv_cache_bytes(llm: LLM) -> int:
    model = llm.llm_engine.model_runner.model
    return sum(a.k_cache.nbytes + a.v_cache.nbytes for a in model.modules() if isinstance(a, Attention))


def settled_memory() -> tuple[int, int]:
    """(bytes allocated by tensors, bytes free on the device) with nothing cached by the allocator."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


def test_default_engine_takes_what_gpu_memory_utilization_leaves_twice_in_a_row(qwen3_dir):
    """LLM(model) as a new user makes it (auto backend and dtype, gpu_memory_utilization=0.9), two in a row: each
    KV cache is within a few percent of 90% of the GPU minus what was in use before, the GPU keeps ~10% free,
    and close() gives everything back."""
    allocated, free = settled_memory()
    total = torch.cuda.mem_get_info()[1]
    allowed = 0.9 * total - (total - free)
    for _ in range(2):
        with LLM(str(qwen3_dir)) as llm:  # closed on failure too: the next tests need the GPU's memory
            assert llm.llm_engine.model_runner.device.type == "cuda"
            assert llm.llm_engine.config.attention_backend == ("flash" if flash_attn_available() else "triton")
            assert abs(kv_cache_bytes(llm) - allowed) < 0.03 * total, (kv_cache_bytes(llm), allowed)
            assert abs(settled_memory()[1] - 0.1 * total) < 0.03 * total
            out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == MAX_TOKENS
        assert settled_memory()[0] - allocated < 4 * MIB


def test_memory_comes_back_after_close_del_and_with_and_stays_flat(qwen3_dir, backend):
    """The tiny model's weights (under 1 MiB) and the runner's buffers are below what memory_allocated() can tell
    from noise, and close() empties the KV caches whoever holds the model: weak references check that nothing
    keeps them (the garbage collector off, as for the engines in between)."""
    def run(llm: LLM) -> list[weakref.ref]:
        assert kv_cache_bytes(llm) > 1 << 30
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        runner = llm.llm_engine.model_runner
        held = [runner.model, *runner.model.parameters(), runner.backend, runner.graph_runner, runner.input_batch]
        return [weakref.ref(x) for x in held if x is not None]

    def assert_freed(refs: list[weakref.ref]) -> None:
        assert [type(r()).__name__ for r in refs if r() is not None] == []

    before, _ = settled_memory()
    make_llm(qwen3_dir, backend, "bfloat16").close()  # lazy start-up costs (kernels, workspaces) before measuring
    allocated, _ = settled_memory()
    assert allocated - before < 4 * MIB  # no tensor of the first engine's stays (cuBLAS's workspaces included)
    gc.disable()  # reference counting alone gives it back
    try:
        llm = make_llm(qwen3_dir, backend, "bfloat16", enable_prompt_embeds=True)  # its runner holds the embedding
        refs = run(llm)
        del llm
        assert_freed(refs)
        assert settled_memory()[0] - allocated < 4 * MIB
        with make_llm(qwen3_dir, backend, "bfloat16") as llm:
            refs = run(llm)
        assert_freed(refs)  # closed, though still referenced
        assert settled_memory()[0] - allocated < 4 * MIB
        after = []
        for _ in range(10):
            with make_llm(qwen3_dir, backend, "bfloat16") as llm:
                refs = run(llm)
            assert_freed(refs)
            after.append(settled_memory())
    finally:
        gc.enable()
    assert max(a for a, _ in after) - allocated < 4 * MIB, after
    assert max(f for _, f in after) - min(f for _, f in after) < 64 * MIB, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_norm", [False, True], ids=["rotary", "qk-norm+rotary"])
@pytest.mark.parametrize("in_dtype", [False, True], ids=["fp32-rotation", "rounded-in-dtype"])
def test_rotary_kernel_matches_the_pytorch_code_it_replaces(dtype, with_norm, in_dtype):
    """At Qwen3-0.6B's q (16 heads x 128, out of the fused qkv rows) and 40,960 positions, rotating in fp32 or
    rounding as transformers' Llama does: without the norm, the same products and sums rounded at the same points
    (exact); with it, the norm's sum in another order."""
    from nanoinfer.kernels.triton_layers import rotary_neox
    from nanoinfer.layers.layernorm import RMSNorm
    from nanoinfer.layers.rotary_embedding import RotaryEmbedding
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        rope = RotaryEmbedding(128, 40960, 1.0 / 1e6 ** (torch.arange(0, 128, 2).float() / 128), in_dtype=in_dtype)
        norm = RMSNorm(128).to(dtype)
        norm.weight.data = torch.randn(128, generator=g, device="cuda").to(dtype)
        qkv = torch.randn(300, 32 * 128, generator=g, device="cuda").to(dtype)
        positions = torch.randint(0, 40960, (300,), generator=g, device="cuda")
    q = qkv[:, :16 * 128].view(300, 16, 128)
    ours = rotary_neox(q, positions, rope.cos, rope.sin, *((norm.weight, norm.eps) if with_norm else ()),
                       in_dtype=in_dtype)
    ref = rope._rotate(norm._norm(q) if with_norm else q, rope.cos[positions].unsqueeze(1),
                       rope.sin[positions].unsqueeze(1))
    if with_norm:
        # A normalized input rounded one ulp apart moves an output by up to an ulp of its head's largest value where
        # the rotation cancels (x1 cos - x2 sin near 0): bounded per head, not per element.
        ulp, ours, ref = 2e-6 if dtype == torch.float32 else 2**-7, ours.float(), ref.float()
        bound = ulp * (ref.abs() + ref.abs().amax(-1, keepdim=True))
        assert ((ours - ref).abs() <= bound).all(), ((ours - ref).abs() / bound).max()
    else:
        assert torch.equal(ours, ref)


def test_layer_kernels_address_rows_past_2_to_the_31_elements():
    """A long prefill step's rows reach past 2^31 elements (64k tokens x 2 x 16,384 of a gate+up projection): the
    rows at the end must be the kernels' results, not an int32 address wrapped back to the start."""
    from nanoinfer.kernels.triton_kvcache import store_kvcache
    from nanoinfer.kernels.triton_layers import rms_norm, silu_and_mul
    bf16, g, tail = torch.bfloat16, torch.Generator(device="cuda").manual_seed(0), slice(-3, None)

    n = 16384
    x = torch.randn(2**31 // (2 * n) + 2, 2 * n, generator=g, device="cuda", dtype=bf16)
    ref = x[tail].float()
    ref = (torch.nn.functional.silu(ref[:, :n]).to(bf16).float() * ref[:, n:]).to(bf16)
    torch.testing.assert_close(silu_and_mul(x)[tail], ref, rtol=2**-6, atol=1e-5)
    del x

    n = 8192
    x, residual = (torch.randn(2**31 // n + 2, n, generator=g, device="cuda", dtype=bf16) for _ in range(2))
    weight = torch.randn(n, generator=g, device="cuda", dtype=bf16)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    summed = x[tail] + residual[tail]
    ref = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(new_residual[tail], summed)
    torch.testing.assert_close(out[tail], (ref.to(bf16).float() * weight.float()).to(bf16), rtol=2**-6, atol=1e-5)
    del x, residual, out, new_residual

    heads, d = 8, 128  # k and v rows are slices of fused qkv rows 3 x 1,024 apart; the cache holds past 2^31 too
    qkv = torch.randn(2**31 // (3 * heads * d) + 2, 3, heads, d, generator=g, device="cuda", dtype=bf16)
    k_cache, v_cache = (torch.zeros(2**31 // (16 * heads * d) + 2, 16, heads, d, device="cuda", dtype=bf16)
                        for _ in range(2))
    slots = torch.full((qkv.shape[0],), -1, device="cuda")
    slots[tail] = torch.tensor([0, k_cache.shape[0] * 16 - 1, k_cache.shape[0] * 16 - 2], device="cuda")
    store_kvcache(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots)
    for cache, part in ((k_cache, 1), (v_cache, 2)):
        assert torch.equal(cache.view(-1, heads, d)[slots[tail]], qkv[tail, part])
        assert cache.view(-1, heads, d)[1:-2].count_nonzero() == 0  # nothing stored elsewhere


def test_more_tensor_parallel_ranks_than_gpus_is_a_value_error(qwen3_dir):
    with pytest.raises(ValueError, match=r"CUDA device\(s\) are visible"):
        LLM(str(qwen3_dir), device="cuda", tensor_parallel_size=torch.cuda.device_count() + 1)


# ---- every family against transformers (the longest part, last: a run cut short still has the checks above) ----

@pytest.mark.parametrize("kind", families(MODEL_KINDS + EXTRA_KINDS))
def test_fp32_matches_transformers(kind, backend, model_dir, captured_logits, report_logit_diff):
    d = model_dir(kind)
    with make_llm(d, backend, "float32") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        worst = check_against_hf(outputs, reference(d, torch.float32), captured_logits)
        report_logit_diff(f"{kind}, CUDA fp32, {backend}", worst)
    # A family that amplifies fp32 rounding (Gemma 4 E on the CPU) may pass the flat bound where the GPU's sums run
    # in other orders: then it is held to transformers' own rounding on this GPU (a real error shows at 1e-2).
    if worst >= FP32_LOGIT_ATOL:
        noise = hf_reordering_noise(hf_model(d, torch.float32), PROMPTS, MAX_TOKENS, reference(d, torch.float32))
        assert worst < 8 * noise, f"max |logit diff| {worst:.2e} (transformers' own {noise:.2e} on this GPU)"


# The recurrent and hybrid families without experts, which pass the same check on the CPU (test_bf16.py).
BF16_RECURRENT_DENSE_KINDS = ("mamba", "falcon-mamba", "lfm2", "bamba", "granitemoehybrid-dense", "falcon-h1",
                              "falcon-h1-norm", "qwen3.5")


@pytest.mark.parametrize("kind", families(MODEL_KINDS + ("mistral", "gemma3", "gemma2", "gemma", "phi3", "granite",
                                                         "smollm3", "olmo2", "olmo3", "glm4", "glm", "gemma4", "gemma3n")
                                          + LAYERNORM_KINDS + DENSE_KINDS + NEWEST_DENSE_KINDS
                                          + BF16_RECURRENT_DENSE_KINDS))
def test_bf16_matches_transformers_up_to_bf16_rounding(kind, backend, model_dir, captured_logits,
                                                       report_logit_diff):
    """Dense families (mixture-of-experts routing can flip between near-equal experts in bf16, which is not a
    near-tie of the output), recurrent ones included: transformers in bf16 on the same GPU is the reference (its
    torch path where mamba_ssm, causal-conv1d and fla are not installed, as on the CPU)."""
    d = model_dir(kind)
    with make_llm(d, backend, "bfloat16") as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        worst = check_bf16_outputs(outputs, PROMPTS, reference(d, torch.bfloat16), captured_logits,
                                   hf_model(d, torch.float32), hf_model(d, torch.bfloat16, "eager"))
        report_logit_diff(f"{kind}, CUDA bf16, {backend} (x transformers' own bf16 error)", worst)
