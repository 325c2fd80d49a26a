"""What a failed step leaves behind (never unwritten K/V in the prefix cache, whichever API drove it), streams
advanced, closed or dropped from any thread, step-API requests kept apart from generate's, and a stopped
tensor-parallel worker failing generate within NANOINFER_TP_TIMEOUT with a message naming it."""
from __future__ import annotations

import dataclasses
import gc
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch.distributed as dist

from models import assert_greedy_match, cached_hf_greedy
from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.engine.model_runner import ModelRunner
from test_errors import assert_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE_PROMPTS = [[5, 6, 7, 8], list(range(100, 120))]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), max_model_len=128, kvcache_block_size=8, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def baseline(llm):
    return tokens(llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def at_step(monkeypatch, llm, at: int, action) -> None:
    """Call action() as the at-th step from now starts running the model."""
    runner = llm.llm_engine.model_runner
    real_run, calls = runner.launch, []

    def run(batch):
        calls.append(1)
        if len(calls) == at:
            action()
        return real_run(batch)

    monkeypatch.setattr(runner, "launch", run)


def fail_step(monkeypatch, llm, at: int, error: type[BaseException] = RuntimeError) -> None:
    """The model fails (raises `error`) in the at-th step from now."""
    def fail() -> None:
        raise error("simulated failure in the model")

    at_step(monkeypatch, llm, at, fail)


def drain(engine) -> dict:
    """Step until nothing is left; every request's final output."""
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return final


class OtherThread:
    """Another thread running calls one after the other. A daemon: a call that hangs fails the test after
    `timeout` instead of hanging the test run."""

    def __init__(self, timeout: float = 60) -> None:
        self.timeout, self.calls = timeout, queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self.calls.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def submit(self, fn, *args, **kwargs) -> Future:
        future = Future()
        self.calls.put((future, fn, args, kwargs))
        return future

    def call(self, fn, *args, **kwargs):
        return self.submit(fn, *args, **kwargs).result(self.timeout)


def assert_matches_hf(qwen3_dir, prompt, out) -> None:
    ref = cached_hf_greedy(qwen3_dir, [prompt], GREEDY.max_tokens)[0]
    assert_greedy_match(out.outputs[0].token_ids, ref["token_ids"], ref["logits"])


# ----------------------------------------------------------------------------------------------------------
# A failed step: blocks reach the prefix cache only once the step that writes them has completed
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_step_then_abort_through_the_step_api_caches_nothing_unwritten(llm, qwen3_dir, monkeypatch, error):
    engine = llm.llm_engine
    prompt = list(range(300, 340)) if error is RuntimeError else list(range(340, 380))  # 5 full blocks of 8
    fail_step(monkeypatch, llm, at=1, error=error)
    engine.add_request("a", prompt, GREEDY)
    with pytest.raises(error, match="simulated"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("a")
    engine.add_request("b", prompt, GREEDY)
    out = drain(engine)["b"]
    assert out.num_cached_tokens == 0, "the failed step's blocks were taken from the prefix cache"
    assert_matches_hf(qwen3_dir, prompt, out)
    assert_idle(llm)


def test_failed_step_rolls_back_a_prompt_that_shared_blocks_admitted_in_that_step(llm, qwen3_dir, monkeypatch):
    """b is admitted in the same step as a and shares its blocks (stored before anyone attends); the step fails
    and a is aborted: b must not count those never-written blocks as computed."""
    engine = llm.llm_engine
    prompt = list(range(380, 420))
    fail_step(monkeypatch, llm, at=1)
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    assert engine.requests["b"][0].num_cached_tokens == 32  # it did share them within the step
    monkeypatch.undo()
    engine.abort_request("a")
    out = drain(engine)["b"]
    assert_matches_hf(qwen3_dir, prompt, out)
    assert_idle(llm)


def test_step_api_request_survives_a_failed_generate_iter_and_is_recomputed(llm, qwen3_dir, monkeypatch):
    engine = llm.llm_engine
    pending, streamed = list(range(420, 452)), list(range(452, 476))
    engine.add_request("pending", pending, GREEDY)
    engine.step()  # pending is prefilled and running
    fail_step(monkeypatch, llm, at=2)
    stream = llm.generate_iter([streamed], GREEDY)
    with pytest.raises(RuntimeError, match="simulated"):
        for _ in stream:
            pass
    monkeypatch.undo()
    assert list(engine.requests) == ["pending"], "the stream must abort its own requests only"
    assert_matches_hf(qwen3_dir, pending, drain(engine)["pending"])
    assert_matches_hf(qwen3_dir, streamed, llm.generate([streamed], GREEDY, use_tqdm=False)[0])
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Streams and threads
# ----------------------------------------------------------------------------------------------------------

def test_stream_advanced_and_closed_from_other_threads_releases_the_llm(llm, baseline):
    first, second = OtherThread(), OtherThread()
    stream = llm.generate_iter(BASE_PROMPTS, dataclasses.replace(GREEDY, max_tokens=20))
    first.call(next, stream)  # opened here, started in one thread
    next(stream)  # advanced here
    second.call(next, stream)
    second.call(stream.close)  # closed in another
    assert_idle(llm)
    assert tokens(second.call(llm.generate, BASE_PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert tokens(OtherThread().call(llm.generate, BASE_PROMPTS, GREEDY, use_tqdm=False)) == baseline


def test_stream_dropped_in_another_thread_releases_the_llm(llm, baseline):
    held = [llm.generate_iter(BASE_PROMPTS, dataclasses.replace(GREEDY, max_tokens=20))]
    next(held[0])
    other = OtherThread()
    other.call(held.clear)  # the last reference goes in that thread
    gc.collect()
    assert_idle(llm)
    assert tokens(other.call(llm.generate, BASE_PROMPTS, GREEDY, use_tqdm=False)) == baseline


def test_other_threads_wait_for_an_open_stream_while_its_own_thread_is_refused(llm, baseline):
    stream = llm.generate_iter(BASE_PROMPTS, GREEDY)
    other = OtherThread()
    other.call(next, stream)
    # That thread drives the stream now: waiting there for the stream to end would never end.
    with pytest.raises(RuntimeError, match="generate_iter"):
        other.call(llm.generate, BASE_PROMPTS, GREEDY, use_tqdm=False)
    next(stream)  # this thread drives it now, so that one waits
    waiting = other.submit(llm.generate, BASE_PROMPTS, GREEDY, use_tqdm=False)
    time.sleep(0.2)
    assert not waiting.done()
    for _ in stream:
        pass
    assert tokens(waiting.result(60)) == baseline
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# Step-API requests and generate on one engine
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_generate_returns_its_own_outputs_and_keeps_the_step_api_ones(llm, baseline, kind):
    engine = llm.llm_engine
    prompt, params = [40, 41, 42], dataclasses.replace(GREEDY, max_tokens=12)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    engine.add_request("pending", prompt, dataclasses.replace(params, output_kind=kind))
    seen = engine.step()  # running while generate and generate_iter take their steps
    outs = llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == baseline
    streamed = list(llm.generate_iter(BASE_PROMPTS, GREEDY))
    assert "pending" not in {o.request_id for o in streamed}
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert {o.request_id for o in seen} == {"pending"} and seen[-1].finished
    if kind == RequestOutputKind.DELTA:
        assert sum((o.outputs[0].token_ids for o in seen), []) == alone.token_ids
    else:
        assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 13))  # none lost
        assert seen[-1].outputs[0] == alone
    assert_idle(llm)


def test_generate_ids_skip_those_held_by_step_api_requests(llm, baseline):
    engine = llm.llm_engine
    next_id = str(int(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].request_id) + 1)
    engine.add_request(next_id, [3, 4, 5], GREEDY)
    outs = llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == baseline and next_id not in {o.request_id for o in outs}
    assert list(drain(engine)) == [next_id]
    assert_idle(llm)


# ----------------------------------------------------------------------------------------------------------
# A stopped tensor-parallel worker
# ----------------------------------------------------------------------------------------------------------

def test_bad_tp_timeout_is_refused(qwen3_dir, monkeypatch):
    monkeypatch.setenv("NANOINFER_TP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NANOINFER_TP_TIMEOUT.*'soon'"):
        LLM(str(qwen3_dir), max_model_len=64, tensor_parallel_size=2, device="cpu")
    assert not dist.is_initialized()


@pytest.mark.slow
def test_stopped_worker_fails_generate_within_the_timeout_naming_it(qwen3_dir, monkeypatch):
    timeout = 3
    monkeypatch.setenv("NANOINFER_TP_TIMEOUT", str(timeout))
    llm = LLM(str(qwen3_dir), max_model_len=256, tensor_parallel_size=2, device="cpu", dtype="float32")
    worker, stopped = llm.llm_engine.tp.workers[0], []
    at_step(monkeypatch, llm, 3, lambda: (os.kill(worker.pid, signal.SIGSTOP), stopped.append(time.monotonic())))
    try:
        generating = OtherThread().submit(llm.generate, [[5, 6, 7, 8]] * 4,
                                          SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) is stopped"):
            generating.result(timeout + 60)  # a TimeoutError here: generate hangs on the stopped worker
        elapsed = time.monotonic() - stopped[0]
        assert elapsed < timeout + 5, f"generate took {elapsed:.1f}s to give up on the stopped worker"
        assert worker.poll() is not None and not dist.is_initialized()
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_worker_loading_past_the_timeout_is_waited_for(qwen3_dir, baseline, monkeypatch):
    """Ranks load the checkpoint at their own pace: the step timeout starts with the steps, after every rank loaded.
    (On the CPU the cache sizing's all_min already waited for the worker; on CUDA the warm-up's NCCL all-reduces,
    which come before it, would time out without TPGroup.meet. Two GPUs are needed to see that.)"""
    timeout = 2
    monkeypatch.setenv("NANOINFER_TP_TIMEOUT", str(timeout))
    init = ModelRunner.__init__

    def init_beside_a_slow_worker(self, config, tp=None):
        # The worker, stopped while it starts (rank 0 has just spawned it), loads the model timeout + 3 s late.
        pid = tp.workers[0].pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(timeout + 3, os.kill, (pid, signal.SIGCONT)).start()
        init(self, config, tp)

    monkeypatch.setattr(ModelRunner, "__init__", init_beside_a_slow_worker)
    with LLM(str(qwen3_dir), max_model_len=128, kvcache_block_size=8, tensor_parallel_size=2, device="cpu",
             dtype="float32") as llm:
        assert tokens(llm.generate(BASE_PROMPTS, GREEDY, use_tqdm=False)) == baseline
