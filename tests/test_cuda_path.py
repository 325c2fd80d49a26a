"""The CUDA path's CPU-checkable parts: imports without CUDA/triton/flash-attn, device and backend choice,
flash-attn's limits, the metadata every backend receives, CUDA-graph bookkeeping, GPU KV-cache sizing."""
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from cuda_fakes import RecordedGraph, kernel
from nanoinfer.config import Config
from nanoinfer import LLM
from nanoinfer.engine import cuda_graph
from nanoinfer.engine.cuda_graph import CUDAGraphRunner, capture_sizes, padded_size
from nanoinfer.engine.gpu_memory import kv_cache_blocks_for_gpu, profile_kv_cache_blocks, state_bytes_for_gpu
from nanoinfer.engine.input_batch import InputBatch
from nanoinfer.engine.model_runner import ModelRunner, warm_up_lengths
from nanoinfer.engine.parallel import TPGroup
from nanoinfer.engine.sampling_state import HostStaging
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention import Attention, selector
from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.layers.layernorm import GemmaRMSNorm
from nanoinfer.layers.recurrent import RecurrentLayer
from nanoinfer.layers.sampler import Sampler
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
        llm = LLM(sys.argv[1], max_model_len=64, device="cpu")
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
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
                                     "nanoinfer.kernels.triton_sampling", "nanoinfer.kernels.triton_attention"}, \
        result["failed"]
    assert all("triton" in error for error in result["failed"].values())
    assert not result["cuda_layer_kernels"]  # CUDA tensors would stay on the PyTorch layers
    for name in ("nanoinfer.layers.attention.flash", "nanoinfer.layers.attention.triton", "nanoinfer.kernels.cuda",
                 "nanoinfer.engine.cuda_graph", "nanoinfer.engine.gpu_memory",
                 "nanoinfer.layers.attention.selector", "nanoinfer.engine.model_runner", "nanoinfer.llm"):
        assert name in result["imported"]
    assert len(result["tokens"]) == 4


# ---- device and backend choice ----

@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, even where tests run on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_device_resolution_on_a_machine_without_cuda(no_cuda):
    assert selector.resolve_device("auto") == torch.device("cpu")
    assert selector.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        selector.resolve_device("cuda")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        selector.resolve_device("meta")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        selector.resolve_device("gpu0")


def test_backend_choice_without_cuda(no_cuda):
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
    assert selector.select_backend("triton", gpu) == "triton"
    fake_cuda(False)
    assert selector.select_backend("auto", gpu) == "triton"  # the Triton kernels, not the PyTorch fallback
    with pytest.raises(ValueError, match=r"pip install 'nanoinfer\[cuda\]'"):
        selector.select_backend("flash", gpu)
    monkeypatch.setattr(selector, "triton_available", lambda: False)
    for requested in ("auto", "triton"):
        with pytest.raises(ValueError, match="needs triton: pip install triton"):
            selector.select_backend(requested, gpu)


def test_auto_takes_the_pytorch_backend_for_heads_wider_than_flash_and_triton_take(fake_cuda, capsys):
    gpu = torch.device("cuda", 0)
    capsys.readouterr()
    for installed in (True, False):
        fake_cuda(installed)
        assert selector.select_backend("auto", gpu, head_dim=256) == ("flash" if installed else "triton")
        assert selector.select_backend("auto", gpu, head_dim=512) == "triton"  # wider than flash-attn takes
        assert selector.select_backend("auto", gpu, head_dim=640) == "cpu"
        assert selector.select_backend("triton", gpu, head_dim=640) == "triton"  # refused by check_backend_limits
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("INFO ") and line.endswith(
        "[nanoinfer.layers.attention.selector] attention: the model's heads of 640 are wider than the flash and "
        "triton backends take (triton: 512 at most); using the PyTorch backend (attention_backend='cpu')")
        for line in lines), lines
    assert selector.select_backend("auto", gpu, latent_cache=True, head_dim=576) == "triton"  # MLA: its own limits


def test_gemma4_with_the_hubs_512_wide_full_layers_on_cuda(fake_cuda, model_dir, tmp_path):
    """Real Gemma 4 checkpoints' full layers have heads of 512 (global_head_dim): 'auto' runs them on the Triton
    backend, flash-attn installed or not (it stops at 256; asking for it is refused by name). Heads wider than
    the Triton kernels take get the PyTorch backend, with its block size; asking for triton is refused."""
    def with_global_head_dim(width: int) -> Path:
        d = tmp_path / str(width)
        shutil.copytree(model_dir("gemma4"), d)
        cfg = json.loads((d / "config.json").read_text())
        del cfg["per_layer_config"]  # as on the Hub: transformers derives it from global_head_dim
        (d / "config.json").write_text(json.dumps({**cfg, "global_head_dim": width}))
        return d

    gemma4, wider = with_global_head_dim(512), with_global_head_dim(640)
    for installed in (True, False):
        fake_cuda(installed)
        c = Config(gemma4)
        assert (c.attention_backend, c.kvcache_block_size, c.torch_dtype) == ("triton", 16, torch.bfloat16)
        c = Config(wider)
        assert (c.attention_backend, c.kvcache_block_size, c.torch_dtype) == ("cpu", 16, torch.bfloat16)
    with pytest.raises(ValueError, match="triton attention backend supports head_dim <= 512, the model has 640"):
        Config(wider, attention_backend="triton")
    fake_cuda(True)
    with pytest.raises(ValueError, match="flash-attn supports head_dim <= 256, the model has 512"):
        Config(gemma4, attention_backend="flash")


def test_llama4_chunked_attention_never_takes_flash(fake_cuda, model_dir):
    """flash-attn 2 has no chunked local attention: 'auto' runs Llama 4 on the Triton backend even with flash-attn
    installed, and asking for flash is refused by name, on CUDA as on the CPU."""
    d = model_dir("llama4")
    c = Config(d)
    assert (c.attention_backend, c.kvcache_block_size) == ("triton", 16)
    for device in ("auto", "cpu"):
        with pytest.raises(ValueError, match="attention_backend='flash' cannot run this model: its attention is "
                                             "chunked"):
            Config(d, device=device, attention_backend="flash")
    assert Config(model_dir("llama")).attention_backend == "flash"


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
    c = Config(qwen3_dir)
    assert (c.attention_backend, c.kvcache_block_size) == ("triton", 16)


def test_config_on_cpu_and_new_argument_errors(no_cuda, qwen3_dir):
    c = Config(qwen3_dir)
    assert (c.torch_device, c.attention_backend, c.kvcache_block_size, c.torch_dtype) == (
        torch.device("cpu"), "cpu", 16, torch.float32)
    for kwargs, error, match in [
        (dict(attention_backend="flash"), ValueError, "needs a CUDA device"),
        (dict(attention_backend="triton"), ValueError, "runs only in Triton's interpreter"),
        (dict(attention_backend="xformers"), ValueError, "unknown attention_backend"),
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
    runner = object.__new__(ModelRunner)  # prepare needs only its input batch and the number of state slots
    runner.num_state_slots = 0
    runner.input_batch = InputBatch(8, 64, 64, block_size, torch.device("cpu"))
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


def test_decode_inputs_are_padded_in_the_staging_buffers():
    batch = InputBatch(8, 20, 16, 4, torch.device("cpu"))
    batch.np["input_ids"][:] = batch.np["slot_mapping"][:] = batch.np["block_tables"][:] = 99  # an earlier step
    meta = _decode_meta([5, 9, 2], [[3, 1, -1], [0, 2, 6], [4, -1, -1]], [4, 24, 17])
    p = batch.decode_inputs(torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1]), meta, size=4)
    assert p.input_ids.tolist() == [11, 12, 13, 0]
    assert p.positions.tolist() == [4, 8, 1, 0]
    assert p.slot_mapping.tolist() == [4, 24, 17, -1]
    assert p.context_lens.tolist() == [5, 9, 2, 0]
    assert p.block_tables.tolist() == [[3, 1, -1], [0, 2, 6], [4, -1, -1], [-1] * 3]
    assert (p.slot_mapping.dtype, p.context_lens.dtype, p.block_tables.dtype) == (torch.int64, torch.int32,
                                                                                  torch.int32)
    assert p.input_ids.data_ptr() == batch.host.input_ids.data_ptr()  # the staging buffers themselves


class EchoModel(torch.nn.Module):
    """Hidden state = what the step read: ids, positions, context length, slot, and the block-table entries that
    cover its context (count * 1000 + sum; what lies past the context is never read)."""

    def forward(self, input_ids, positions, meta):
        width = meta.block_tables.shape[1]
        num_blocks = (meta.context_lens + meta.block_size - 1).div(meta.block_size, rounding_mode="floor")
        read = torch.arange(width) < num_blocks[:, None]
        blocks = read.sum(1) * 1000 + (meta.block_tables * read).sum(1)
        return torch.stack([input_ids, positions, meta.context_lens.long(), meta.slot_mapping, blocks], 1).float()


class NoBackend:
    def prepare(self, meta):
        pass


def test_recorded_graph_replays_what_capture_issued_and_no_python():
    """RecordedGraph, which every graph test on the CPU stands on, replays as a CUDA graph does: the tensor ops and
    kernel calls of the capture on the tensors it saw, with the host's values of then; the Python around them, a
    host value changed since, or a tensor made from host data at capture, do not move it."""
    x, out, host, ran = torch.ones(3), torch.zeros(3), {"scale": 2.0}, []

    @kernel
    def add_rows(t: torch.Tensor, n: int) -> None:  # a kernel reads its tensors at each replay
        t += n * torch.arange(t.numel())

    def step() -> None:
        ran.append(host["scale"])
        out.copy_(x * host["scale"] + x.sum() + torch.tensor(host["scale"]))
        add_rows(out, int(host["scale"]))

    graph = RecordedGraph()
    graph.capture(step)
    assert ran == [2.0] and out.tolist() == [7.0, 9.0, 11.0]
    x.fill_(5.0)
    host["scale"] = 100.0
    graph.replay()
    assert ran == [2.0] and out.tolist() == [27.0, 29.0, 31.0]  # 5 * 2 + 15 + 2, plus 2 * row


def test_graph_runner_pads_replays_and_slices(monkeypatch):
    monkeypatch.setattr(cuda_graph, "CUDAGraph", RecordedGraph)
    runner = CUDAGraphRunner(EchoModel(), NoBackend(), max_num_seqs=8, max_model_len=20, block_size=4,
                             hidden_size=5, dtype=torch.float32, device=torch.device("cpu"))
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8] and runner.width == 5
    staging = InputBatch(8, 20, 16, 4, torch.device("cpu"))
    for ctx, tables, slots in [([5, 9, 2], [[3, 1, -1], [0, 2, 6], [4, -1, -1]], [4, 24, 17]),  # 3 -> graph of 4
                               ([7], [[2, 5]], [21]),                                   # 1 -> graph of 1
                               ([1] * 5, [[i] for i in range(5)], list(range(0, 20, 4))),  # 5 -> 8
                               ([6, 3, 4], [[1, 4], [2, -1], [3, -1]], [5, 10, 15])]:  # 3 -> 4 over the 5 rows
        n = len(ctx)
        ids, pos = torch.arange(50, 50 + n), torch.tensor(ctx) - 1
        meta = _decode_meta(ctx, tables, slots)
        size = runner.padded_size(n)
        static = runner.load(staging.decode_inputs(ids, pos, meta, size))
        assert static.input_ids.data_ptr() == runner.buffers.input_ids.data_ptr()
        out = runner.replay(size, n)
        assert torch.equal(out, EchoModel()(ids, pos, meta))  # real rows, sliced from the padded batch
        pad_row = [0, 0, 0, -1, 0]  # padding: token 0, position 0, no context, no slot, no blocks
        assert runner.outputs[n:size].tolist() == [pad_row] * (size - n)
    assert runner.padded_size(9) is None


def test_graph_metadata_is_made_of_views_of_the_runner_buffers():
    """A graph reads its inputs where they were at capture: a tensor made for one capture alone (the decode steps'
    cu_seqlens once were, which recurrent layers read) is freed once captured, its memory reused by the replay."""
    runner = CUDAGraphRunner(EchoModel(), NoBackend(), max_num_seqs=8, max_model_len=20, block_size=4,
                             hidden_size=5, dtype=torch.float32, device=torch.device("cpu"), recurrent=True)
    owned = {t.untyped_storage().data_ptr() for t in (*vars(runner.buffers).values(), *vars(runner).values())
             if isinstance(t, torch.Tensor)}
    for size in runner.sizes:
        tensors = [t for t in vars(runner.metadata(size)).values() if isinstance(t, torch.Tensor)]
        assert len(tensors) >= 6 and all(t.untyped_storage().data_ptr() in owned for t in tensors), size


# ---- small uploads through persistent staging ----

class FakeEvent:
    """A CUDA event on the CPU: what the host recorded and waited for, in order, in `log`."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log, self.number = log, sum(what == "record" for what, _ in log)

    def record(self) -> None:
        self.log.append(("record", self.number))

    def synchronize(self) -> None:
        self.log.append(("wait", self.number))


def staging(kind: str, capacity: int) -> HostStaging:
    if kind == "cuda":
        s = HostStaging(torch.device("cuda"), capacity)
        assert s.buffer.is_pinned()
        return s
    # The CUDA branch on the CPU: the packed bytes are copied into a fresh tensor all the same.
    s = HostStaging(torch.device("cpu"), capacity)
    s.on_cuda, s.buffer, s.events = True, torch.zeros(capacity, dtype=torch.uint8), []
    s.new_event = lambda: FakeEvent(s.events)
    return s


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("kind", [CUDA, "fake-cuda"])
def test_host_staging_packs_arrays_into_one_copy_and_reuses_its_buffer(kind):
    upload = staging(kind, 64)
    buffer = upload.buffer
    arrays = [np.array([0.5, -1.25, 3.0], dtype=np.float32), np.arange(4, dtype=np.int64).reshape(2, 2) - 7,
              np.zeros(0, dtype=np.int64), np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64).T[:, :0]]
    first = upload(*arrays)
    assert [t.shape for t in first] == [a.shape for a in arrays] and [t.dtype for t in first] == [
        torch.float32, torch.int64, torch.int64, torch.int64]
    assert all(np.array_equal(t.cpu().numpy(), a) for t, a in zip(first, arrays))
    # One copy: every result is a view of one packed tensor, apart from the staging buffer.
    assert len({t.untyped_storage().data_ptr() for t in first}) == 1
    assert first[0].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    if kind == "cuda":
        assert first[0].device.type == "cuda"
        return
    assert (upload.offset, upload.events) == (48, [("record", 0)])  # 16 + 32 bytes
    second = upload(np.full(2, 9, dtype=np.int64))  # fits: written after the first
    assert (upload.offset, upload.events[-1], upload.buffer is buffer) == (64, ("record", 1), True)
    upload(np.full(3, 8, dtype=np.int64))  # does not fit: back to the start once the first copy has run
    assert (upload.offset, upload.events[-2:], upload.buffer is buffer) == (32, [("wait", 0), ("record", 2)], True)
    assert buffer[:24].view(torch.int64).tolist() == [8, 8, 8]
    upload(np.full(2, 7, dtype=np.int64))  # the rest of the first copy's bytes: waited for already
    assert (upload.offset, upload.events[-2:]) == (48, [("record", 2), ("record", 3)])
    upload(np.full(2, 6, dtype=np.int64))  # over the second copy's bytes
    assert (upload.offset, upload.events[-2:]) == (64, [("wait", 1), ("record", 4)])
    # What came back earlier is a copy: rewriting the staging bytes leaves it as it was.
    assert first[1].tolist() == [[-7, -6], [-5, -4]] and second[0].tolist() == [9, 9]
    big = upload(np.arange(20, dtype=np.int64))[0]  # larger than the buffer: a bigger one, once every copy has run
    assert upload.buffer.numel() == 320 and upload.events[-2:] == [("wait", 4), ("record", 5)]
    assert big.tolist() == list(range(20)) and len(upload.in_flight) == 1


def test_host_staging_waits_only_for_copies_a_lap_old():
    """A wrap never waits for the copies of the current lap (they may be queued behind the step's forward pass, which
    the host would wait for too): only for the newest copy of the lap before that read the bytes it rewrites."""
    upload = staging("fake-cuda", 256)
    for _ in range(16):  # 16 bytes each: one lap
        upload(np.zeros(2, dtype=np.int32))
    ages = []  # per wait, how many copies were recorded after the one waited for
    for step in range(12):  # three laps more, 16 + 48 bytes a step
        for array in (np.zeros(1, dtype=np.int64), np.zeros(6, dtype=np.int64)):
            upload(array)
            recorded = sum(what == "record" for what, _ in upload.events)
            ages += [recorded - 1 - n for what, n in upload.events[-2:-1] if what == "wait"]
    # Each copy waits for the one that read its bytes a lap (8 copies) before, long done on a GPU; the former ring
    # waited once a lap for the newest copy, recorded just before (age 0).
    assert len(ages) >= 12 and min(ages) >= 5
    assert len(upload.in_flight) <= 256 // 16


def test_host_staging_starts_each_array_16_bytes_aligned():
    """As Triton marks a pointer argument: a kernel reading one of them (the sampler's noise keys, whose offset
    depends on the batch) compiles once for all."""
    first, second = staging("fake-cuda", 64)(np.zeros(1, dtype=np.int64), np.zeros(3, dtype=np.int8))
    assert first.data_ptr() % 16 == 0 and second.data_ptr() - first.data_ptr() == 16


def test_host_staging_on_the_cpu_makes_no_copy():
    a = np.array([1, 2], dtype=np.int64)
    (t,) = HostStaging(torch.device("cpu"))(a)
    assert t.data_ptr() == a.ctypes.data


# ---- KV cache sizing on the GPU ----

def test_kv_cache_blocks_for_gpu():
    gib = 1 << 30
    # 80 GiB GPU at 90%: 20 GiB in use after the warm-up (weights + allocator cache), whose peak sat 6 GiB above
    # what is allocated now -> 72 - 20 - 6 = 46 GiB for blocks of 64 MiB.
    assert kv_cache_blocks_for_gpu(80 * gib, 60 * gib, 16 * gib, 10 * gib, 0.9, 64 << 20) == 46 * 16
    assert kv_cache_blocks_for_gpu(10 * gib, 1 * gib, 2 * gib, 1 * gib, 0.9, 1 << 20) == 0  # over budget: none


def test_state_bytes_for_gpu():
    """Half of what gpu_memory_utilization leaves, not the CPU's 2 GiB cap: a Qwen3-Next-80B's 72 MiB of state per
    sequence then serves max_num_seqs=256 on an 80 GiB GPU (the cap held 28)."""
    gib = 1 << 30
    assert state_bytes_for_gpu(80 * gib, 60 * gib, 0.9) == 26 * gib  # (72 - 20) / 2
    assert state_bytes_for_gpu(80 * gib, 60 * gib, 0.9) // (72 << 20) >= 256
    assert state_bytes_for_gpu(10 * gib, 1 * gib, 0.9) == 0  # over budget: none (the runner then says so)


class FakeAllocator:
    """torch.cuda's memory calls over a pretend GPU: bytes allocated, what the caching allocator holds (reserved),
    and memory used outside it (CUDA context, other processes)."""

    def __init__(self, total: int, outside: int, allocated: int) -> None:
        self.total, self.outside = total, outside
        self.allocated = self.reserved = self.peak = allocated

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n  # the allocator keeps it cached: still reserved

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.outside - self.reserved, self.total

    def memory_stats(self, device=None) -> dict[str, int]:
        return {"allocated_bytes.all.peak": self.peak, "allocated_bytes.all.current": self.allocated}

    def install(self, monkeypatch) -> None:
        for name in ("empty_cache", "reset_peak_memory_stats", "mem_get_info", "memory_stats"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_kv_sizing_counts_the_warm_up_activations_once(monkeypatch):
    gib = 1 << 30
    gpu = FakeAllocator(total=80 * gib, outside=1 * gib, allocated=10 * gib)  # 10 GiB of weights
    gpu.install(monkeypatch)

    def warm_up() -> None:
        gpu.alloc(6 * gib)  # activations of the largest step
        gpu.alloc(gib // 2)  # kept: lazily created workspaces
        gpu.free(6 * gib)

    blocks = profile_kv_cache_blocks(warm_up, torch.device("cuda", 0), 0.9, 64 << 20)
    # 72 GiB allowed - 1 outside - 10.5 allocated - 6 of activation headroom = 54.5 GiB; the activations' cached
    # memory is given back before free memory is read, so it is not subtracted a second time.
    assert blocks == 54.5 * 16
    assert gpu.reserved == gpu.allocated  # the cache was emptied after the warm-up


@pytest.mark.parametrize("budget, max_num_seqs, max_model_len, expected", [
    (100, 5, 64, [64, 9, 9, 9, 9]),
    (8192, 256, 4096, [4096] + [17] * 16 + [16] * 239),
    (8192, 1, 4096, [4096]),
    (10, 256, 4096, [2] + [1] * 8),  # the first keeps 2 tokens: a prefill
    (64, 4, 8, [8, 8, 8, 8]),  # 4 full-length sequences are all a step can hold
])
def test_warm_up_lengths(budget, max_num_seqs, max_model_len, expected):
    lengths = warm_up_lengths(budget, max_num_seqs, max_model_len)
    assert lengths == expected
    assert sum(lengths) == min(budget, max_num_seqs * max_model_len) and max(lengths) <= max_model_len


def test_warm_up_runs_with_the_backend_and_the_logits_of_every_row(qwen3_dir, monkeypatch, capsys):
    """On CUDA the warm-up runs where _allocate_kv_cache starts (run here the same way, on the CPU): the attention
    layers already have their backend then, and it computes the logits of every row of the largest step as a step
    does, a row per sequence sampled with every filter and logprobs, then the others' (prompt logprobs) in chunks
    of a sixteenth of the budget. Start-up logs the cache's size in one line, on stderr without any logging
    set-up (as vLLM does)."""
    steps, logits_rows, sampled = [], [], []
    execute, allocate, sample = ModelRunner.execute, ModelRunner._allocate_kv_cache, Sampler.forward

    def recording_execute(self, step):
        hidden = execute(self, step)
        steps.append((step.meta.cu_seqlens_q.diff().tolist(), len(step.logit_rows), len(hidden)))
        return hidden

    def recording_sample(self, logits, m):
        sampled.append((tuple(logits.shape), m.all_greedy, m.num_logprobs,
                        *(x is not None for x in (m.min_p, m.top_k, m.top_p))))
        return sample(self, logits, m)

    def warm_up_first(self, reserved_bytes=0):
        compute_logits = self.model.compute_logits
        monkeypatch.setattr(self.model, "compute_logits", lambda h: logits_rows.append(len(h)) or compute_logits(h))
        self._warm_up()
        return allocate(self, reserved_bytes)

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", warm_up_first)
    monkeypatch.setattr(Sampler, "forward", recording_sample)
    capsys.readouterr()
    llm = LLM(str(qwen3_dir), device="cpu", max_model_len=64, max_num_seqs=5, max_num_batched_tokens=100)
    assert steps == [([64, 9, 9, 9, 9], 100, 100)]
    assert logits_rows == [5] + [7] * 13 + [4]  # 100 / 16 rounded up: 7
    assert sampled == [((5, 512), False, 1, True, True, True)]
    blocks = llm.llm_engine.model_runner.num_kvcache_blocks
    block_bytes = 3 * 2 * 16 * 2 * 32 * 4  # layers x (K, V) x tokens x KV heads x head_dim x fp32
    lines = capsys.readouterr().err.splitlines()
    weight_gib = sum(t.numel() for t in load_file(qwen3_dir / "model.safetensors").values()) * 4 / 2**30
    assert len(lines) == 2 and all(line.startswith("INFO ") for line in lines), lines
    assert f"[nanoinfer.engine.model_runner] Model Qwen3ForCausalLM: {weight_gib:.2f} GiB of float32 weights on " \
           "cpu, loaded in " in lines[0] and lines[0].endswith("; attention: CPUAttentionBackend"), lines
    assert lines[1].endswith(f"[nanoinfer.engine.model_runner] KV cache: {blocks} blocks of 16 tokens "
                             f"({blocks * 16} tokens), {blocks * block_bytes / 2**30:.2f} GiB"), lines
    llm.close()
    sampled.clear()
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64, max_num_seqs=5, max_num_batched_tokens=100,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}):
        assert sampled == [((20, 512), False, 1, True, True, True)]  # a row per sequence and draft
        assert logits_rows[15:] == [20] * 5  # 20 sampled rows, then chunks as large as a sampled batch at least


@pytest.mark.parametrize("root_configured, env, expected", [
    (False, {}, ["INFO", "[nanoinfer.engine.model_runner] KV cache: 1 block"]),
    (True, {}, ["INFO", "[nanoinfer.engine.model_runner] KV cache: 1 block"]),  # once, not again through the root
    (False, {"NANOINFER_CONFIGURE_LOGGING": "0"}, None)])
def test_start_up_log_line_shows_once_without_set_up_and_never_when_turned_off(root_configured, env, expected):
    code = textwrap.dedent("""
        import logging, sys
        if sys.argv[1] == "1":
            logging.basicConfig(level=logging.INFO, format="ROOT %(message)s")
        import nanoinfer
        logging.getLogger("nanoinfer.engine.model_runner").info("KV cache: 1 block")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(int(root_configured))], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "NANOINFER_CONFIGURE_LOGGING": "1", **env})
    assert r.returncode == 0 and not r.stdout, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    if expected is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(expected[0]) and lines[0].endswith(expected[1]), lines


@pytest.mark.parametrize("kind, tables", [("qwen3", 1), ("gemma3", 2), ("gemma4-e", 2)])
def test_layers_share_one_rope_table_per_distinct_rope(kind, tables, model_dir):
    """Not a copy per layer (on the GPU: 28 x 21 MB for Qwen3-0.6B); Gemma 3's and Gemma 4's sliding and full layers
    have two (Gemma 4's layers reusing others' keys and values included)."""
    with LLM(str(model_dir(kind)), device="cpu", max_model_len=64) as llm:
        layers = llm.llm_engine.model_runner.model.model.layers
        assert len({id(layer.self_attn.rotary_emb) for layer in layers}) == tables < len(layers)


def _memory_of(llm: LLM) -> list[weakref.ref]:
    """Weak references to the model, every parameter, and the KV cache and recurrent state tensors."""
    model = llm.llm_engine.model_runner.model
    tensors = [*model.parameters()]
    for m in model.modules():
        if isinstance(m, Attention):
            tensors += [m.k_cache, m.v_cache]
        elif isinstance(m, RecurrentLayer):
            tensors += [m.conv_state, m.ssm_state]
    return [weakref.ref(model), *map(weakref.ref, tensors)]


@pytest.mark.parametrize("kind, options", [("qwen3", {}), ("qwen3", {"enable_prompt_embeds": True}),
                                           ("qwen3-moe", {}), ("qwen3-next", {})], ids=["qwen3", "qwen3-prompt-embeds",
                                                                                      "qwen3-moe", "qwen3-next"])
def test_close_del_and_with_free_the_model_and_caches_without_the_garbage_collector(kind, options, model_dir):
    """Reference counting alone frees everything (no module <-> parameter cycles), after close(), after del and
    after a with block; an engine made next works the same. A closed LLM kept alive holds none of it either (with
    prompt embeddings, the runner kept the token embedding)."""
    d = model_dir(kind)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(d), device="cpu", max_model_len=64, **options)
        expected = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        memory = _memory_of(llm)
        llm.close()
        assert [r for r in memory if r() is not None] == []
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        llm = LLM(str(d), device="cpu", max_model_len=64, **options)
        memory = _memory_of(llm)
        del llm
        assert [r for r in memory if r() is not None] == []
        with LLM(str(d), device="cpu", max_model_len=64, **options) as llm:
            memory = _memory_of(llm)
            assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        assert [r for r in memory if r() is not None] == []
    finally:
        gc.enable()


def test_close_keeps_cublas_workspaces_while_another_engines_graphs_live(qwen3_dir, monkeypatch):
    """Every capture bakes in cuBLAS's one workspace for torch's capture stream (allocated in the first engine's
    graph pool): an engine closed while another's graphs live must not free it under them; the last one does."""
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)

    class Graphs:  # stands in for a CUDAGraphRunner captured on CUDA
        pass

    def close_as_on_cuda(llm: LLM) -> None:
        llm.llm_engine.model_runner.device = torch.device("cuda")  # close() takes the CUDA branch
        llm.close()

    other = Graphs()
    cuda_graph.CAPTURED.add(other)
    close_as_on_cuda(LLM(str(qwen3_dir), device="cpu", max_model_len=64))
    assert cleared == []
    del other
    close_as_on_cuda(LLM(str(qwen3_dir), device="cpu", max_model_len=64))
    assert cleared == [True] and not cuda_graph.CAPTURED


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3-moe", "qwen3-next", "deepseek-v3", "llama4", "mimo-v2-flash",
                                  "doge"])
def test_model_is_built_on_the_target_device_in_its_dtype(kind, model_dir):
    """Built under the device (meta here, CUDA in use) and filled there: no parameter or buffer is ever made on
    the host, so loading on CUDA needs no host copy of the model. Qwen3-Next's (1 + weight) norms hold fp32 weights,
    as Gemma's do, and DeepSeek-V3's routers (MiMo-V2-Flash's too) their correction bias and, as transformers 5.25,
    their weight."""
    config = Config(model_dir(kind), device="cpu", dtype="bfloat16")
    model = ModelRunner._load_model(config, torch.device("meta"))
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    fp32 = {id(m.weight) for m in model.modules() if isinstance(m, GemmaRMSNorm)}
    fp32 |= {id(p) for name, p in model.named_parameters() if name.endswith(".e_score_correction_bias")
             or kind in ("deepseek-v3", "mimo-v2-flash") and name.endswith(".mlp.gate.weight")}
    assert {p.dtype for p in model.parameters() if id(p) not in fp32} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters() if id(p) in fp32)


def test_sliding_window_decode_stays_on_the_inputs_device():
    """The PyTorch backend's decode (on CUDA: no C kernel) with a window and chunks, on meta tensors: a tensor it
    made on the CPU would fail to combine with them."""
    device = torch.device("meta")
    backend = CPUAttentionBackend(torch.float32, device)
    meta = _decode_meta([5, 9], [[0, 1, -1], [2, 3, 4]], [4, 8]).to(device)
    backend.prepare(meta)
    cache, q = torch.zeros(5, 4, 2, 8, device=device), torch.zeros(2, 4, 8, device=device)
    out = backend.forward(q, q, q, cache, cache, meta, 0.3, window=3, chunk=4)
    assert out.shape == (2, 32) and out.device == device


def test_tensor_parallel_needs_a_gpu_per_rank(fake_cuda, monkeypatch, qwen3_dir):
    cuda_sdpa = dict(attention_backend="cpu", dtype="float32")
    assert Config(qwen3_dir, tensor_parallel_size=2, **cuda_sdpa).tensor_parallel_size == 2  # 2 GPUs visible
    with pytest.raises(ValueError, match="all 2 tensor-parallel ranks on one GPU"):
        Config(qwen3_dir, tensor_parallel_size=2, device="cuda:1", **cuda_sdpa)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs .* 1 CUDA device\(s\) are visible"):
        Config(qwen3_dir, tensor_parallel_size=2, **cuda_sdpa)
    assert Config(qwen3_dir, tensor_parallel_size=2, device="cpu").torch_device == torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun, one rank on this machine and one elsewhere
    assert Config(qwen3_dir, tensor_parallel_size=2, **cuda_sdpa).tensor_parallel_size == 2


@pytest.mark.skipif(dist.is_initialized(), reason="needs this process to have no process group yet")
def test_tensor_parallel_on_the_cpu_uses_gloo_and_no_gpu(monkeypatch):
    """device='cpu' on a GPU machine: the ranks never select a GPU (a second rank would find no GPU 1 on a
    one-GPU machine) and talk over gloo."""
    def no_gpu(device) -> None:
        raise AssertionError(f"torch.cuda.set_device({device}) called for a CPU engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", no_gpu)
    group = TPGroup()
    group._init_process_groups(False, store=dist.HashStore())
    try:
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()
