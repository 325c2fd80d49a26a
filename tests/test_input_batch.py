"""The persistent input batch: on random schedules (prefix hits, chunked prefill, preemption, aborts, mixed
prefill + decode batches) its step inputs equal those of the former per-step builder, and rows are released."""
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanoinfer.engine.input_batch import InputBatch, StepBuffers
from nanoinfer.engine.scheduler import ScheduledBatch, Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams


def reference_prepare(batch: ScheduledBatch, samples: list[bool], block_size: int):
    """ModelRunner.prepare before the persistent batch: everything rebuilt from the sequences every step."""
    input_ids, positions, slots, block_tables = [], [], [], []
    cu_q, cu_k, context_lens, sample_rows = [0], [0], [], []
    for seq, n, sampled in zip(batch.seqs, batch.num_new_tokens, samples):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
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


def run_random_schedule(seed: int, check) -> dict:
    """Drive a real Scheduler (16 blocks of 4 tokens, 4 sequences at most, a 13-token budget) over 60 requests
    with shared prefixes; `check(scheduler, batch, samples)` sees every step. Returns what happened."""
    rng = random.Random(seed)
    block_size = 4
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=13, kvcache_block_size=block_size,
                             enable_prefix_caching=True)
    scheduler = Scheduler(config, num_kvcache_blocks=16)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    seqs, stats = [], dict(chunks=0, mixed=0, cached=0, aborts=0)
    steps = 0
    while len(seqs) < 60 or not scheduler.is_finished():
        if len(seqs) < 60 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            seq = Sequence(prompt, SamplingParams(), block_size, max_tokens=rng.randint(1, 24))
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
        stats["cached"] += sum(s.num_cached_tokens for s in batch.seqs if s.num_computed_tokens
                               == s.num_cached_tokens > 0)
        check(scheduler, batch, samples)
        tokens = [rng.randrange(50) if s else None for s in samples]
        for seq in scheduler.postprocess(batch, tokens):
            if seq.num_completion_tokens >= seq.max_tokens:
                scheduler.finish(seq)
    return dict(stats, steps=steps, preemptions=scheduler.num_preemptions)


@pytest.mark.parametrize("seed", range(4))
def test_step_inputs_equal_the_per_step_builder_on_random_schedules(seed):
    batch_inputs = InputBatch(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=13, block_size=4,
                              device=torch.device("cpu"))

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool]) -> None:
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
                             enable_prefix_caching=False)
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
                             enable_prefix_caching=False)
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

    def check(scheduler: Scheduler, batch: ScheduledBatch, samples: list[bool]) -> None:
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
