"""Continuous batching: decides which sequences run each step and how many tokens each computes."""
from collections import deque
from dataclasses import dataclass

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step, from seq.num_computed_tokens on

    @property
    def is_prefill(self) -> bool:
        return any(n > 1 for n in self.num_new_tokens)

    @property
    def samples(self) -> list[bool]:
        """Whether each sequence's scheduled tokens reach its end, so that its next token is sampled."""
        return [s.num_computed_tokens + n == len(s) for s, n in zip(self.seqs, self.num_new_tokens)]


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, num_state_slots: int = 0):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = set(config.eos_token_ids)
        # A cached prefix would bring K/V but no recurrent state (that exists only at a sequence's end): models with
        # linear attention compute every prompt in full.
        self.block_manager = BlockManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching and not num_state_slots, num_state_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Prefill work (unfinished prompts first, then new admissions) if there is any, else one decode step."""
        return self._schedule_prefill() or self._schedule_decode()

    def _take(self, batch: ScheduledBatch, seq: Sequence, num_tokens: int) -> int:
        """Add seq to the batch. Its blocks filled this step enter the prefix cache now, so that a prompt
        admitted later in the same step shares them: every layer stores the whole batch's K/V before attending."""
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_tokens)
        self.block_manager.commit(seq, seq.num_computed_tokens + num_tokens)
        return num_tokens

    def _schedule_prefill(self) -> ScheduledBatch | None:
        batch, budget = ScheduledBatch([], []), self.max_num_batched_tokens
        for seq in self.running:  # prompts whose earlier chunks did not cover them
            todo = len(seq) - seq.num_computed_tokens
            if todo > 1 and budget > 0:
                budget -= self._take(batch, seq, min(todo, budget))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            budget -= self._take(batch, seq, min(len(seq) - seq.num_computed_tokens, budget))
        return batch if batch.seqs else None

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slots(seq)
                self._take(batch, seq, 1)
        self.running.extend(batch.seqs)
        assert batch.seqs, "nothing to schedule: a single sequence must always fit the KV cache"
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed (prompt and generated tokens) when readmitted."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int | None]) -> list[Sequence]:
        """Record computed tokens and sampled ones; return the sequences that finished."""
        finished = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, token_ids):
            seq.num_computed_tokens += n
            if token is None:  # a prompt chunk that did not reach the end of the sequence
                continue
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        return None

    def abort_all(self) -> None:
        for seq in (*self.running, *self.waiting):
            if seq.block_table:
                self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        # Blocks are registered when scheduled; an interrupted step may not have written them.
        self.block_manager.reset_prefix_cache()
