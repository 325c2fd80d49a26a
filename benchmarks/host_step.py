"""Host (Python) time per decode step, with the model's compute stubbed out: what the engine spends besides the
forward pass, at batch 256 (and --batch N). Not a test.

A real LLM on a tiny random Qwen3 (device="cpu", one thread) whose forward pass and logits are replaced by
preallocated random logits [rows, --vocab] (151,936 by default, Qwen3's: the sampler's cost stays realistic but is
reported apart, as on a GPU it runs on the device). --batch requests of --prompt-len tokens, ignore_eos, exactly
--steps decode steps each, all prefilled in one step, then decoded together. Cases:

  greedy       LLM.generate, temperature 0 (FINAL_ONLY outputs: no text until a request finishes)
  temp         LLM.generate, temperature 0.6 (nano-vllm's bench)
  stop         LLM.generate, greedy with a stop string that never matches (text decoded every step)
  stream       the step API (add_request, step), greedy, CUMULATIVE outputs with text every step

Per case: the median time of a decode step (from one step's start to the next's, the caller's loop included) and
its parts, from a second, instrumented run (wrapper overhead subtracted). `--profile` prints cProfile's top
functions over the decode steps of each case instead.

    PYTHONPATH=. python benchmarks/host_step.py [--batch 256] [--steps 32] [--vocab 151936] [--cases greedy,stop]
"""
import argparse
import cProfile
import functools
import importlib
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.engine.llm_engine import LLMEngine  # noqa: E402
from tests import models  # noqa: E402

BLOCK_SIZE = 16
clock = time.perf_counter  # --cpu-time: time.thread_time

CASES = {
    "greedy": (dict(temperature=0.0), "generate"),
    "temp": (dict(temperature=0.6), "generate"),
    "stop": (dict(temperature=0.0, stop=["<never seen>"]), "generate"),
    "stream": (dict(temperature=0.0), "step"),
}

# (label, "module.Class", method): the parts of a step, timed inclusively; indented ones are inside the one above.
# Methods called once a step, but for detokenization (per sequence, and costly enough for a wrapper not to matter).
# One that this version of the engine lacks is skipped (timed as 0).
PARTS = [
    ("engine._step", "nanoinfer.engine.llm_engine.LLMEngine", "_step"),
    ("  schedule (block manager incl.)", "nanoinfer.engine.scheduler.Scheduler", "schedule"),
    ("  runner.launch", "nanoinfer.engine.model_runner.ModelRunner", "launch"),
    ("    prepare (input batch)", "nanoinfer.engine.model_runner.ModelRunner", "prepare"),
    ("    execute (stubbed model)", "nanoinfer.engine.model_runner.ModelRunner", "execute"),
    ("    sampling metadata", "nanoinfer.engine.model_runner.ModelRunner", "_sampling_metadata"),
    ("    sampler (device work)", "nanoinfer.layers.sampler.Sampler", "forward"),
    ("    to_host (start)", "nanoinfer.engine.sampling_state.HostTransfer", "start"),
    ("  runner.collect", "nanoinfer.engine.model_runner.ModelRunner", "collect"),
    ("    to_host (wait)", "nanoinfer.engine.sampling_state.Results", "wait"),
    ("  record logprobs", "nanoinfer.engine.llm_engine.LLMEngine", "_record_logprobs"),
    ("  postprocess", "nanoinfer.engine.scheduler.Scheduler", "postprocess"),
    ("  detokenize", "nanoinfer.engine.detokenizer.IncrementalDetokenizer", "update"),
]
# Derived: parts of engine._step not covered above.
ENGINE_REST = "  rest: stops, finish, outputs"  # detokenization apart
RUNNER_REST = "    rest of launch, collect"
ENGINE_SIDE = "engine side: _step - runner"
HOST = "host: _step - sampler"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256, help="requests decoded together (default 256)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per request (default 32)")
    p.add_argument("--vocab", type=int, default=151936, help="logits width (default 151936, Qwen3's)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per case; medians over all (default 3)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this thread's CPU clock, not the wall clock: steadier while other processes load "
                        "the machine (the stubbed step runs on this thread alone)")
    p.add_argument("--json", metavar="PATH", help="also write the table ({row: {case: ms}}) as JSON")
    p.add_argument("--profile", action="store_true", help="cProfile the decode steps instead of timing them")
    p.add_argument("--async-scheduling", action="store_true",
                   help="engine async_scheduling (on the CPU the same work per step, in another order)")
    return p.parse_args()


class StubModel(nn.Module):
    """Costs ~nothing: hidden states are a preallocated [tokens, 1], logits rows of preallocated random banks
    (cycled, so that greedy tokens change from step to step), biased towards the tokenizer's ordinary tokens so
    that the text is real."""

    def __init__(self, max_tokens: int, rows: int, vocab: int, text_tokens: range, num_banks: int = 4):
        super().__init__()
        self.hidden = torch.zeros(max_tokens, 1)
        g = torch.Generator().manual_seed(0)
        self.banks = [torch.randn(rows, vocab, generator=g) for _ in range(num_banks)]
        for bank in self.banks:
            bank[:, text_tokens.start:text_tokens.stop] += 8
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.banks[self.calls % len(self.banks)][:hidden.shape[0]]


def build_model(root: Path, vocab: int, max_len: int) -> Path:
    """A tiny random Qwen3 with the test tokenizer and a `vocab`-wide embedding (never run: the model is stubbed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = models.make_config("qwen3")
    config.vocab_size = vocab
    config.max_position_embeddings = max_len
    Qwen3ForCausalLM(config).save_pretrained(root)
    models.build_tokenizer(root)
    return root


def make_llm(model: Path, args: argparse.Namespace) -> LLM:
    torch.set_num_threads(1)
    max_len = args.prompt_len + args.steps + 1
    # Room for every request's whole length: no preemption.
    llm = LLM(model, device="cpu", max_num_seqs=args.batch, max_model_len=max_len,
              max_num_batched_tokens=max(8192, args.batch * args.prompt_len),
              num_kvcache_blocks=args.batch * -(-max_len // BLOCK_SIZE), kvcache_block_size=BLOCK_SIZE,
              **({"async_scheduling": True} if args.async_scheduling else {}))  # older engines lack the option
    runner = llm.llm_engine.model_runner
    text_tokens = range(len(models.SPECIAL_TOKENS), models.TOKENIZER_VOCAB_SIZE)
    runner.model = StubModel(runner.input_batch.host.input_ids.shape[0], args.batch, args.vocab, text_tokens)
    return llm


def prompts(args: argparse.Namespace) -> list[list[int]]:
    return models.random_prompts(args.batch, len(models.SPECIAL_TOKENS), models.TOKENIZER_VOCAB_SIZE,
                                 args.prompt_len, args.prompt_len, seed=0)


def run_case(llm: LLM, case: str, args: argparse.Namespace, on_step: Callable[[], None]) -> None:
    """One pass of the case's workload; on_step() is called at the start of every step."""
    kwargs, api = CASES[case]
    params = SamplingParams(**kwargs, ignore_eos=True, max_tokens=args.steps + 1)
    engine = llm.llm_engine
    engine.last_batch = None  # the previous run's
    if api == "generate":
        step_for = engine.step_for

        def timed_step_for(ids):
            on_step()
            return step_for(ids)
        engine.step_for = timed_step_for
        try:
            llm.generate(prompts(args), params, use_tqdm=False)
        finally:
            del engine.step_for
    else:
        for i, p in enumerate(prompts(args)):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished_requests():
            on_step()
            engine.step()
    on_step()


class StepClock:
    """Per-step durations of the decode steps at full batch (the step before which last_batch was such)."""

    def __init__(self, engine: LLMEngine, batch: int):
        self.engine, self.batch = engine, batch
        self.last: float | None = None
        self.times: list[float] = []

    def __call__(self) -> None:
        now = clock()
        b = self.engine.last_batch
        if self.last is not None and b is not None and not b.is_prefill and len(b.seqs) == self.batch:
            self.times.append(now - self.last)
        self.last = now


class Parts:
    """Wraps PARTS' methods to add up their time per step; a wrapper's own cost (calibrated) is subtracted from
    the part and from every part it is nested in."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.per_step: dict[str, list[float]] = defaultdict(list)
        self.calls = 0
        self.originals: list[tuple[type, str, Callable]] = []
        self.overhead = 0.0

    def install(self) -> None:
        for label, class_path, name in PARTS:
            module, _, class_name = class_path.rpartition(".")
            cls = getattr(importlib.import_module(module), class_name, None)
            original = None if cls is None else cls.__dict__.get(name)
            if original is None:  # another version of the engine
                continue
            self.originals.append((cls, name, original))
            setattr(cls, name, self._wrap(label, original))
        self.overhead = self._calibrate()

    def uninstall(self) -> None:
        for cls, name, original in reversed(self.originals):
            setattr(cls, name, original)
        self.originals.clear()

    def _wrap(self, label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            calls = self.calls
            start = clock()
            try:
                return fn(*a, **kw)
            finally:
                nested = self.calls - calls
                self.calls += 1
                self.totals[label] += clock() - start - nested * self.overhead
        return wrapper

    def _calibrate(self, n: int = 20000) -> float:
        """Seconds one wrapper adds around a call, beyond the call itself."""
        def plain(obj, arg):
            return None
        bare = self._wrap("_calibrate", plain)
        times = []
        for _ in range(5):
            t0 = clock()
            for _ in range(n):
                plain(self, n)
            t1 = clock()
            for _ in range(n):
                bare(self, n)
            times.append((clock() - t1 - (t1 - t0)) / n)
        self.totals.clear()
        self.calls = 0
        return statistics.median(times)

    def step_boundary(self, counted: bool) -> None:
        if counted:
            for label, _, _ in PARTS:
                self.per_step[label].append(self.totals.get(label, 0.0))
        self.totals.clear()


def time_case(llm: LLM, case: str, args: argparse.Namespace) -> tuple[list[float], dict[str, list[float]]]:
    engine = llm.llm_engine
    times: list[float] = []
    for _ in range(args.runs):
        steps = StepClock(engine, args.batch)
        run_case(llm, case, args, steps)
        times += steps.times
    parts = Parts()
    parts.install()
    try:
        for _ in range(args.runs):
            steps = StepClock(engine, args.batch)

            def on_step():
                before = len(steps.times)
                steps()
                parts.step_boundary(len(steps.times) > before)
            run_case(llm, case, args, on_step)
    finally:
        parts.uninstall()
    return times, parts.per_step


def profile_case(llm: LLM, case: str, args: argparse.Namespace) -> None:
    profiler = cProfile.Profile()
    engine = llm.llm_engine

    def on_step():
        profiler.disable()
        b = engine.last_batch
        if b is not None and not b.is_prefill and len(b.seqs) == args.batch:
            profiler.enable()  # this step and its loop, up to the next step's start
    run_case(llm, case, args, on_step)
    profiler.disable()
    print(f"\n=== {case}: cProfile of the decode steps at batch {args.batch} ===")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def table(results: dict[str, tuple[list[float], dict[str, list[float]]]]) -> dict[str, dict[str, float]]:
    """{row label: {case: median ms}}: the step, its parts, the derived rests and sums."""
    rows: dict[str, dict[str, float]] = defaultdict(dict)
    for case, (step_times, parts) in results.items():
        parts = dict(parts)
        runner = [a + b for a, b in zip(parts["  runner.launch"], parts["  runner.collect"])]
        parts[RUNNER_REST] = [run - sum(p) for run, *p in zip(runner, *(
            parts[label] for label, _, _ in PARTS if label.startswith("    ")))]
        parts[ENGINE_REST] = [step - sum(p) for step, *p in zip(parts["engine._step"], *(
            parts[label] for label, _, _ in PARTS if label.startswith("  ") and not label.startswith("   ")))]
        parts[ENGINE_SIDE] = [a - b for a, b in zip(parts["engine._step"], runner)]
        parts[HOST] = [a - b for a, b in zip(parts["engine._step"], parts["    sampler (device work)"])]
        rows["step (loop included)"][case] = statistics.median(step_times) * 1e3
        for label, values in parts.items():
            rows[label][case] = statistics.median(values or [0.0]) * 1e3
    order = [label for label, _, _ in PARTS]
    order.insert(order.index("  record logprobs"), RUNNER_REST)
    return {label: rows[label] for label in ["step (loop included)", *order, ENGINE_REST, ENGINE_SIDE, HOST]}


def report(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    cases = list(rows["engine._step"])
    print(f"\nhost {'CPU' if args.cpu_time else 'wall'} time per decode step at batch {args.batch}, vocab {args.vocab}, "
          f"model stubbed, "
          f"medians over {args.runs} runs x {args.steps} steps (ms)")
    print(f"{'':34}" + "".join(f"{c:>10}" for c in cases))
    for label, values in rows.items():
        print(f"{label:34}" + "".join(f"{values[c]:10.3f}" for c in cases))


def main() -> None:
    global clock
    args = parse_args()
    if args.cpu_time:
        clock = time.thread_time
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab, args.prompt_len + args.steps + 1)
        with make_llm(model, args) as llm:
            run_case(llm, "greedy", argparse.Namespace(**{**vars(args), "steps": 2}), lambda: None)  # warm-up
            if args.profile:
                for case in cases:
                    profile_case(llm, case, args)
                return
            rows = table({case: time_case(llm, case, args) for case in cases})
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
