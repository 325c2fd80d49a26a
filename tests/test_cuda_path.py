"""The CUDA path's CPU-checkable parts: imports without CUDA/triton/flash-attn, device and backend choice,
flash-attn's limits, the metadata every backend receives, CUDA-graph bookkeeping, GPU KV-cache sizing."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cuda_fakes import EagerGraph
from nanoinfer.config import Config
from nanoinfer.engine import cuda_graph
from nanoinfer.engine.cuda_graph import CUDAGraphRunner, capture_sizes, pad_decode_inputs, padded_size
from nanoinfer.engine.gpu_memory import kv_cache_blocks_for_gpu
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention import selector
from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_imports_and_the_cpu_path_runs_without_cuda_triton_or_flash_attn(qwen3_dir):
    """In a fresh process where `import triton` / `import flash_attn` fail as if not installed."""
    code = textwrap.dedent("""
        import importlib, json, pkgutil, sys
        sys.modules["triton"] = sys.modules["flash_attn"] = None  # import raises, find_spec says absent
        import torch
        torch.cuda.is_available = lambda: False
        import nanoinfer
        from nanoinfer import LLM, SamplingParams
        imported, failed = [], {}
        for m in pkgutil.walk_packages(nanoinfer.__path__, "nanoinfer."):
            try:
                importlib.import_module(m.name)
                imported.append(m.name)
            except ImportError as e:
                failed[m.name] = str(e)
        out = LLM(sys.argv[1], max_model_len=64).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4),
                                                          use_tqdm=False)[0]
        from nanoinfer.kernels.cuda import triton_layers
        print(json.dumps(dict(imported=imported, failed=failed, tokens=out.outputs[0].token_ids,
                              cuda_layer_kernels=triton_layers() is not None)))
    """)
    r = subprocess.run([sys.executable, "-c", code, str(qwen3_dir)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    # Only Triton source in nanoinfer/kernels/ needs triton to import; everything else imports it lazily.
    assert set(result["failed"]) == {"nanoinfer.kernels.triton_kvcache", "nanoinfer.kernels.triton_layers",
                                     "nanoinfer.kernels.triton_sampling"}, \
        result["failed"]
    assert all("triton" in error for error in result["failed"].values())
    assert not result["cuda_layer_kernels"]  # CUDA tensors would stay on the PyTorch layers
    for name in ("nanoinfer.layers.attention.flash", "nanoinfer.kernels.cuda", "nanoinfer.engine.cuda_graph", "nanoinfer.engine.gpu_memory",
                 "nanoinfer.layers.attention.selector", "nanoinfer.engine.model_runner", "nanoinfer.llm"):
        assert name in result["imported"]
    assert len(result["tokens"]) == 4


# ---- device and backend choice ----

def test_device_resolution_on_a_machine_without_cuda():
    assert selector.resolve_device("auto") == torch.device("cpu")
    assert selector.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        selector.resolve_device("cuda")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        selector.resolve_device("meta")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        selector.resolve_device("gpu0")


def test_backend_choice_without_cuda():
    cpu = torch.device("cpu")
    assert selector.select_backend("auto", cpu) == "cpu"
    assert selector.select_backend("cpu", cpu) == "cpu"
    with pytest.raises(ValueError, match="'flash' needs a CUDA device"):
        selector.select_backend("flash", cpu)
    with pytest.raises(ValueError, match="unknown attention_backend 'xformers'"):
        selector.select_backend("xformers", cpu)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA machine as far as start-up decisions go (nothing here touches a CUDA tensor)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    def flash(installed: bool) -> None:
        monkeypatch.setattr(selector, "flash_attn_available", lambda: installed)
    flash(True)
    return flash


def test_backend_choice_on_cuda(fake_cuda, monkeypatch):
    gpu = torch.device("cuda", 0)
    assert selector.resolve_device("auto") == gpu
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second process takes the second GPU
    assert selector.resolve_device("cuda") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        selector.resolve_device("cuda:2")
    assert selector.select_backend("auto", gpu) == "flash"
    assert selector.select_backend("flash", gpu) == "flash"
    assert selector.select_backend("cpu", gpu) == "cpu"
    fake_cuda(False)
    with pytest.warns(UserWarning, match="falls back to the PyTorch SDPA backend"):
        assert selector.select_backend("auto", gpu) == "cpu"
    with pytest.raises(ValueError, match=r"pip install 'nanoinfer\[cuda\]'"):
        selector.select_backend("flash", gpu)


def test_flash_limits():
    selector.check_backend_limits("flash", 256, torch.bfloat16, 128)
    selector.check_backend_limits("flash", 512, torch.float16, 256)
    selector.check_backend_limits("cpu", 16, torch.float32, 512)
    with pytest.raises(ValueError, match="kvcache_block_size=16 .* multiple of 256"):
        selector.check_backend_limits("flash", 16, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="kvcache_block_size=384"):
        selector.check_backend_limits("flash", 384, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        selector.check_backend_limits("flash", 256, torch.float32, 128)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        selector.check_backend_limits("flash", 256, torch.bfloat16, 512)


def test_config_on_cuda_defaults_and_errors(fake_cuda, qwen3_dir):
    c = Config(qwen3_dir)
    assert (c.torch_device, c.attention_backend, c.kvcache_block_size) == (torch.device("cuda", 0), "flash", 256)
    assert c.torch_dtype == torch.bfloat16  # the checkpoint is fp32: 16-bit on the GPU
    assert (c.enforce_eager, c.gpu_memory_utilization) == (False, 0.9)
    assert Config(qwen3_dir, kvcache_block_size=512).kvcache_block_size == 512
    with pytest.raises(ValueError, match="kvcache_block_size=16 is not valid for the flash backend"):
        Config(qwen3_dir, kvcache_block_size=16)
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        Config(qwen3_dir, dtype="float32")
    sdpa = Config(qwen3_dir, attention_backend="cpu", dtype="float32")
    assert (sdpa.attention_backend, sdpa.kvcache_block_size, sdpa.torch_dtype) == ("cpu", 16, torch.float32)
    fake_cuda(False)
    with pytest.warns(UserWarning, match="flash-attn is not installed"):
        c = Config(qwen3_dir)
    assert (c.attention_backend, c.kvcache_block_size) == ("cpu", 16)


def test_config_on_cpu_and_new_argument_errors(qwen3_dir):
    c = Config(qwen3_dir)
    assert (c.torch_device, c.attention_backend, c.kvcache_block_size, c.torch_dtype) == (
        torch.device("cpu"), "cpu", 16, torch.float32)
    for kwargs, error, match in [
        (dict(attention_backend="flash"), ValueError, "needs a CUDA device"),
        (dict(attention_backend="triton"), ValueError, "unknown attention_backend"),
        (dict(device="cuda"), ValueError, "sees no CUDA device"),
        (dict(device="mps"), ValueError, "unsupported device"),
        (dict(device="npu0"), ValueError, "unknown device"),
        (dict(enforce_eager="yes"), TypeError, "enforce_eager must be a bool"),
        (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization="0.9"), TypeError, "gpu_memory_utilization must be a number"),
    ]:
        with pytest.raises(error, match=match):
            Config(qwen3_dir, **kwargs)


# ---- the metadata every backend receives ----

def _seq(num_tokens: int, computed: int, table: list[int], block_size: int) -> Sequence:
    seq = Sequence(list(range(100, 100 + num_tokens)), SamplingParams(), block_size)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def _prepare(batch: ScheduledBatch, block_size: int):
    runner = object.__new__(ModelRunner)  # prepare needs only the block size and the number of state slots
    runner.block_size, runner.num_state_slots = block_size, 0
    return runner.prepare(batch, batch.samples)


def test_metadata_for_cached_prefix_chunked_prefill_and_fresh_prompt():
    a = _seq(10, 8, [7, 3, 9], 4)    # 8 tokens from the prefix cache, the last 2 computed now
    b = _seq(11, 4, [5, 0, 2], 4)    # a chunk: tokens 4..8 of 11 (first chunk done before), not sampled
    c = _seq(3, 0, [6], 4)           # a fresh prompt
    input_ids, positions, meta, sample_rows = _prepare(ScheduledBatch([a, b, c], [2, 5, 3]), 4)
    assert input_ids.tolist() == [108, 109, 104, 105, 106, 107, 108, 100, 101, 102]
    assert positions.tolist() == [8, 9, 4, 5, 6, 7, 8, 0, 1, 2]
    # slot = block_table[pos // 4] * 4 + pos % 4: a's block 9, b's blocks 0 then 2, c's block 6.
    assert meta.slot_mapping.tolist() == [36, 37, 0, 1, 2, 3, 8, 24, 25, 26]
    assert meta.block_tables.tolist() == [[7, 3, 9], [5, 0, 2], [6, -1, -1]]
    assert meta.context_lens.tolist() == [10, 9, 3]     # flash-attn's cache_seqlens
    assert meta.cu_seqlens_q.tolist() == [0, 2, 7, 10]
    assert meta.cu_seqlens_k.tolist() == [0, 10, 19, 22]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size) == (5, 10, 4)
    assert meta.has_cached_prefix and not meta.is_decode
    assert [t.dtype for t in (meta.block_tables, meta.context_lens, meta.cu_seqlens_q, meta.cu_seqlens_k)] == \
        [torch.int32] * 4
    assert sample_rows == [1, 9]  # a's and c's last rows; b's chunk does not reach its end


def test_metadata_for_decode_and_fresh_prefill():
    a, b = _seq(17, 16, [4, 1, 8, 0, 7], 4), _seq(5, 4, [2, 3], 4)
    _, positions, meta, rows = _prepare(ScheduledBatch([a, b], [1, 1]), 4)
    assert positions.tolist() == [16, 4]
    assert meta.slot_mapping.tolist() == [7 * 4 + 0, 3 * 4 + 0]  # both open a new block
    assert meta.block_tables.tolist() == [[4, 1, 8, 0, 7], [2, 3, -1, -1, -1]]
    assert meta.context_lens.tolist() == [17, 5] and meta.cu_seqlens_k.tolist() == [0, 17, 22]
    assert meta.is_decode and meta.has_cached_prefix and rows == [0, 1]
    _, _, meta, _ = _prepare(ScheduledBatch([_seq(6, 0, [1, 2], 4), _seq(2, 0, [0], 4)], [6, 2]), 4)
    assert not meta.has_cached_prefix and meta.cu_seqlens_k.tolist() == meta.cu_seqlens_q.tolist() == [0, 6, 8]


def test_metadata_to_cpu_is_the_same_object():
    _, _, meta, _ = _prepare(ScheduledBatch([_seq(3, 0, [0], 4)], [3]), 4)
    assert meta.to(torch.device("cpu")) is meta


# ---- CUDA-graph bookkeeping ----

def test_capture_sizes_and_padding_choice():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(10_000)[-1] == 512
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 16, 20, 20,
                                                                                    None]


def _decode_meta(context_lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32), context_lens=ctx,
        cu_seqlens_q=torch.arange(len(ctx) + 1, dtype=torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=max(context_lens), block_size=4)


def test_pad_decode_inputs():
    meta = _decode_meta([5, 9, 2], [[3, 1, -1], [0, 2, 6], [4, -1, -1]], [4, 24, 17])
    p = pad_decode_inputs(torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1]), meta, size=4, width=5)
    assert p.input_ids.tolist() == [11, 12, 13, 0]
    assert p.positions.tolist() == [4, 8, 1, 0]
    assert p.slot_mapping.tolist() == [4, 24, 17, -1]
    assert p.context_lens.tolist() == [5, 9, 2, 0]
    assert p.block_tables.tolist() == [[3, 1, -1, -1, -1], [0, 2, 6, -1, -1], [4, -1, -1, -1, -1], [-1] * 5]
    assert (p.slot_mapping.dtype, p.context_lens.dtype, p.block_tables.dtype) == (torch.int64, torch.int32,
                                                                                  torch.int32)


class EchoModel(torch.nn.Module):
    """Hidden state = what the step read: ids, positions, context length, slot, and its block table's real
    entries (count * 1000 + sum: the -1 padding of a wider table does not change it)."""

    def forward(self, input_ids, positions, meta):
        real = meta.block_tables >= 0
        blocks = real.sum(1) * 1000 + meta.block_tables.clamp_min(0).sum(1)
        return torch.stack([input_ids, positions, meta.context_lens.long(), meta.slot_mapping, blocks], 1).float()


class NoBackend:
    def prepare(self, meta):
        pass


def test_graph_runner_pads_replays_and_slices(monkeypatch):
    monkeypatch.setattr(cuda_graph, "CUDAGraph", EagerGraph)
    runner = CUDAGraphRunner(EchoModel(), NoBackend(), max_num_seqs=8, max_model_len=20, block_size=4,
                             hidden_size=5, dtype=torch.float32, device=torch.device("cpu"))
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8] and runner.width == 5
    for ctx, tables, slots in [([5, 9, 2], [[3, 1], [0, 2], [4, -1]], [4, 24, 17]),   # 3 -> graph of 4
                               ([7], [[2, 5]], [21]),                                   # 1 -> graph of 1
                               ([1] * 5, [[i] for i in range(5)], list(range(0, 20, 4)))]:  # 5 -> 8
        n = len(ctx)
        ids, pos = torch.arange(50, 50 + n), torch.tensor(ctx) - 1
        meta = _decode_meta(ctx, tables, slots)
        out = runner.run(ids, pos, meta)
        assert torch.equal(out, EchoModel()(ids, pos, meta))  # real rows, sliced from the padded batch
        size = padded_size(n, runner.sizes)
        pad_row = [0, 0, 0, -1, 0]  # padding: token 0, position 0, no context, no slot, no blocks
        assert runner.outputs[n:size].tolist() == [pad_row] * (size - n)
    too_many = _decode_meta([1] * 9, [[0]] * 9, list(range(9)))
    assert runner.run(torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), too_many) is None


# ---- KV cache sizing on the GPU ----

def test_kv_cache_blocks_for_gpu():
    gib = 1 << 30
    # 80 GiB GPU at 90%: 20 GiB in use after the warm-up (weights + allocator cache), whose peak sat 6 GiB above
    # what is allocated now -> 72 - 20 - 6 = 46 GiB for blocks of 64 MiB.
    assert kv_cache_blocks_for_gpu(80 * gib, 60 * gib, 16 * gib, 10 * gib, 0.9, 64 << 20) == 46 * 16
    assert kv_cache_blocks_for_gpu(10 * gib, 1 * gib, 2 * gib, 1 * gib, 0.9, 1 << 20) == 0  # over budget: none
