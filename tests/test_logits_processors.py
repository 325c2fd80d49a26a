"""Custom logits processors (vLLM v1's interface, LLM(logits_processors=[...])): the BatchUpdates keep a processor's
per-index state on the right rows through requests joining, finishing, preempted and readmitted; processors run in
vLLM's places (argmax-changing ones for every row, argmax-invariant ones for random rows only); per-request functions
through AdapterLogitsProcessor; extra_args validated; bad settings refused by name."""
import random

import pytest
import torch
from models import build_encoder, random_prompts

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.logits_processors import batch_update
from nanoinfer.engine.sequence import Sequence
from nanoinfer.logits_processor import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality,
                                        OutputTokenIds, process_dict_updates)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128)
VOCAB = 512  # the tiny models' vocabulary (tests/models.py)


class ForcedCount(LogitsProcessor):
    """Rows whose extra_args hold "count_from" c must emit c, c + 1, ...: the state (a start per index) kept through
    the BatchUpdates, the position read from the live output ids. A stale or misplaced index shows as a wrong token."""

    def __init__(self, config, device, is_pin_memory):
        self.starts: dict[int, tuple[int, OutputTokenIds]] = {}

    @classmethod
    def validate_params(cls, params):
        start = (params.extra_args or {}).get("count_from")
        if start is not None and not (isinstance(start, int) and 0 <= start < VOCAB - 64):
            raise ValueError(f"count_from must be an int in [0, {VOCAB - 64}), got {start!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.starts, batch_update, lambda params, prompt_ids, output_ids: (
            None if (start := (params.extra_args or {}).get("count_from")) is None else (start, output_ids)))

    def apply(self, logits):
        for index, (start, output_ids) in self.starts.items():
            vocab = torch.arange(logits.shape[1], device=logits.device)
            logits[index] = torch.where(vocab == start + len(output_ids), 0.0, -torch.inf)
        return logits


class EchoPrompt(AdapterLogitsProcessor):
    """Per request with extra_args {"echo": True}: emit the prompt's tokens from its first on (a function of prompt
    and output ids, vLLM v0's three-argument form)."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("echo"):
            return None

        def echo(prompt_ids, output_ids, row):
            keep = prompt_ids[len(output_ids) % len(prompt_ids)]
            return torch.where(torch.arange(row.shape[0], device=row.device) == keep, row, -torch.inf)
        return echo


class OnlyToken7WhenRandom(LogitsProcessor):
    """Claims argmax invariance (falsely, to make it visible): every row it is applied to can only emit token 7."""

    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        logits[:, :7] = logits[:, 8:] = -torch.inf
        return logits


def simulate(layout: list, update: BatchUpdate | None, limit: int) -> list:
    """Apply a BatchUpdate to a list of seq_ids (None: an empty index) as a processor would."""
    if update is None:
        return layout
    layout = layout + [None] * (limit - len(layout))
    for i in update.removed:
        assert layout[i] is not None
        layout[i] = None
    for i, params, prompt_ids, output_ids in update.added:
        assert layout[i] is None, "an added request landed on a kept one"
        layout[i] = params.extra_args["id"]
    for a, b, direction in update.moved:
        if direction is MoveDirectionality.SWAP:
            layout[a], layout[b] = layout[b], layout[a]
        else:
            assert layout[b] is None, "a one-way move overwrote a kept request"
            layout[a], layout[b] = None, layout[a]
    return layout


def test_batch_updates_turn_each_batch_into_the_next():
    rng = random.Random(0)
    pool = [Sequence([1, 2], SamplingParams(extra_args={"id": i}), 16) for i in range(12)]
    by_id = {seq.seq_id: i for i, seq in enumerate(pool)}
    previous, layout = [], []
    for _ in range(2000):
        seqs = rng.sample(pool, rng.randint(0, 8))
        limit = max(len(previous), len(seqs))
        update = batch_update(previous, seqs)
        assert (update is None) == ([s.seq_id for s in seqs] == previous)
        layout = simulate(layout, update, limit)  # every index it uses is below `limit`
        assert layout[:len(seqs)] == [by_id[s.seq_id] for s in seqs] and not any(layout[len(seqs):])
        assert update is None or update.batch_size == len(seqs)
        previous, layout = [s.seq_id for s in seqs], layout[:len(seqs)]


def test_output_token_ids_is_a_live_view():
    seq = Sequence([5, 6, 7], SamplingParams(), 16)
    view = OutputTokenIds(seq)
    assert len(view) == 0 and list(view) == []
    seq.token_ids += [9, 4]
    assert len(view) == 2 and view[0] == 9 and view[-1] == 4 and view[:] == [9, 4] and 4 in view
    with pytest.raises(IndexError):
        view[2]


def test_processor_state_follows_requests_through_joins_finishes_and_preemption(qwen3_dir):
    """Requests of different lengths arrive over several steps, and a small cache preempts some: each one's counting
    and echoing stay on its own row; requests without extra_args get the same tokens as without processors."""
    prompts = random_prompts(10, 5, VOCAB, 8, 40, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True,
                             extra_args={"count_from": 17 * i} if i % 3 == 0 else {"echo": True} if i % 3 == 1
                             else None) for i in range(10)]
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(str(qwen3_dir), **ENGINE, num_kvcache_blocks=12, max_num_seqs=6,
             logits_processors=[ForcedCount, EchoPrompt]) as llm:
        engine, outs, added = llm.llm_engine, {}, 0
        while added < len(prompts) or engine.has_unfinished_requests():
            if added < len(prompts):  # one more request each step
                engine.add_request(str(added), prompts[added], params[added])
                added += 1
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.scheduler.num_preemptions > 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tokens = outs[str(i)].outputs[0].token_ids
        if i % 3 == 0:
            assert tokens == list(range(17 * i, 17 * i + p.max_tokens)), i
        elif i % 3 == 1:
            assert tokens == [prompt[j % len(prompt)] for j in range(p.max_tokens)], i
        else:
            assert tokens == want[i].outputs[0].token_ids, i


def test_argmax_invariant_processors_skip_greedy_rows(qwen3_dir):
    prompts = random_prompts(4, 5, VOCAB, 8, 20, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)
    with LLM(str(qwen3_dir), **ENGINE) as plain:
        want = plain.generate(prompts, greedy, use_tqdm=False)
    with LLM(str(qwen3_dir), **ENGINE, logits_processors=[OnlyToken7WhenRandom]) as llm:
        outs = llm.generate(prompts, [greedy, sampled, greedy, sampled], use_tqdm=False)
        # logprobs stay those of the raw distribution, as vLLM's
        lp = llm.generate(prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=2, logprobs=0),
                          use_tqdm=False)[0].outputs[0].logprobs
    assert [o.outputs[0].token_ids for o in outs[::2]] == [w.outputs[0].token_ids for w in want[::2]]
    assert all(o.outputs[0].token_ids == [7] * 5 for o in outs[1::2])
    assert lp[0][7].logprob < -1e-3


def test_with_async_scheduling_no_step_runs_ahead(qwen3_dir):
    prompts = random_prompts(3, 5, VOCAB, 8, 20, seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args={"count_from": 40})
    with LLM(str(qwen3_dir), **ENGINE, async_scheduling=True, logits_processors=[ForcedCount]) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_steps_ahead == 0
    assert all(o.outputs[0].token_ids == list(range(40, 48)) for o in outs)


def test_processors_named_by_module_and_class(qwen3_dir):
    with LLM(str(qwen3_dir), **ENGINE, logits_processors=["test_logits_processors:ForcedCount"]) as llm:
        out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                     extra_args={"count_from": 9}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [9, 10, 11]
    assert all(lp[t].logprob < -1e-3 for lp, t in zip(out.logprobs, out.token_ids))  # of the raw distribution


def test_tensor_parallel_rank_0_runs_the_processors(qwen3_dir):
    """The workers get no processors (their classes may not import there: this module is not on their path)."""
    params = SamplingParams(temperature=0, max_tokens=4, extra_args={"count_from": 3})
    with LLM(str(qwen3_dir), **ENGINE, tensor_parallel_size=2, logits_processors=[ForcedCount]) as llm:
        assert llm.generate([[4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids == [3, 4, 5, 6]


def test_bad_extra_args_are_refused_by_the_processor(qwen3_dir):
    with LLM(str(qwen3_dir), **ENGINE, logits_processors=[ForcedCount]) as llm:
        with pytest.raises(ValueError, match="count_from must be an int"):
            llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2),
                                            SamplingParams(extra_args={"count_from": "x"})], use_tqdm=False)
        assert llm.generate([1, 2], SamplingParams(temperature=0, max_tokens=2, extra_args={"count_from": 5}),
                            use_tqdm=False)[0].outputs[0].token_ids == [5, 6]
    with pytest.raises(TypeError, match="extra_args must be a dict, got list"):
        SamplingParams(extra_args=[1])


@pytest.mark.parametrize("value, exc, match", [
    (ForcedCount, TypeError, "logits_processors must be a list"),
    ("test_logits_processors:ForcedCount", TypeError, "logits_processors must be a list"),
    ([int], TypeError, "is not a subclass of nanoinfer.logits_processor.LogitsProcessor"),
    (["test_logits_processors.ForcedCount"], ValueError, "must be a class or 'module:Class'"),
    (["no_such_module_here:X"], ValueError, "cannot import 'no_such_module_here'"),
    (["test_logits_processors:Missing"], ValueError, "test_logits_processors has no Missing"),
])
def test_bad_logits_processors_are_refused(qwen3_dir, value, exc, match):
    with pytest.raises(exc, match=match):
        LLM(str(qwen3_dir), **ENGINE, logits_processors=value)


def test_logits_processors_refused_with_drafts_and_for_pooling_models(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="cannot be combined with speculative_config"):
        LLM(str(qwen3_dir), **ENGINE, logits_processors=[ForcedCount],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only pools .* takes no logits_processors"):
        LLM(str(build_encoder("bert", tmp_path / "bert")), device="cpu", logits_processors=[ForcedCount])
