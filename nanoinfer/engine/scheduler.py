"""Continuous batching: decides which sequences run each step and how many tokens each computes."""
from bisect import insort
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.spec_decode.config import SpeculativeConfig
from nanoinfer.spec_decode.ngram import NgramProposer


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step, from starts[i] on
    # Sequences that left the running set since the previous batch (after a failed step, since the last completed one).
    freed_seq_ids: list[int] = field(default_factory=list)
    # Where each sequence's new tokens start: its num_computed_tokens when scheduled (schedule() advances it).
    starts: list[int] | None = None
    # Whether each sequence's scheduled tokens reach its end, so that its next token is sampled: fixed when the
    # batch is made (the step's postprocess grows the sequences).
    samples: list[bool] | None = None
    num_running: int = 0  # seqs[:num_running] were running before this step; the rest were admitted by it
    # Speculative decoding: batch index -> draft tokens computed after the sequence's last token (counted in
    # num_new_tokens; all their positions are sampled and verified).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.starts is None:
            self.starts = [s.num_computed_tokens for s in self.seqs]
        if self.samples is None:
            self.samples = [start + n == len(s) for s, start, n in zip(self.seqs, self.starts, self.num_new_tokens)]

    @property
    def is_prefill(self) -> bool:
        return max(self.num_new_tokens, default=0) > 1


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, num_state_slots: int = 0, max_loras: int = 1,
                 speculative: SpeculativeConfig | None = None):
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences, at most (config.max_loras)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_size = config.kvcache_block_size
        # A cached prefix would bring K/V but no recurrent state (that exists only at a sequence's end): models with
        # linear attention compute every prompt in full.
        self.block_manager = BlockManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching and not num_state_slots, num_state_slots)
        # In admission order (fcfs); with scheduling_policy="priority", both queues stay in (priority, arrival) order,
        # so that the running sequence preempted first (the last) is the one that ranks last, as in vLLM.
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_steps_ahead = 0  # steps scheduled ahead (async scheduling)
        self.freed_seq_ids: list[int] = []  # preempted or finished since the last batch, which reports them
        # Reported by the batches in flight, in order: reported again after a failed step, which may not have read them.
        # Only then: a batch scheduled ahead must not remove the row of a sequence the batch before it readmitted.
        self.freed_in_flight: list[int] = []
        # Scheduled, not postprocessed: one that schedule() finds failed; schedule(ahead=True) runs beside one.
        self.steps_in_flight = 0
        # Drafts (config.speculative), except for models with recurrent state: a rejected draft would have advanced
        # the state, which cannot step back.
        self.proposer = NgramProposer(speculative) if speculative and not num_state_slots else None

    def add(self, seq: Sequence) -> None:
        self._queue(self.waiting, seq)

    def _queue(self, queue: deque[Sequence], seq: Sequence, front: bool = False) -> None:
        """seq into a queue, at its back (front: at its front, as a preempted sequence goes back); by priority, after
        every sequence that does not rank after it in (priority, arrival) order."""
        if self.by_priority:
            insort(queue, seq, key=attrgetter("priority", "seq_id"))
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, ahead: bool = False) -> ScheduledBatch | None:
        """One token budget for everything: each running sequence, in admission order (by priority: in rank order),
        computes what it lacks (a decode token or its next prompt chunk), then waiting sequences are admitted with
        what is left.
        Running sequences keep decoding while long prompts are prefilled chunk by chunk. The scheduled tokens count
        as computed from now on, and each sampled one as pending until postprocess() appends it.

        ahead (async scheduling): the step after the one in flight, scheduled before that one's tokens are known: a
        sequence computes its pending token (the device feeds it), unless it is its last (max_tokens). None when
        nothing can be scheduled so, or when it cannot be (see _can_run_ahead)."""
        if ahead:
            if not self._can_run_ahead():
                return None
        elif self.steps_in_flight:
            self._roll_back()
        self.steps_in_flight += 1  # from the first change on: an interrupted schedule() is a failed step too
        batch, budget = ScheduledBatch([], [], samples=[], starts=[]), self.max_num_batched_tokens
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and seq.num_completion_tokens + seq.num_pending_tokens >= seq.max_tokens:
                i += 1  # its pending token is its last
                continue
            if not self.block_manager.append_slots(seq):  # out of blocks: the last running one goes back (fcfs: the
                self._preempt(self.running.pop())  # latest admitted), seq itself when it is the last: the loop ends
                preempted = True
                continue
            drafts = self._propose(seq, budget, len(self.running) - i - 1) if self.proposer is not None else None
            budget -= self._take_with_drafts(batch, seq, drafts) if drafts else self._take(batch, seq, budget)
            i += 1
        batch.num_running = len(batch.seqs)
        loras: set[int] | None = None  # the running adapters, once a waiting sequence has one
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.lora_int_id:
                loras = {s.lora_int_id for s in self.running if s.lora_int_id} if loras is None else loras
                if seq.lora_int_id not in loras and len(loras) >= self.max_loras:
                    skipped.append(self.waiting.popleft())  # as vLLM: it waits for an adapter slot, others pass
                    continue
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self._queue(self.running, self.waiting.popleft())
            budget -= self._take(batch, seq, budget)
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        if not batch.seqs:
            assert ahead or self.is_finished(), "nothing to schedule: a single sequence must fit the KV cache"
            self.steps_in_flight -= 1
            return None if ahead else batch
        batch.freed_seq_ids, self.freed_seq_ids = self.freed_seq_ids, []
        self.freed_in_flight += batch.freed_seq_ids
        self.num_steps_ahead += ahead
        return batch

    def _can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled beside the one in flight: there are blocks enough for every
        running sequence's next token, so that none is preempted with a token in flight."""
        return self.steps_in_flight == 1 and self.block_manager.num_free_blocks >= len(self.running)

    def _take(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Add seq to the batch with as many of the tokens it lacks as the budget allows; return how many. Its
        blocks filled this step are committed now, so that a prompt admitted later in the same step shares them
        (see BlockManager.commit); they join the prefix cache when the step completes."""
        start, end = seq.num_computed_tokens, len(seq.token_ids) + seq.num_pending_tokens
        sampled = end - start <= budget
        if not sampled:
            end = start + budget
        batch.seqs.append(seq)
        batch.starts.append(start)
        batch.num_new_tokens.append(end - start)
        batch.samples.append(sampled)
        if end // self.block_size > start // self.block_size:  # it fills blocks: those a pending token fills, later
            self.block_manager.commit(seq, min(end, len(seq.token_ids)))
        seq.num_computed_tokens = end
        seq.num_pending_tokens += sampled
        return end - start

    def _propose(self, seq: Sequence, budget: int, num_later: int) -> list[int]:
        """Drafts for a decoding sequence, within what is left of the budget after one token for each later running
        sequence, within max_tokens, and within the blocks free beyond one for each later running sequence: drafts
        never cause a preemption nor starve a running sequence; they shrink or vanish instead. None for a sequence
        that reads its history on the host (Sequence.reads_history) or has penalties (its output counts would have
        to be kept per draft)."""
        if seq.num_computed_tokens != len(seq.token_ids) - 1 or seq.reads_history or seq.params.penalized:
            return []
        limit = min(budget - 1 - num_later, seq.max_tokens - seq.num_completion_tokens - 1)
        if limit <= 0:
            return []
        drafts = self.proposer.propose(seq.seq_id, seq.token_ids, limit)
        return drafts[:self.block_manager.append_lookahead_slots(seq, len(drafts), num_later)] if drafts else drafts

    def _take_with_drafts(self, batch: ScheduledBatch, seq: Sequence, drafts: list[int]) -> int:
        """Add a decoding sequence with its last token and drafts; commit what a plain decode step would (the
        drafts' blocks join the cache once accepted tokens fill them: see commit_accepted)."""
        batch.draft_token_ids[len(batch.seqs)] = drafts
        batch.seqs.append(seq)
        batch.starts.append(seq.num_computed_tokens)
        batch.num_new_tokens.append(1 + len(drafts))
        batch.samples.append(True)
        if len(seq.token_ids) % self.block_size == 0:
            self.block_manager.commit(seq, len(seq.token_ids))
        seq.num_computed_tokens += 1  # the drafts count once accepted (accept_draft)
        seq.num_pending_tokens += 1
        return 1 + len(drafts)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed (prompt and generated tokens) when readmitted."""
        self.block_manager.free(seq)
        self.freed_seq_ids.append(seq.seq_id)
        seq.num_pending_tokens = 0  # a step in flight that sampled it failed (see _roll_back)
        seq.status = SequenceStatus.WAITING
        self._queue(self.waiting, seq, front=True)
        self.num_preemptions += 1

    def _roll_back(self) -> None:
        """The previous step never completed (an exception, Ctrl-C): forget the blocks it committed, report again the
        freed ids it carried, and recompute every running sequence, as after a preemption: one admitted in that step
        may count such blocks as computed."""
        self.block_manager.discard_unpublished()
        self.freed_seq_ids[:0], self.freed_in_flight = self.freed_in_flight, []
        while self.running:
            self._preempt(self.running.pop())
        self.steps_in_flight = 0

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int | None]) -> list[Sequence]:
        """The step completed: publish the blocks committed so far (a step scheduled ahead is queued behind this one
        on the device, so its blocks are written before any later step reads them), append the sampled tokens;
        return the sequences that got one."""
        self.block_manager.publish()
        del self.freed_in_flight[:len(batch.freed_seq_ids)]  # the runner has them
        grown = []
        for seq, token in zip(batch.seqs, token_ids):
            # None: a prompt chunk short of the sequence's end. A sequence that finished while the step was in flight
            # (async scheduling: at the previous step's stop check, or aborted) gets no more tokens.
            if token is None or seq.is_finished:
                continue
            seq.num_pending_tokens -= 1
            seq.token_ids.append(token)
            grown.append(seq)
            # A block this token fills, if a step in flight computes its K/V (async scheduling), is committed now.
            if len(seq.token_ids) % self.block_size == 0 and seq.num_computed_tokens >= len(seq.token_ids):
                self.block_manager.commit(seq, len(seq.token_ids))
        self.steps_in_flight -= 1  # last: interrupted before, the step counts as failed (see _roll_back)
        return grown

    def accept_draft(self, seq: Sequence, token: int) -> None:
        """Append a token that the step verified after the sequence's first new one: its K/V are in the cache."""
        seq.token_ids.append(token)
        seq.num_computed_tokens += 1

    def commit_accepted(self, seq: Sequence) -> None:
        """Publish the blocks that accepted drafts filled (their K/V were written by the completed step)."""
        self.block_manager.commit(seq, seq.num_computed_tokens)
        self.block_manager.publish()

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        self.freed_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)

    def abort_all(self) -> None:
        for seq in (*self.running, *self.waiting):
            self.finish(seq)
