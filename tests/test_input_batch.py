"""The persistent input batch: on random schedules (prefix hits, chunked prefill, preemption, aborts, failed steps,
mixed prefill + decode batches) its step inputs, decode ids fed on the device from the last sampled tokens
included, and its sampling metadata equal those built from scratch every step, and rows are released."""
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cuda_fakes import capture_recorded_graphs
from models import random_prompts
from nanoinfer import LLM
from nanoinfer.engine.input_batch import InputBatch, StepBuffers
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.sampling_state import HostStaging, PenaltyCache
from nanoinfer.engine.scheduler import ScheduledBatch, Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.sampler import noise_keys
from nanoinfer.sampling_params import SamplingParams


def reference_prepare(batch: ScheduledBatch, samples: list[bool], block_size: int):
    """ModelRunner.prepare before the persistent batch: everything rebuilt from the sequences every step."""
    input_ids, positions, slots, block_tables = [], [], [], []
    cu_q, cu_k, context_lens, sample_rows = [0], [0], [], []
    for seq, start, n, sampled in zip(batch.seqs, batch.starts, batch.num_new_tokens, samples):
        end = start + n
        table = seq.block_table[:-(-end // block_size)]
        input_ids.extend(seq.token_ids[start:end])
        pos = np.arange(start, end)
        positions.append(pos)
        slots.append(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
        block_tables.append(table)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + end)
        context_lens.append(end)
        if sampled:
            sample_rows.append(cu_q[-1] - 1)
    width = max(map(len, block_tables))
    return dict(
        input_ids=torch.tensor(input_ids), positions=torch.from_numpy(np.concatenate(positions)),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32), cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_q=max(batch.num_new_tokens),
        max_seqlen_k=max(context_lens), has_cached_prefix=cu_k[-1] > cu_q[-1], sample_rows=sample_rows)


def as_dict(input_ids, positions, meta, sample_rows) -> dict:
    return dict(input_ids=input_ids, positions=positions, slot_mapping=meta.slot_mapping,
                block_tables=meta.block_tables, context_lens=meta.context_lens, cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                has_cached_prefix=meta.has_cached_prefix, sample_rows=sample_rows)


def assert_same(got: dict, want: dict) -> None:
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (name, g, w)
        else:
            assert g == w and type(g) is type(w), (name, g, w)


MAX_MODEL_LEN = 96


def run_random_schedule(seed: int, check, params=lambda rng: SamplingParams(), failures: float = 0.0) -> dict:
    """Drive a real Scheduler (16 blocks of 4 tokens, 4 sequences at most, a 13-token budget) over 60 requests
    with shared prefixes, each with params(rng); `check(scheduler, batch, samples, tokens)` sees every step and
    the tokens it samples. A fraction `failures` of the steps fail after the check (never postprocessed).
    Returns what happened."""
    rng = random.Random(seed)
    block_size = 4
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=13, kvcache_block_size=block_size,
                             enable_prefix_caching=True, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=16)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    seqs, stats = [], dict(chunks=0, mixed=0, cached=0, aborts=0, failures=0)
    steps = 0
    while len(seqs) < 60 or not scheduler.is_finished():
        if len(seqs) < 60 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            seq = Sequence(prompt, params(rng), block_size, max_tokens=rng.randint(1, 24),
                           eos_token_ids=frozenset({0}))
            seqs.append(seq)
            scheduler.add(seq)
        if rng.random() < 0.03 and (scheduler.running or scheduler.waiting):  # an abort between steps
            scheduler.finish(rng.choice([*scheduler.running, *scheduler.waiting]))
            stats["aborts"] += 1
        batch = scheduler.schedule()
        if not batch.seqs:
            continue
        steps += 1
        samples = batch.samples
        stats["chunks"] += not all(samples)
        stats["mixed"] += 1 < max(batch.num_new_tokens) and min(batch.num_new_tokens) == 1
        stats["cached"] += sum(s.num_cached_tokens for s, start in zip(batch.seqs, batch.starts)
                               if start == s.num_cached_tokens > 0)
        tokens = [rng.randrange(50) if s else None for s in samples]
        check(scheduler, batch, samples, tokens)
        if failures and rng.random() < failures:
            stats["failures"] += 1
            continue
        for seq in scheduler.postprocess(batch, tokens):
            if seq.num_completion_tokens >= seq.max_tokens:
                scheduler.finish(seq)
    return dict(stats, steps=steps, preemptions=scheduler.num_preemptions)


@pytest.mark.parametrize("seed", range(4))
def test_step_inputs_equal_the_per_step_builder_on_random_schedules(seed):
    batch_inputs = InputBatch(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=13, block_size=4,
                              device=torch.device("cpu"))

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool], tokens: list[int | None]) -> None:
        want = reference_prepare(batch, samples, 4)
        assert_same(as_dict(*batch_inputs.prepare(batch, samples)), want)
        # Only running sequences hold rows (one may sit out a step when the budget runs out).
        assert set(batch_inputs.rows) <= {s.seq_id for s in scheduler.running}

    result = run_random_schedule(seed, check)
    # The schedule exercised what it is meant to: preemption, prefix hits, chunks, mixed batches, row reuse.
    assert result["preemptions"] > 0 and result["cached"] > 0 and result["chunks"] > 0 and result["mixed"] > 0
    assert result["steps"] > 50
    assert len(batch_inputs.free_rows) + len(batch_inputs.rows) == 4


def test_rows_of_finished_and_preempted_sequences_are_released():
    """Finishing 3 sequences and preempting 1 reports their ids with the next non-empty batch, not an empty one."""
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=4,
                             enable_prefix_caching=False, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=8)
    batch_inputs = InputBatch(4, 32, 64, 4, torch.device("cpu"))
    seqs = [Sequence([1, 2, 3, 4, 5, 6, 7], SamplingParams(), 4, max_tokens=8) for _ in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()  # 4 x 2 blocks: the cache is full
    batch_inputs.prepare(batch, batch.samples)
    assert set(batch_inputs.rows) == {s.seq_id for s in seqs}
    scheduler.postprocess(batch, [9] * 4)  # 8 tokens each: the next decode token needs a third block
    for seq in seqs[:2]:
        scheduler.finish(seq)
    batch = scheduler.schedule()  # seqs[2] takes a block, seqs[3] another: both fit now
    assert batch.freed_seq_ids == [seqs[0].seq_id, seqs[1].seq_id]
    batch_inputs.prepare(batch, batch.samples)
    assert set(batch_inputs.rows) == {seqs[2].seq_id, seqs[3].seq_id}
    scheduler.postprocess(batch, [9, 9])
    for seq in seqs[2:]:
        scheduler.finish(seq)
    assert scheduler.schedule().freed_seq_ids == []  # empty batch: the ids wait for one that reaches the runner
    seq = Sequence([5] * 9, SamplingParams(), 4, max_tokens=4)
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.freed_seq_ids == [seqs[2].seq_id, seqs[3].seq_id]
    batch_inputs.prepare(batch, batch.samples)
    assert list(batch_inputs.rows) == [seq.seq_id]
    assert batch_inputs.block_table[:, :3].tolist().count([-1, -1, -1]) == 3  # released rows are blank again


def test_freed_ids_are_sent_again_until_a_step_completes():
    """A step that fails (no postprocess) may not have released the rows: the next batch carries the ids again."""
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, kvcache_block_size=4,
                             enable_prefix_caching=False, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=8)
    a, b = (Sequence([1, 2, 3], SamplingParams(), 4, max_tokens=8) for _ in range(2))
    scheduler.add(a)
    scheduler.add(b)
    scheduler.postprocess(scheduler.schedule(), [7, 7])
    scheduler.finish(a)
    first = scheduler.schedule()
    assert first.freed_seq_ids == [a.seq_id]
    retry = scheduler.schedule()  # the first step failed: nothing was postprocessed
    assert retry.freed_seq_ids == [a.seq_id, b.seq_id]  # b is rolled back (recomputed): a fresh row too
    scheduler.finish(b)  # during the step: reported by a later batch
    scheduler.postprocess(retry, [None])
    assert scheduler.freed_seq_ids == [b.seq_id]


def test_rows_persist_and_only_new_blocks_are_read():
    """A step reads a sequence's block table only where it grew: the host work is O(changed rows)."""
    batch_inputs = InputBatch(2, 32, 32, 4, torch.device("cpu"))
    seq = Sequence(list(range(6)), SamplingParams(), 4)
    seq.block_table = [7, 3]
    batch_inputs.prepare(ScheduledBatch([seq], [6]), [True])
    seq.num_computed_tokens = 6
    seq.token_ids += [1, 2, 3]
    seq.block_table = [0, 0, 5]  # only the third entry is new; a rebuilt table would read the zeros
    _, _, meta, _ = batch_inputs.prepare(ScheduledBatch([seq], [3]), [True])
    assert meta.block_tables.tolist() == [[7, 3, 5]]
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 0]


def test_step_tensors_are_the_staging_buffers_on_the_cpu():
    batch_inputs = InputBatch(2, 32, 32, 4, torch.device("cpu"))
    seq = Sequence(list(range(6)), SamplingParams(), 4)
    seq.block_table = [7, 3]
    ids, pos, meta, _ = batch_inputs.prepare(ScheduledBatch([seq], [6]), [True])
    assert not batch_inputs.host.input_ids.is_pinned()  # pin_memory only on CUDA (it fails on a CPU build)
    assert batch_inputs.to_device(ids, pos, meta) == (ids, pos, meta)
    assert (ids.data_ptr(), meta.block_tables.data_ptr()) == (batch_inputs.host.input_ids.data_ptr(),
                                                              batch_inputs.host.block_tables.data_ptr())
    assert batch_inputs.logit_index([5, 2]).tolist() == [5, 2]


class NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def uploading_input_batch(kind: str) -> InputBatch:
    if kind == "cuda":
        batch_inputs = InputBatch(4, MAX_MODEL_LEN, 13, 4, torch.device("cuda"))
        assert batch_inputs.host.block_tables.is_pinned()
        return batch_inputs
    # The CUDA path's bookkeeping on the CPU: device buffers apart from the staging ones, no event to wait for.
    batch_inputs = InputBatch(4, MAX_MODEL_LEN, 13, 4, torch.device("cpu"))
    batch_inputs.on_cuda, batch_inputs.uploaded = True, NoEvent()
    batch_inputs.device = StepBuffers.allocate(13, 4, batch_inputs.max_blocks, torch.device("cpu"))
    return batch_inputs


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("kind", [CUDA, "separate-cpu-buffers"])
def test_uploads_to_the_device_buffers_equal_the_host_inputs(kind):
    """One copy per tensor from staging into the device buffers; a TP rank's received tensors (not its staging)
    go through its own staging first."""
    batch_inputs, receiver = uploading_input_batch(kind), uploading_input_batch(kind)  # rank 0 and another rank

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool], tokens: list[int | None]) -> None:
        ids, pos, meta, rows = batch_inputs.prepare(batch, samples)
        want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in as_dict(ids, pos, meta, rows).items()}
        received = [ids.clone(), pos.clone(), dataclasses.replace(meta, **{
            f: getattr(meta, f).clone() for f in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q",
                                                  "cu_seqlens_k")})]
        for runner_inputs, args in ((batch_inputs, (ids, pos, meta)), (receiver, received)):
            d_ids, d_pos, d_meta = runner_inputs.to_device(*args)
            index = runner_inputs.logit_index(rows)
            runner_inputs.record_uploads()
            assert d_meta.block_tables.data_ptr() == runner_inputs.device.block_tables.data_ptr()
            assert d_ids.data_ptr() == runner_inputs.device.input_ids.data_ptr() != ids.data_ptr()
            got = {k: v.cpu() if isinstance(v, torch.Tensor) else v
                   for k, v in as_dict(d_ids, d_pos, d_meta, rows).items()}
            assert index.tolist() == rows
            assert_same(got, want)

    run_random_schedule(0, check)


@pytest.mark.parametrize("kind", [CUDA, "separate-cpu-buffers", "cpu"])
def test_decode_ids_fed_from_the_last_sampled_tokens_equal_the_host_ids(kind):
    """Each step's ids after feed_sampled (decode tokens from last_sampled, on the device) equal the host's,
    through preemption, prefix hits, aborts and failed steps (sampled, never appended), and most decode tokens are
    fed: a wrong or stale token in last_sampled, or a feed where the host's token was not the sampled one (a
    one-token prompt, a prefix hit leaving one token, a recompute), shows up as a wrong id."""
    batch_inputs = InputBatch(4, MAX_MODEL_LEN, 13, 4, torch.device("cpu")) if kind == "cpu" \
        else uploading_input_batch(kind)
    counts = dict(fed=0, decode=0)

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool], tokens: list[int | None]) -> None:
        ids, pos, meta, _ = batch_inputs.prepare(batch, samples)
        want = ids.clone()
        d_ids, _, _ = batch_inputs.to_device(ids, pos, meta)
        batch_inputs.feed_sampled(d_ids)
        batch_inputs.record_uploads()
        assert d_ids.cpu().tolist() == want.tolist()
        counts["fed"] += batch_inputs.num_fed
        counts["decode"] += sum(n == 1 and start > s.num_prompt_tokens
                                for s, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens))
        sampled = torch.tensor([t for t in tokens if t is not None], dtype=torch.int64)
        batch_inputs.record_sampled(sampled.to(batch_inputs.last_sampled.device))

    result = run_random_schedule(1, check, failures=0.05)
    assert result["failures"] > 0 and result["preemptions"] > 0 and result["cached"] > 0
    assert counts["fed"] > 0.8 * counts["decode"] > 0, counts


def fed_ids(batch_inputs: InputBatch, seqs: list[Sequence], num_new: list[int]) -> list[int]:
    """The step's input ids after feed_sampled (the CPU: the staging buffer is the step's tensor)."""
    batch = ScheduledBatch(seqs, num_new)
    ids, _, _, _ = batch_inputs.prepare(batch, batch.samples)
    batch_inputs.feed_sampled(ids)
    return ids.tolist()


def test_last_sampled_feeds_only_the_position_it_was_sampled_for():
    """A step that sampled token 42 but was never postprocessed, retried without a rollback, recomputes the same
    token from the host; and a row's next owner, whose first step is one token (a prefix hit) at the position
    the former owner's token was sampled for, never gets that token."""
    batch_inputs = InputBatch(2, 32, 32, 4, torch.device("cpu"))
    a = Sequence([5, 6, 7], SamplingParams(), 4)
    a.block_table = [3]
    assert fed_ids(batch_inputs, [a], [3]) == [5, 6, 7]
    a.token_ids.append(8)  # sampled 8, appended
    a.num_computed_tokens = 3
    batch_inputs.record_sampled(torch.tensor([8]))
    assert fed_ids(batch_inputs, [a], [1]) == [8] and batch_inputs.num_fed == 1
    batch_inputs.record_sampled(torch.tensor([42]))  # the step fails before its token is appended
    assert fed_ids(batch_inputs, [a], [1]) == [8] and batch_inputs.num_fed == 0
    batch_inputs.record_sampled(torch.tensor([9]))
    b = Sequence([5, 6, 7, 8, 1], SamplingParams(), 4)  # a's row, after a finished: 4 tokens from the cache
    b.block_table, b.num_computed_tokens = [3, 0], 4
    batch = ScheduledBatch([b], [1], freed_seq_ids=[a.seq_id])
    ids, _, _, _ = batch_inputs.prepare(batch, batch.samples)
    batch_inputs.feed_sampled(ids)
    assert batch_inputs.rows[b.seq_id] == 0 and ids.tolist() == [1] and batch_inputs.num_fed == 0


def test_no_ids_are_fed_with_feed_sampled_ids_off():
    """Tensor parallelism: the host's ids stand (the other ranks receive them; only rank 0 samples)."""
    batch_inputs = InputBatch(4, MAX_MODEL_LEN, 13, 4, torch.device("cpu"), feed_sampled_ids=False)

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool], tokens: list[int | None]) -> None:
        batch_inputs.prepare(batch, samples)
        assert batch_inputs.num_fed == 0
        batch_inputs.record_sampled(torch.tensor([t for t in tokens if t is not None], dtype=torch.int64))
        assert (batch_inputs.sampled_at == -1).all()

    run_random_schedule(2, check)


# ---- sampling parameters as rows ----

VOCAB = 50


def mixed_params(rng: random.Random) -> SamplingParams:
    """Every sampling feature, each in about half of the requests; a third greedy, some seeded."""
    def maybe(value, default):
        return value if rng.random() < 0.5 else default
    return SamplingParams(
        temperature=0.0 if rng.random() < 0.3 else rng.choice([0.5, 1.0, 1.7]), top_k=maybe(rng.randint(1, 60), -1),
        top_p=maybe(rng.choice([0.3, 0.9]), 1.0), min_p=maybe(0.1, 0.0), repetition_penalty=maybe(1.3, 1.0),
        presence_penalty=maybe(0.5, 0.0), frequency_penalty=maybe(-0.4, 0.0), seed=maybe(rng.randrange(2**64), None),
        min_tokens=maybe(rng.randint(1, 4), 0), stop_token_ids=maybe([rng.randrange(VOCAB)], None),
        logprobs=maybe(rng.randint(0, 3), None), max_tokens=None)


class ReferenceSampling:
    """SamplingMetadata's contents rebuilt from the sequences every step (the runner's former builder), with
    unseeded sequences' seeds drawn from random.Random(0) the first time a step samples at temperature."""

    def __init__(self) -> None:
        self.rng, self.seeds = random.Random(0), {}

    def __call__(self, seqs: list[Sequence]) -> dict:
        params = [s.params for s in seqs]
        temperatures = [p.temperature for p in params]
        ref = dict(temperatures=torch.tensor(temperatures), all_greedy=not any(temperatures),
                   all_random=all(temperatures), noise_keys=None, top_k=None, top_p=None, min_p=None,
                   num_logprobs=None, banned=set(), penalties=None, max_top_k=None)
        if not ref["all_greedy"]:
            for s in seqs:
                if s.seq_id not in self.seeds:
                    self.seeds[s.seq_id] = s.params.seed if s.params.seed is not None else self.rng.getrandbits(64)
            ref["noise_keys"] = torch.from_numpy(noise_keys(np.array([self.seeds[s.seq_id] for s in seqs], np.uint64),
                                                            np.array([len(s) for s in seqs], np.uint64)))
        if any(0 < p.top_k < VOCAB for p in params):
            ref["top_k"] = torch.tensor([p.top_k for p in params])
            # The cuts rank only this many logits unless a row has top-p without top-k.
            if not any(p.top_p < 1 and not 0 < p.top_k < VOCAB for p in params):
                ref["max_top_k"] = max(p.top_k for p in params if 0 < p.top_k < VOCAB)
        if any(p.top_p < 1 for p in params):
            ref["top_p"] = torch.tensor([p.top_p for p in params])
        if any(p.min_p > 0 for p in params):
            ref["min_p"] = torch.tensor([p.min_p for p in params])
        if any(p.logprobs is not None for p in params):
            ref["num_logprobs"] = max(p.logprobs or 0 for p in params)
        ref["banned"] = {(i, t) for i, s in enumerate(seqs) if s.num_completion_tokens < s.params.min_tokens
                         for t in (*s.eos_token_ids, *s.params.stop_token_ids)}
        rows = [i for i, p in enumerate(params) if p.penalized]
        if rows:
            counts = torch.stack([torch.bincount(torch.tensor(seqs[i].completion_token_ids, dtype=torch.long),
                                                 minlength=VOCAB).float() for i in rows])
            mask = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
            for j, i in enumerate(rows):
                mask[j, seqs[i].token_ids[:seqs[i].num_prompt_tokens]] = True
            ref["penalties"] = dict(rows=torch.tensor(rows), repetition=torch.tensor(
                [params[i].repetition_penalty for i in rows]), presence=torch.tensor(
                [params[i].presence_penalty for i in rows]), frequency=torch.tensor(
                [params[i].frequency_penalty for i in rows]), prompt_mask=mask, output_counts=counts)
        return ref


def as_reference(m) -> dict:
    got = {f: getattr(m, f) for f in ("temperatures", "all_greedy", "all_random", "noise_keys", "top_k", "top_p",
                                      "min_p", "num_logprobs", "max_top_k")}
    got["banned"] = set() if m.banned is None else set(zip(*(t.tolist() for t in m.banned)))
    got["penalties"] = None if m.penalties is None else dict(vars(m.penalties))
    return got


def assert_same_metadata(got: dict, want: dict) -> None:
    for name, w in want.items():
        g = got[name]
        if isinstance(w, dict):
            assert g is not None, name
            assert_same_metadata(g, w)
        elif isinstance(w, torch.Tensor):
            assert g is not None and g.dtype == w.dtype and torch.equal(g, w), (name, g, w)
        else:
            assert g == w, (name, g, w)


def sampling_runner() -> ModelRunner:
    """The host half of a ModelRunner on the CPU: its input batch and what its sampling metadata needs."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.seeds = torch.device("cpu"), random.Random(0)
    runner.input_batch = InputBatch(4, MAX_MODEL_LEN, 13, 4, runner.device)
    runner.upload = HostStaging(runner.device)
    runner.penalty_cache = PenaltyCache(runner.upload)
    runner.logits_processors, runner.config = None, SimpleNamespace(logprobs_mode="raw_logprobs")
    return runner


@pytest.mark.parametrize("seed", range(3))
def test_sampling_metadata_from_rows_equals_the_one_built_from_scratch(seed):
    """Rows are taken, reused and released as sequences come and go with mixed parameters (preemption, aborts):
    each step's metadata gathered from the rows equals the one rebuilt from its sequences, seeds drawn in the
    same order included."""
    runner, reference = sampling_runner(), ReferenceSampling()
    seen = dict(steps=0, penalties=0, banned=0, drawn=0, top_p_in_top_k=0, top_p_sorted=0)

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool], tokens: list[int | None]) -> None:
        runner.input_batch.prepare(batch, samples)
        seqs = [s for s, sampled in zip(batch.seqs, samples) if sampled]
        if not seqs:
            return
        want = reference(seqs)
        assert_same_metadata(as_reference(runner._sampling_metadata(seqs, VOCAB)), want)
        seen["steps"] += 1
        seen["penalties"] += want["penalties"] is not None
        seen["banned"] += bool(want["banned"])
        if want["top_k"] is not None and want["top_p"] is not None:
            seen["top_p_sorted" if want["max_top_k"] is None else "top_p_in_top_k"] += 1
        seen["drawn"] = len(reference.seeds)

    result = run_random_schedule(seed, check, params=mixed_params)
    assert result["preemptions"] > 0 and result["aborts"] > 0
    assert seen["steps"] > 50 and seen["penalties"] > 10 and seen["banned"] > 10 and seen["drawn"] > 20, seen
    assert seen["top_p_in_top_k"] > 5 and seen["top_p_sorted"] > 5, seen


# ---- the engine: decode ids from the device ----

def engine(model_dir, graphs: bool) -> LLM:
    """A small cache and token budget (preemption, chunks); graphs: decode through the CUDA-graph runner's
    static buffers (RecordedGraph, with the C decode kernel, which reads only those buffers)."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=96, kvcache_block_size=8,
              num_kvcache_blocks=14, max_num_batched_tokens=32, max_num_seqs=6)
    if graphs:
        runner = llm.llm_engine.model_runner
        if not runner.backend.decode_kernel:
            pytest.skip("the CPU decode kernel is not built: the PyTorch decode is not graph-safe")
        capture_recorded_graphs(runner)
    return llm


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph-runner"])
def test_engine_feeds_decode_ids_from_the_sampled_tokens(graphs, qwen3_dir, monkeypatch):
    """Greedy and seeded requests, n = 2, shared prefixes, preemption and a failed step: every fed id equals the
    host's, most decode ids are fed, and a corrupted last_sampled changes the outputs (the ids are really taken
    from it, in the eager and the graph path)."""
    llm = engine(qwen3_dir, graphs)
    counts = dict(fed=0, graph_fed=0)
    feed, record = InputBatch.feed_sampled, InputBatch.record_sampled

    def checked_feed(self, input_ids):
        index, rows = self.host.fed_index[:self.num_fed], self.host.fed_rows[:self.num_fed]
        assert torch.equal(input_ids[index], self.last_sampled[rows])  # the host's ids, before they are replaced
        counts["fed"] += self.num_fed
        counts["graph_fed"] += self.num_fed * (input_ids.data_ptr() != self.host.input_ids.data_ptr())
        feed(self, input_ids)

    monkeypatch.setattr(InputBatch, "feed_sampled", checked_feed)
    shared = random_prompts(1, 5, 440, 20, 20, seed=31)[0]
    prompts = [shared + p for p in random_prompts(3, 5, 440, 1, 12, seed=32)] + random_prompts(3, 5, 440, 2, 30,
                                                                                                 seed=33)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)] * 3

    def generate() -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = generate()
    assert llm.llm_engine.scheduler.num_preemptions > 0
    total = sum(len(t) for o in expected for t in o)
    assert counts["fed"] > total // 2, counts
    assert (counts["graph_fed"] > 0) == graphs
    runner, steps = llm.llm_engine.model_runner, []
    run = runner.launch

    def failing_run(batch):
        out = run(batch)  # sampled, and recorded in last_sampled
        steps.append(1)
        if len(steps) == 6:
            raise RuntimeError("failed after sampling")
        return out

    monkeypatch.setattr(runner, "launch", failing_run)
    with pytest.raises(RuntimeError, match="failed after sampling"):
        generate()
    assert generate() == expected
    monkeypatch.setattr(InputBatch, "record_sampled",
                        lambda self, token_ids: record(self, (token_ids + 1) % llm.llm_engine.vocab_size))
    monkeypatch.setattr(InputBatch, "feed_sampled", feed)
    assert generate() != expected
