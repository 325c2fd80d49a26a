"""Host time of ModelRunner's non-model work for decode steps at batch 256, contexts ~4k tokens, 16-token blocks: its
prepare, its sampling-metadata build (per sampling mix), and a whole run() around a stub model (no attention, fixed
logits over a small vocabulary, so that what is timed is the host side, not the sampler's arithmetic).

    PYTHONPATH=. python scripts/bench_prepare.py      (PYTHONPATH=<an older checkout> times that checkout instead)
"""
import random
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.sampling_params import SamplingParams

BATCH, CONTEXT, BLOCK, STEPS, WARM, VOCAB, HIDDEN = 256, 4096, 16, 60, 5, 256, 8

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "temperature+top_p": lambda i: SamplingParams(temperature=0.6, top_p=0.9),
    "every feature": lambda i: SamplingParams(
        temperature=0.8 if i % 4 else 0.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.2, frequency_penalty=0.1, min_tokens=8, logprobs=2, seed=i if i % 2 else None),
}


class StubModel(nn.Module):
    """Hidden states of zeros and the same random logits every step."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, positions, meta):
        return torch.zeros(input_ids.shape[0], HIDDEN)

    def compute_logits(self, hidden):
        return self.logits[:hidden.shape[0]]


class NoBackend:
    def prepare(self, meta) -> None:
        pass


def stub_runner() -> ModelRunner:
    """A real ModelRunner (its own constructor, so any checkout builds its own state) around StubModel."""
    config = SimpleNamespace(
        device="cpu", kvcache_block_size=BLOCK, max_num_seqs=BATCH, max_model_len=CONTEXT + STEPS + 64,
        max_num_batched_tokens=8192, num_kvcache_blocks=1, attention_backend="cpu", torch_dtype=torch.float32,
        enforce_eager=True, seed=0, hf_config=SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB))
    load = ModelRunner._load_model
    ModelRunner._load_model = staticmethod(lambda config, device: StubModel())
    try:
        runner = ModelRunner(config)
    finally:
        ModelRunner._load_model = load
    runner.backend = NoBackend()
    return runner


def decode_batch(rng: random.Random, mix) -> list[Sequence]:
    seqs = []
    for i in range(BATCH):
        n = CONTEXT - rng.randint(0, 64)
        seq = Sequence([rng.randrange(VOCAB) for _ in range(n)], mix(i), BLOCK, eos_token_ids=frozenset({0}))
        seq.block_table = [rng.randrange(100000) for _ in range(seq.num_blocks)]
        seq.num_computed_tokens, seq.status = n - 1, SequenceStatus.RUNNING
        seqs.append(seq)
    return seqs


def advance(seqs: list[Sequence], tokens: list[int], rng: random.Random) -> None:
    """What postprocess and the block manager do between steps."""
    for seq, token in zip(seqs, tokens):
        seq.num_computed_tokens += 1
        seq.token_ids.append(token)
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(rng.randrange(100000))


def report(name: str, times: list[float]) -> None:
    times = times[WARM:]
    print(f"{name}: median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms "
          f"over {len(times)} steps")


def time_steps(mix, step) -> list[float]:
    """step(runner, batch) -> (seconds, sampled tokens), over STEPS decode steps of a fresh runner and batch."""
    rng = random.Random(0)
    runner, seqs = stub_runner(), decode_batch(rng, mix)
    times = []
    for _ in range(STEPS):
        seconds, tokens = step(runner, ScheduledBatch(seqs, [1] * BATCH))
        times.append(seconds)
        advance(seqs, tokens, rng)
    return times


def prepare_step(runner: ModelRunner, batch: ScheduledBatch) -> tuple[float, list[int]]:
    t = time.perf_counter()
    runner.prepare(batch, batch.samples)
    return time.perf_counter() - t, [1] * BATCH


def metadata_step(runner: ModelRunner, batch: ScheduledBatch) -> tuple[float, list[int]]:
    """prepare, untimed (it gives the step's rows), then the metadata build alone; tokens from a full run."""
    runner.prepare(batch, batch.samples)
    t = time.perf_counter()
    runner._sampling_metadata(batch.seqs, VOCAB)
    seconds = time.perf_counter() - t
    return seconds, runner.run(batch).token_ids


def run_step(runner: ModelRunner, batch: ScheduledBatch) -> tuple[float, list[int]]:
    t = time.perf_counter()
    tokens = runner.run(batch).token_ids
    return time.perf_counter() - t, tokens


def main() -> None:
    torch.set_num_threads(1)
    print(f"decode at batch {BATCH}, context ~{CONTEXT}, block {BLOCK}, stub model with vocabulary {VOCAB}")
    report("prepare", time_steps(MIXES["greedy"], prepare_step))
    for name, mix in MIXES.items():
        report(f"sampling metadata, {name}", time_steps(mix, metadata_step))
    for name, mix in MIXES.items():
        report(f"run() around the stub model, {name}", time_steps(mix, run_step))


if __name__ == "__main__":
    main()
