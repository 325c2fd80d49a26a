"""Run by test_tensor_parallel.py as `torchrun --standalone --nproc_per_node=2 tp_torchrun.py OUT MODEL_DIR...`.

Every rank builds each model's LLM in turn (tensor_parallel_size=2), generates, embeds, and writes what it got
to OUT/rank<R>.json. Then rank 1 kills itself in the middle of a generate call, and rank 0 records how long it took
to raise and what it said (OUT/killed.json), unless torchrun stops it first.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import random_prompts, weight_bytes  # noqa: E402

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.engine.model_runner import ModelRunner  # noqa: E402

MAX_TOKENS = 16
PROMPTS = random_prompts(6, 5, 440, 2, 90, seed=11) + [[17]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(len(PROMPTS))]


def run(model: str) -> dict:
    with LLM(model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2) as llm:
        greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        sampled = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
        try:
            llm.embed([[1, 2], []])  # refused on rank 0: every rank raises it
            bad_embed = None
        except ValueError as e:
            bad_embed = str(e)
        return dict(greedy=[o.outputs[0].token_ids for o in greedy],
                    sampled=[o.outputs[0].token_ids for o in sampled], embedding=embeddings(llm), bad_embed=bad_embed,
                    weight_bytes=weight_bytes(llm.llm_engine.model_runner.model), threads=torch.get_num_threads())


def embeddings(llm: LLM) -> list[list[float]]:
    """The prompts' mean-pooled bidirectional embeddings, then their last-token causal ones."""
    return [o.outputs.embedding for causal in (False, True)
            for o in llm.embed(PROMPTS, pooling="last" if causal else "mean", causal=causal)]


def die_mid_generation(model: str, out: Path, rank: int) -> None:
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256, tensor_parallel_size=2)
    if rank == 1:
        execute, calls = ModelRunner.execute, []

        def execute_then_die(self, *step):
            calls.append(1)
            if len(calls) == 3:
                (out / "kill_time").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return execute(self, *step)

        ModelRunner.execute = execute_then_die
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    except RuntimeError as e:
        raised = time.time()
        (out / "killed.json").write_text(json.dumps(dict(raised=raised, error=str(e), closed=llm.llm_engine.closed)))
        sys.exit(1)
    sys.exit(0)  # not expected: the test fails on a clean exit


def main() -> None:
    out, models = Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ["RANK"])
    results = {Path(m).name: run(m) for m in models}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    die_mid_generation(models[0], out, rank)


if __name__ == "__main__":
    main()
