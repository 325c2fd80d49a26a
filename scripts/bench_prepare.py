"""Host time of ModelRunner.prepare for decode steps at batch 256, contexts ~4k tokens, 16-token blocks (no model).

    PYTHONPATH=. python scripts/bench_prepare.py      (PYTHONPATH=<an older checkout> times its prepare instead)
"""
import random
import statistics
import time

import torch

from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams

BATCH, CONTEXT, BLOCK, STEPS, WARM = 256, 4096, 16, 60, 5


def main() -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    runner = object.__new__(ModelRunner)  # prepare needs no model
    runner.block_size, runner.num_state_slots = BLOCK, 0
    try:
        from nanoinfer.engine.input_batch import InputBatch
        runner.input_batch = InputBatch(BATCH, CONTEXT + STEPS + 64, 8192, BLOCK, torch.device("cpu"))
    except ImportError:  # a checkout from before the persistent batch
        pass
    seqs = []
    for _ in range(BATCH):
        n = CONTEXT - rng.randint(0, 64)
        seq = Sequence([rng.randrange(30000) for _ in range(n)], SamplingParams(), BLOCK)
        seq.block_table = [rng.randrange(100000) for _ in range(seq.num_blocks)]
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    times = []
    for _ in range(STEPS):
        batch = ScheduledBatch(seqs, [1] * BATCH)
        t = time.perf_counter()
        runner.prepare(batch, batch.samples)
        times.append(time.perf_counter() - t)
        for seq in seqs:  # what postprocess and the block manager do between steps, untimed
            seq.num_computed_tokens += 1
            seq.token_ids.append(1)
            if len(seq.block_table) < seq.num_blocks:
                seq.block_table.append(rng.randrange(100000))
    times = times[WARM:]
    print(f"prepare, decode at batch {BATCH}, context ~{CONTEXT}, block {BLOCK}: median "
          f"{statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms over {len(times)} steps")


if __name__ == "__main__":
    main()
