"""Triton kernels (store_kvcache, fused add + RMSNorm, SiLU-and-mul, rotary) run by Triton's interpreter on CPU tensors
against the PyTorch code they replace on CUDA, and the flash backend
driven end to end on the CPU (real Triton store kernel, flash-attn's contract emulated by cuda_fakes,
CUDA graphs emulated by RecordedGraph) against transformers. Every load and store an interpreted kernel makes in this
process (tests/triton_attention_interpreted.py's too) is checked to lie inside the tensors it was launched with, and
torch.empty returns NaN (tests/gpu_like_memory.py): what would fault, corrupt or read stale memory on a GPU fails
here. TRITON_INTERPRET=1 must be set before triton defines a kernel,
so tests/test_triton.py runs this file in a pytest process of its own."""
import os
import sys

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.exit("run through tests/test_triton.py (needs TRITON_INTERPRET=1 from the start)", returncode=4)

import cuda_fakes  # noqa: E402  (tests/cuda_fakes.py)
import gpu_like_memory  # noqa: E402  (tests/gpu_like_memory.py)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from models import check_against_hf, hf_greedy, random_prompts  # noqa: E402

import nanoinfer.config as config_module  # noqa: E402
from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.engine.input_batch import InputBatch  # noqa: E402
from nanoinfer.engine.model_runner import ModelRunner  # noqa: E402
from nanoinfer.engine.scheduler import ScheduledBatch  # noqa: E402
from nanoinfer.engine.sequence import Sequence  # noqa: E402
from nanoinfer.kernels.triton_kvcache import store_kvcache  # noqa: E402
from nanoinfer.kernels.triton_layers import rms_norm, rotary_neox, silu_and_mul  # noqa: E402
from nanoinfer.layers.activation import SiluAndMul  # noqa: E402
from nanoinfer.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from nanoinfer.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from nanoinfer.layers.attention import get_backend, selector  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _index_scalars_with_numpy_2_4() -> None:
    """Triton 3.6's interpreter (a GPU machine's torch 2.11 pins it) holds every scalar as an array of shape (1,)
    and turns a loop bound into an int with int(array), which recent NumPy (2.4 here) refuses: there, apply the fix
    triton 3.7 made (squeeze first), so that the attention kernel's loop over K/V tiles runs."""
    from triton.runtime import interpreter
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    interpreter._patch_lang_tensor = patched


if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
    _index_scalars_with_numpy_2_4()




def _round_bf16_casts_to_nearest() -> None:
    """Triton's interpreter casts fp32 to bf16 by dropping the low bits; compiled Triton, as torch, rounds to nearest
    even: here the casts round as on a GPU, so that the kernels' bf16 results can be compared bit for bit."""
    from triton.runtime import interpreter
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


_round_bf16_casts_to_nearest()
gpu_like_memory.check_memory_bounds()
gpu_like_memory.poison_empty()


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n), mask=offsets < n)


def test_an_access_outside_the_kernels_tensors_fails():
    """The bounds check (tests/gpu_like_memory.py), on a copy of n elements: lanes masked off may point anywhere; an
    active one past the source (its storage's next element, outside the view passed) or past the destination fails
    the launch."""
    storage, dst = torch.arange(12.0), torch.zeros(6)
    _copy_kernel[(1,)](storage[2:8], dst, 6, BLOCK=16)
    assert dst.tolist() == storage[2:8].tolist()
    with pytest.raises(Exception, match=r"_copy_kernel loads 1 addresses outside its tensors"):
        _copy_kernel[(1,)](storage[2:8], torch.zeros(8), 7, BLOCK=16)
    with pytest.raises(Exception, match=r"_copy_kernel stores 2 addresses outside its tensors"):
        _copy_kernel[(1,)](storage, dst, 8, BLOCK=16)


def test_empty_memory_is_poisoned_here():
    """What this process's kernels and engines see of memory nothing wrote (tests/gpu_like_memory.py)."""
    assert torch.empty(3).isnan().all() and torch.empty_like(torch.ones(2, dtype=torch.bfloat16)).isnan().all()
    assert torch.ones(2, dtype=torch.int32).new_empty(4).eq(torch.iinfo(torch.int32).max // 3).all()
    assert torch.empty_strided((2, 3), (1, 2)).isnan().all()
    assert torch.empty(2, device="meta").is_meta and torch.empty(2, dtype=torch.bool).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads, head_dim, block_size", [
    (1, 64, 16),    # one KV head
    (3, 40, 4),     # odd head count, row width 120 (not a power of two: masked lanes)
    (5, 24, 1),     # block size 1: every slot is its own block
    (2, 128, 256),  # flash-attn's page size
])
def test_store_kvcache_matches_index_copy(dtype, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(kv_heads * 1000 + block_size)
    tokens, q_heads = 13, 2 * kv_heads
    num_blocks = -(-2 * tokens // block_size) + 1
    # k and v as the model hands them over: row-strided views into one fused qkv projection.
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[1], slots[2] = block_size - 1, block_size  # the two sides of a block boundary
    slots[0] = slots[6] = slots[-1] = -1  # padded rows: first, middle, last
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    ref_k.view(-1, kv_heads, head_dim)[slots[real]] = k[real]
    ref_v.view(-1, kv_heads, head_dim)[slots[real]] = v[real]
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # a copy: exact, and -1 rows untouched


def test_store_kvcache_all_padding_and_empty():
    k_cache = torch.randn(2, 4, 3, 8)
    before = k_cache.clone()
    k = torch.randn(5, 3, 8)
    store_kvcache(k, k, k_cache, k_cache, torch.full((5,), -1))
    store_kvcache(k[:0], k[:0], k_cache, k_cache, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


# fp32 differs from PyTorch only in summation order; 16 bits by at most one rounding of the output.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2**-7}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (5, 100), (3, 4, 40), (1, 1000)], ids=str)  # odd widths, per-head norm
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm], ids=lambda c: c.__name__)
def test_rms_norm_matches_the_torch_layer(dtype, shape, with_residual, norm):
    """Gemma's: an fp32 (1 + w) applied in fp32 on 16-bit activations, rounded once, not as Llama's."""
    g = torch.Generator().manual_seed(shape[-1])
    layer = norm(shape[-1], eps=1e-5)
    weight_dtype = torch.float32 if norm is GemmaRMSNorm else dtype
    layer.weight.data = torch.randn(shape[-1], generator=g).to(weight_dtype)
    wide = torch.randn(*shape[:-1], shape[-1] + 24, generator=g).to(dtype)
    x = wide[..., 24:]  # a strided view, like q out of the fused qkv projection
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    ours, ref = rms_norm(x, layer.weight, layer.eps, residual), layer(x, residual)  # CPU tensors: torch path
    if with_residual:
        assert torch.equal(ours[1], ref[1])  # the residual stream: one rounding of x + residual, exact
        ours, ref = ours[0], ref[0]
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == dtype
    err = ((ours.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    assert err < TOLERANCE[dtype], f"max relative error {err:.2e}"
    if norm is GemmaRMSNorm and dtype != torch.float32:  # one rounding fewer than Llama's: ~1/3 of them differ
        assert (ours == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(6, 2 * 64), (3, 2 * 100), (2, 2 * 2500), (2, 3, 2 * 48)], ids=str)
def test_silu_and_mul_matches_the_torch_layer(dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 4).to(dtype)
    ours, ref = silu_and_mul(x), SiluAndMul()(x)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == dtype
    err = ((ours.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    assert err < TOLERANCE[dtype], f"max relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim, rotary_dim", [
    (2, 128, 128),  # Qwen3's heads
    (3, 80, 80),    # odd head count, half 40 (masked lanes)
    (17, 32, 32),   # more heads than one program's 16: two head blocks
    (4, 96, 24),    # partial rotary: 72 dims pass through
], ids=str)
@pytest.mark.parametrize("with_norm", [False, True], ids=["rotary", "qk-norm+rotary"])
@pytest.mark.parametrize("in_dtype", [False, True], ids=["fp32-rotation", "rounded-in-dtype"])
def test_rotary_matches_the_torch_layers(dtype, heads, head_dim, rotary_dim, with_norm, in_dtype):
    """Against the PyTorch code it replaces on CUDA (RMSNorm._norm, then RotaryEmbedding._rotate), rotating in fp32
    or rounding as transformers' Llama does."""
    g = torch.Generator().manual_seed(heads * head_dim + rotary_dim)
    rope = RotaryEmbedding(head_dim, 100, 1.0 / 1e4 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim),
                           in_dtype=in_dtype)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 6) * head_dim, generator=g).to(dtype)
    x = qkv[:, 2 * head_dim:(2 + heads) * head_dim].view(tokens, heads, head_dim)  # strided rows, as q in qkv
    positions = torch.randint(0, 100, (tokens,), generator=g)
    positions[0], positions[-1] = 0, 99
    norm = RMSNorm(head_dim, eps=1e-6)
    norm.weight.data = torch.randn(head_dim, generator=g).to(dtype)
    ours = rotary_neox(x, positions, rope.cos, rope.sin, *((norm.weight, norm.eps) if with_norm else ()),
                       in_dtype=in_dtype)
    ref = rope._rotate(norm._norm(x) if with_norm else x, rope.cos[positions].unsqueeze(1),
                       rope.sin[positions].unsqueeze(1))
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == dtype and ours.is_contiguous()
    if not with_norm:  # the same products and sums, each rounded at the same points: exact
        assert torch.equal(ours, ref)
    err = ((ours.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    assert err < TOLERANCE[dtype], f"max relative error {err:.2e}"


def test_empty_batches():
    w = torch.ones(8)
    assert rms_norm(torch.zeros(0, 8), w, 1e-6).shape == (0, 8)
    assert silu_and_mul(torch.zeros(0, 16)).shape == (0, 8)
    table = torch.zeros(4, 4)
    assert rotary_neox(torch.zeros(0, 2, 8), torch.zeros(0, dtype=torch.int64), table, table).shape == (0, 2, 8)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """The flash backend on the CPU: fake flash_attn, fp32 allowed (to compare with transformers to 1e-4)."""
    monkeypatch.setitem(sys.modules, "flash_attn", cuda_fakes)
    monkeypatch.setattr(config_module, "select_backend", lambda requested, device, **flags: requested)
    monkeypatch.setattr(selector, "FLASH_DTYPES", (*selector.FLASH_DTYPES, torch.float32))
    cuda_fakes.calls.clear()
    return cuda_fakes.calls


MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_flash_backend_matches_hf(graphs, qwen3_dir, flash_on_cpu, captured_logits, report_logit_diff):
    # Three prompts share a 300-token prefix (one full 256-token page), two short ones, a one-token one.
    shared = random_prompts(1, 5, 440, 300, 300, seed=11)[0]
    prompts = ([shared + tail for tail in random_prompts(3, 5, 440, 1, 40, seed=12)]
               + random_prompts(2, 5, 440, 2, 90, seed=13) + [[17]])
    # A 400-token budget chunks the long prompts: later chunks attend to pages stored by earlier steps.
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", attention_backend="flash", max_model_len=512,
              max_num_seqs=8, max_num_batched_tokens=400)
    assert llm.llm_engine.config.kvcache_block_size == 256
    runner = llm.llm_engine.model_runner
    assert type(runner.backend).__name__ == "FlashAttentionBackend"
    assert runner.graph_runner is None  # a CPU device: no CUDA graphs
    if graphs:
        cuda_fakes.capture_recorded_graphs(runner)
        assert sorted(runner.graph_runner.graphs) == [1, 2, 4, 8]
    # Short prompts alone first: no cached prefix, so prefill attends to this step's k, v directly.
    outputs = llm.generate(prompts[3:], GREEDY, use_tqdm=False)
    outputs += llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs][-2:] == [256, 256]  # prefix-cache hits within the step
    refs = hf_greedy(qwen3_dir, prompts[3:] + prompts[:3], MAX_TOKENS)
    worst = check_against_hf(outputs, refs, captured_logits)
    name = f"qwen3, flash backend on CPU ({'CUDA-graph runner' if graphs else 'eager'})"
    report_logit_diff(name, worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"
    kinds = {(c["fn"], c["paged"]) for c in flash_on_cpu}
    assert kinds == {("varlen", False), ("varlen", True), ("kvcache", True)}, kinds
    # Decode batches of 3 run padded to the graph of 4: the kv-cache calls saw 4 rows only with graphs.
    decode_batches = {c["batch"] for c in flash_on_cpu if c["fn"] == "kvcache" and c["batch"] in (3, 4)}
    assert decode_batches == ({4} if graphs else {3}), decode_batches


def test_flash_backend_with_ngram_drafts_matches_hf(qwen3_dir, flash_on_cpu):
    """Speculative decoding through the flash backend and the CUDA-graph runner: steps verifying drafts run the
    paged varlen kernel eagerly, steps without drafts replay the decode graphs; the greedy tokens are transformers'."""
    prompt = random_prompts(40, 5, 440, 2, 24, seed=11)[15]  # a prompt whose greedy output loops
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", attention_backend="flash", max_model_len=512,
              max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    cuda_fakes.capture_recorded_graphs(llm.llm_engine.model_runner)
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    check_against_hf(outputs, hf_greedy(qwen3_dir, [prompt], MAX_TOKENS))
    assert llm.llm_engine.spec_decode_stats.num_accepted_tokens > 0
    assert {("varlen", True), ("kvcache", True)} <= {(c["fn"], c["paged"]) for c in flash_on_cpu}


def _seq(num_tokens: int, computed: int, table: list[int]) -> Sequence:
    seq = Sequence(list(range(num_tokens)), SamplingParams(), 256)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def backends_on_the_same_metadata(names: tuple[str, ...], batch: ScheduledBatch, block_size: int, num_blocks: int,
                                  window: int | None = None, soft_cap: float | None = None,
                                  alibi_slopes: torch.Tensor | None = None
                                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ModelRunner.prepare's metadata for `batch` fed to each backend on the same q, k, v (6 q / 2 KV heads, dim
    32) and the same stale caches: (output, k_cache, v_cache) per backend, the caches after its store."""
    runner = object.__new__(ModelRunner)  # prepare needs only its input batch and the number of state slots
    runner.num_state_slots = 0
    runner.input_batch = InputBatch(8, 1024, 1024, block_size, torch.device("cpu"))
    _, _, meta, _ = runner.prepare(batch, batch.samples)
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 6, 2, 32, meta.slot_mapping.numel()
    q = torch.randn(tokens, heads, dim, generator=g)
    k, v = torch.randn(2, tokens, kv_heads, dim, generator=g)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)  # stand-ins for earlier steps
    outs = []
    for name in names:
        backend = get_backend(name, torch.float32)
        k_cache, v_cache = caches.clone()
        backend.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        backend.prepare(meta)
        outs.append((backend.forward(q, k, v, k_cache, v_cache, meta, dim ** -0.5, window, soft_cap,
                                     alibi_slopes=alibi_slopes), k_cache, v_cache))
    return outs


@pytest.mark.parametrize("kind", ["prefix-and-chunk", "fresh", "decode"])
def test_flash_backend_equals_cpu_backend_on_the_same_metadata(kind, flash_on_cpu):
    """One metadata, built by ModelRunner.prepare, fed to both backends: same caches, same outputs."""
    batches = {
        # 300 tokens with 256 cached; a chunk (tokens 256..299 of 700) after a first one; a fresh 37-token prompt.
        "prefix-and-chunk": ScheduledBatch([_seq(300, 256, [4, 1]), _seq(700, 256, [0, 3, 5]), _seq(37, 0, [2])],
                                           [44, 44, 37]),
        "fresh": ScheduledBatch([_seq(5, 0, [1]), _seq(260, 0, [0, 3])], [5, 260]),
        "decode": ScheduledBatch([_seq(257, 256, [2, 5]), _seq(9, 8, [0]), _seq(600, 599, [1, 3, 4])], [1, 1, 1]),
    }
    (flash, fk, fv), (cpu, ck, cv) = backends_on_the_same_metadata(("flash", "cpu"), batches[kind], 256, 6)
    assert torch.equal(fk, ck) and torch.equal(fv, cv)
    assert flash.shape == cpu.shape and flash.shape[1] == 6 * 32
    err = (flash - cpu).abs().max().item()
    assert err < 1e-5, f"max |flash - cpu| = {err:.2e}"
    expected = {"prefix-and-chunk": ("varlen", True), "fresh": ("varlen", False), "decode": ("kvcache", True)}[kind]
    assert [(c["fn"], c["paged"]) for c in flash_on_cpu] == [expected]
