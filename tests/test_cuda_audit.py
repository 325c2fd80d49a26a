"""CUDA-only paths found broken by reading them, checked on the CPU: the warm-up that sizes the KV cache on CUDA,
which models get decode CUDA graphs, that their decode forward never syncs with the host and (mixture-of-experts
models) decodes through the graph buffers as transformers does, a refused capture, the step API of a closed engine,
and the PyTorch backend's decode buffers."""
import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch
from cuda_fakes import HostSyncAudit, RecordedGraph, capture_recorded_graphs, count_replays
from models import ALL_KINDS, GRAPH_MOE_KINDS, GRAPH_RECURRENT_KINDS, cached_hf_greedy, check_against_hf
from models import REFERENCE_MAX_TOKENS as MAX_TOKENS
from models import REFERENCE_PROMPTS as PROMPTS

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine import model_runner
from nanoinfer.engine.cuda_graph import CUDAGraphRunner
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.attention import cpu as cpu_attention
from nanoinfer.layers.attention.cpu import CPUAttentionBackend
from nanoinfer.layers.attention.metadata import AttentionMetadata

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def warm_up_before_the_cache(monkeypatch):
    """Start-up as on CUDA, where _allocate_kv_cache runs the warm-up before the cache exists (see
    profile_kv_cache_blocks); every warm-up step's (new tokens per sequence, causal) is recorded."""
    steps = []
    allocate, execute = ModelRunner._allocate_kv_cache, ModelRunner.execute

    def warm_up_first(self, reserved_bytes=0):
        self._warm_up()
        return allocate(self, reserved_bytes)

    def recording_execute(self, step):
        steps.append((step.meta.cu_seqlens_q.diff().tolist(), step.meta.causal))
        return execute(self, step)

    monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", warm_up_first)
    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    return steps


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next", "zamba2", "qwen4-exp"])
def test_warm_up_with_a_one_token_budget(kind, model_dir, warm_up_before_the_cache):
    """max_num_batched_tokens=1: the largest step is one 1-token prompt, which every backend would take for a decode
    step reading the KV cache, which does not exist during the warm-up (an IndexError on the empty cache)."""
    with LLM(str(model_dir(kind)), device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=1) as llm:
        assert warm_up_before_the_cache[0] == ([1], False)
        out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
        assert all(causal for _, causal in warm_up_before_the_cache[1:])  # real steps stay causal


@contextlib.contextmanager
def as_on_cuda(llm: LLM, dtype: torch.dtype | None = None) -> Iterator[ModelRunner]:
    """llm's (CPU) runner deciding as on CUDA with the triton backend, in `dtype` if given, until the block ends."""
    runner = llm.llm_engine.model_runner
    runner.device, runner.config.attention_backend = torch.device("cuda", 0), "triton"
    runner.config.torch_dtype = dtype or runner.config.torch_dtype
    try:
        yield runner
    finally:
        runner.device, runner.config.torch_dtype = torch.device("cpu"), torch.float32


class RecordingGraphRunner:
    """Stands in for CUDAGraphRunner (no CUDA here): records that graphs would be captured."""

    def __init__(self, *args, **kwargs) -> None:
        self.sizes = [1]  # what start-up logs

    def capture(self) -> None:
        pass


@pytest.mark.parametrize("kind, dtype, capability, captured", [
    ("qwen3", torch.float32, (8, 0), True),
    ("qwen3-moe", torch.bfloat16, (9, 0), True),
    ("qwen3-moe", torch.float32, (9, 0), False),
    ("qwen3-moe", torch.bfloat16, (8, 0), False),
    ("qwen3-next", torch.bfloat16, (9, 0), True),
    ("qwen3-next", torch.bfloat16, (8, 0), False),
    ("lfm2", torch.float32, (8, 0), True),
])
def test_decode_graphs_only_for_models_whose_forward_a_graph_can_capture(kind, dtype, capability, captured, model_dir,
                                                                          monkeypatch):
    """A mixture-of-experts forward syncs with the host but in bf16 on sm90 (_grouped_mm elsewhere loops over offsets
    copied to the host): capturing it would fail when the engine starts. Recurrent state is captured (Qwen3-Next
    has experts too, LFM2's short convolutions none). Decided as on CUDA with the triton backend, in `dtype` on a
    GPU of `capability` (the runner here is a CPU one)."""
    monkeypatch.setattr(model_runner, "CUDAGraphRunner", RecordingGraphRunner)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with LLM(str(model_dir(kind)), device="cpu", max_model_len=64) as llm, as_on_cuda(llm, dtype) as runner:
        assert isinstance(runner._capture_graphs(), RecordingGraphRunner) == captured


def test_no_decode_graphs_unless_every_rank_can_capture(qwen3_dir, monkeypatch):
    """With tensor parallelism every rank decodes from graphs or none does: a rank whose model could be captured
    still decodes eagerly when another's could not (all_min over the ranks, here a stand-in of a 0 elsewhere)."""
    monkeypatch.setattr(model_runner, "CUDAGraphRunner", RecordingGraphRunner)
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64) as llm, as_on_cuda(llm) as runner:
        assert runner.model_capturable() and isinstance(runner._capture_graphs(), RecordingGraphRunner)
        monkeypatch.setattr(runner.tp, "all_min", lambda value: min(value, 0))
        assert runner._capture_graphs() is None


def cuda_error(message: str, code: int | None) -> RuntimeError:
    """What torch raises for a CUDA error: an AcceleratorError carrying CUDA's error code (2.11 and later)."""
    e = getattr(torch, "AcceleratorError", RuntimeError)(f"CUDA error: {message}")
    if code is not None:
        e.error_code = code
    return e


@pytest.mark.parametrize("code", [900, None], ids=["capture-unsupported", "no-code"])
def test_a_capture_the_device_refuses_leaves_decode_eager(qwen3_dir, monkeypatch, caplog, code):
    """Should a graph capture fail at start-up (an op that waits for the device, which the audit below missed), the
    engine warns and decodes eagerly rather than fail to start."""
    class RefusedCapture(RecordingGraphRunner):
        def capture(self) -> None:
            raise cuda_error("operation not permitted when stream is capturing", code)

    monkeypatch.setattr(model_runner, "CUDAGraphRunner", RefusedCapture)
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64) as llm:
        with as_on_cuda(llm) as runner, caplog.at_level(logging.WARNING, logger="nanoinfer"):
            assert runner._capture_graphs() is None
        assert "CUDA graphs: capture failed, decode runs eagerly: CUDA error: operation not permitted" in caplog.text
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_a_fault_during_capture_is_raised_not_taken_for_a_refusal(qwen3_dir, monkeypatch):
    """A kernel's illegal address (say) while the graphs are captured ends the process's CUDA context: decoding
    eagerly would fail later and elsewhere, so start-up fails with the fault itself."""
    class FaultingCapture(RecordingGraphRunner):
        def capture(self) -> None:
            raise cuda_error("an illegal memory access was encountered", 700)

    monkeypatch.setattr(model_runner, "CUDAGraphRunner", FaultingCapture)
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64) as llm, as_on_cuda(llm) as runner:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            runner._capture_graphs()


@pytest.mark.parametrize("inference", [False, True], ids=["grad mode", "inference mode"])
def test_host_sync_audit_sees_what_a_graph_cannot_capture(inference):
    x = torch.arange(6.0)
    audit = HostSyncAudit()
    with torch.inference_mode(inference), audit:
        x.sum().item(), x[x > 2], x.tolist(), torch.tensor([1, 2]), x.repeat_interleave(torch.tensor([1] * 6))
        x.repeat_interleave(torch.tensor([1] * 6), output_size=6), x[torch.tensor([0, 2])], x.softmax(0)
        x.index_put_((torch.tensor([1, 1]),), torch.ones(()), accumulate=True), x.index_put_((x < 0,), x[0])
        x[torch.tensor([0, 2])] = 1.0
        with audit.paused():
            x.tolist()
    assert [what for what, _ in audit.found] == [
        "a value read on the host (item(), int(), bool())", "boolean-mask indexing", "tolist()", "torch.tensor(data)",
        "torch.tensor(data)", "repeat_interleave without output_size", "torch.tensor(data)", "torch.tensor(data)",
        "torch.tensor(data)", "index_put_ with accumulate=True", "boolean-mask indexing", "torch.tensor(data)",
        "a Python scalar assigned through a tensor index", "torch.tensor(data)"]


def test_sampling_on_the_device_never_syncs_with_the_host(qwen3_dir, monkeypatch):
    """The runner's sampling (metadata, penalty counts, the sampler) of steps using every feature that needs no
    generated text (ban lists of several tokens wait for the step in flight by design) reads no device value back to
    the host: on CUDA a read waits for the step's whole queue, forward pass included. Top-p rows have a top-k here:
    without one, the CPU's cut (_ranked) reads values back, where CUDA sorts. Tensors made from host data are left
    out: here the audit cannot tell torch.from_numpy of the staged arrays (copied through pinned memory on CUDA) from
    a pageable upload. Python scalars assigned through index tensors are not: CUDA copies them to the device
    blocking."""
    found, sample = [], ModelRunner.sample

    def audited(self, seqs, logits):
        with HostSyncAudit() as audit:
            out = sample(self, seqs, logits)
        found.extend(what for what in audit.found if what[0] != "torch.tensor(data)")
        return out

    monkeypatch.setattr(ModelRunner, "sample", audited)
    every = dict(max_tokens=6, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9, **every),
              SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.4, logprobs=3, prompt_logprobs=2, **every),
              SamplingParams(temperature=0, logit_bias={5: 3.0, 9: -2.0}, allowed_token_ids=[5, 9, 11, 13],
                             min_tokens=2, n=2, max_tokens=6),
              SamplingParams(temperature=1.0, bad_words=["a"], stop_token_ids=[7], min_tokens=3, **every)]
    with LLM(str(qwen3_dir), device="cpu", max_model_len=64, max_num_seqs=8) as llm:
        outputs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], params, use_tqdm=False)
    assert [len(c.token_ids) for o in outputs for c in o.outputs] == [6, 6, 6, 6, 6]
    assert found == []


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_decode_forward_of_every_graph_captured_model_never_syncs_with_the_host(kind, model_dir, monkeypatch):
    """What a decode graph captures on CUDA (the model's forward at every captured batch size, over the graph runner's
    static buffers) reads no value back to the host and makes no value-dependent shape: on CUDA either makes capture
    fail at start-up. The attention backend's calls are left out: the CPU one stands in for the Triton kernels.
    Mixture-of-experts models are audited as they are captured in bf16 on sm90 (_grouped_mm, which reads its offsets
    on the device there, runs here as the CPU's)."""
    monkeypatch.setattr(model_runner, "experts_capturable", lambda dtype, device: True)
    with LLM(str(model_dir(kind)), device="cpu", max_model_len=64, max_num_seqs=4) as llm:
        runner = llm.llm_engine.model_runner
        if not runner.model_capturable():
            pytest.skip("no decode graphs for this model (sparse attention, relative logits or pooling only)")
        graphs, found = audited_capture(runner)
    assert graphs.sizes == [1, 2, 4] and graphs.outputs.isfinite().all() and graphs.outputs.abs().sum() > 0
    assert found == []




@pytest.mark.slow
@pytest.mark.parametrize("kind", GRAPH_MOE_KINDS + GRAPH_RECURRENT_KINDS)
def test_decode_through_graph_buffers_matches_transformers(kind, model_dir, monkeypatch, captured_logits,
                                                           report_logit_diff):
    """Mixture-of-experts models, whose decode is captured in bf16 on sm90, and models with recurrent state decode
    through the graph runner's static buffers and padding (RecordedGraph: a graph's semantics on the CPU, what the step
    derives in Python fixed at capture as a graph fixes it): transformers' tokens and logits, 7 sequences replayed at
    the captured size 8 (the padding row's state in the spare slot)."""
    monkeypatch.setattr(model_runner, "experts_capturable", lambda dtype, device: True)
    replays = count_replays(monkeypatch)
    d = model_dir(kind)
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8) as llm:
        runner = llm.llm_engine.model_runner
        assert runner.model_capturable()
        assert bool(runner.num_state_slots) == (kind in GRAPH_RECURRENT_KINDS)
        assert any(isinstance(m, FusedMoE) for m in runner.model.modules()) or kind in GRAPH_RECURRENT_KINDS
        if not runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        capture_recorded_graphs(runner)
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        # Every decode step after the one prefill step, all 7 together, replayed from the size-8 graph.
        assert replays == [runner.graph_runner.graphs[8]] * (MAX_TOKENS - 1)
    worst = check_against_hf(outputs, cached_hf_greedy(d, PROMPTS, MAX_TOKENS), captured_logits)
    report_logit_diff(f"{kind}, decode through graph buffers", worst)
    assert worst < 1e-4, f"max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("kind", ["qwen3.5", "lfm2", "mamba2", "rwkv", "recurrent-gemma"])
def test_a_sequence_starting_in_a_decode_graph_starts_from_a_clean_state(kind, model_dir, monkeypatch):
    """A one-token prompt scheduled beside decoding sequences makes a step of one token per sequence, replayed from
    a graph: its state slot, which a finished sequence left dirty, is reset there on the device (where(first token,
    its slot, the spare slot)), as the eager step resets it. Every sequence's tokens equal transformers'."""
    replays = count_replays(monkeypatch)
    d = model_dir(kind)
    prompts = {"a": [7, 8, 9, 10], "b": [11, 12, 13], "done": [20, 21, 22, 23, 24], "new": [17]}
    lengths = {"a": 10, "b": 10, "done": 2, "new": 6}
    with LLM(str(d), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4) as llm:
        engine, runner = llm.llm_engine, llm.llm_engine.model_runner
        if not runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        capture_recorded_graphs(runner)
        slots, outputs = {}, {}

        def step() -> None:
            for seq in engine.scheduler.running:
                slots.setdefault(seq.request_id, seq.state_slot)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids

        for name in ("a", "b", "done"):
            engine.add_request(name, prompts[name], SamplingParams(temperature=0, max_tokens=lengths[name],
                                                                   ignore_eos=True))
        while "done" not in outputs:
            step()
        engine.add_request("new", prompts["new"], SamplingParams(temperature=0, max_tokens=lengths["new"],
                                                                 ignore_eos=True))
        replayed = len(replays)
        step()  # a, b and new's one token: a decode-shaped step, from the size-4 graph
        assert len(replays) == replayed + 1 and replays[-1] is runner.graph_runner.graphs[4]
        while engine.has_unfinished_requests():
            step()
    assert slots["new"] == slots["done"]  # the slot the finished sequence left
    for name, prompt in prompts.items():
        want = cached_hf_greedy(d, [prompt], lengths[name])[0]["token_ids"]
        assert outputs[name] == want, name


def test_sparse_attention_without_experts_gets_no_decode_graphs(tmp_path, monkeypatch):
    """DeepSeek-V3.2 with dense MLPs only, so that no FusedMoE rules graphs out: its sparse attention reads each step's
    spans on the host, which would fail the capture (or, taken from the warm-up, replay stale spans): no graphs."""
    import models
    config = models.make_config("deepseek-v32")
    config.mlp_layer_types, config.first_k_dense_replace = ["dense"] * 3, 3  # 5.23 reads the one, 5.17 the other
    monkeypatch.setattr(models, "make_config", lambda kind: config)
    with LLM(str(models.build_model("deepseek-v32", tmp_path / "m")), device="cpu", max_model_len=64,
             max_num_seqs=4) as llm:
        runner = llm.llm_engine.model_runner
        assert not any(isinstance(m, FusedMoE) for m in runner.model.modules())
        assert not runner.model_capturable()
        assert audited_capture(runner)[1]  # what the capture would meet


def audited_capture(runner: ModelRunner) -> tuple[CUDAGraphRunner, list]:
    """The runner's decode graphs captured (RecordedGraph) under a HostSyncAudit, and what it found; the attention
    backend's calls are left out. Row i stores its key at slot i of block 0 and attends over one key, that block's
    first."""
    audit, backend = HostSyncAudit(), runner.backend
    for name in ("forward", "store_kvcache"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, method=method, **k: _paused(audit, method, *a, **k))
    graphs = runner.new_graph_runner(RecordedGraph)
    graphs.buffers.slot_mapping.copy_(torch.arange(len(graphs.buffers.slot_mapping)))
    graphs.buffers.block_tables.fill_(0)
    graphs.buffers.context_lens.fill_(1)
    with audit:
        graphs.capture()
    return graphs, audit.found


def _paused(audit: HostSyncAudit, fn, *args, **kwargs):
    with audit.paused():
        return fn(*args, **kwargs)


def test_step_after_close_names_the_closed_engine(qwen3_dir):
    llm = LLM(str(qwen3_dir), device="cpu", max_model_len=64)
    engine = llm.llm_engine
    engine.add_request("before", [5, 6, 7], GREEDY)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("after", [5, 6, 7], GREEDY)
    engine.abort_request("before")  # what LLM.generate's clean-up does: still fine


def test_pytorch_backend_decode_gathers_kv_in_bounded_groups(monkeypatch):
    """Decode without the C kernel (always on CUDA) gathers K/V padded to the longest context: a group of sequences
    at a time, so its buffers stay under DECODE_GATHER_BYTES instead of growing with the batch (GiBs at batch 256
    that the KV-cache sizing never saw). The groups give what one gather of the whole batch gives."""
    block_size, kv_heads, heads, head_dim = 4, 2, 4, 8
    contexts = [37, 5, 64, 1, 50, 12]
    tables, first = [], 0
    for n in contexts:
        tables.append(list(range(first, first + -(-n // block_size))))
        first += len(tables[-1])
    width = max(map(len, tables))
    ctx = torch.tensor(contexts, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=None, block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=ctx, cu_seqlens_q=torch.arange(len(ctx) + 1, dtype=torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0, dtype=torch.int32)]),
        max_seqlen_q=1, max_seqlen_k=max(contexts), block_size=block_size)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, first, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(contexts), heads, head_dim, generator=g)

    def decode(window: int | None) -> tuple[torch.Tensor, int]:
        backend = CPUAttentionBackend(torch.float32)
        backend.decode_kernel = False  # the gather path, as on CUDA
        backend.prepare(meta)
        out = backend.forward(q, None, None, k_cache, v_cache, meta, 0.3, window)
        return out, sum(b.nbytes for b in backend._buffers.values())

    slot_bytes = kv_heads * head_dim * 4
    for window in (None, 9):
        whole, whole_bytes = decode(window)
        assert whole_bytes == 2 * len(contexts) * 64 * slot_bytes  # one gather of every sequence's 64 slots
        monkeypatch.setattr(cpu_attention, "DECODE_GATHER_BYTES", 2 * 2 * 64 * slot_bytes)  # 2 sequences a group
        grouped, grouped_bytes = decode(window)
        monkeypatch.undo()
        assert grouped_bytes == 2 * 2 * 64 * slot_bytes
        torch.testing.assert_close(grouped, whole, rtol=0, atol=1e-6)
