"""Continuous batching: decides which sequences run each step and how many tokens each computes."""
from collections import deque
from dataclasses import dataclass, field

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.spec_decode.config import SpeculativeConfig
from nanoinfer.spec_decode.ngram import NgramProposer


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step, from seq.num_computed_tokens on
    freed_seq_ids: list[int] = field(default_factory=list)  # sequences that left the running set since the last batch
    # Whether each sequence's scheduled tokens reach its end, so that its next token is sampled: fixed when the
    # batch is made (the step's postprocess grows the sequences).
    samples: list[bool] | None = None
    num_running: int = 0  # seqs[:num_running] were running before this step; the rest were admitted by it
    # Speculative decoding: batch index -> draft tokens computed after the sequence's last token (counted in
    # num_new_tokens; all their positions are sampled and verified).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = [s.num_computed_tokens + n == len(s) for s, n in zip(self.seqs, self.num_new_tokens)]

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
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.freed_seq_ids: list[int] = []  # preempted or finished, not yet reported to the runner by a completed step
        self.step_in_flight = False  # scheduled but not postprocessed: if the next schedule() finds it so, it failed
        # Drafts (config.speculative), except for models with recurrent state: a rejected draft would have advanced
        # the state, which cannot step back.
        self.proposer = NgramProposer(speculative) if speculative and not num_state_slots else None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """One token budget for everything: each running sequence, in admission order, computes what it lacks
        (a decode token or its next prompt chunk), then waiting sequences are admitted with what is left.
        Running sequences keep decoding while long prompts are prefilled chunk by chunk."""
        if self.step_in_flight:
            self._roll_back()
        self.step_in_flight = True  # from the first change on: an interrupted schedule() is a failed step too
        batch, budget = ScheduledBatch([], [], samples=[]), self.max_num_batched_tokens
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self.block_manager.append_slots(seq):  # out of blocks: the latest admitted goes back
                self._preempt(self.running.pop())  # seq itself when it is the latest: the loop ends
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
            self.running.append(self.waiting.popleft())
            budget -= self._take(batch, seq, budget)
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        assert batch.seqs or self.is_finished(), "nothing to schedule: a single sequence must always fit the KV cache"
        if batch.seqs:  # sent again until a step completes (postprocess): a failed one may not have read them
            batch.freed_seq_ids = self.freed_seq_ids[:]
        return batch

    def _take(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Add seq to the batch with as many of the tokens it lacks as the budget allows; return how many. Its
        blocks filled this step are committed now, so that a prompt admitted later in the same step shares them
        (see BlockManager.commit); they join the prefix cache when the step completes."""
        start, end = seq.num_computed_tokens, len(seq.token_ids)
        sampled = end - start <= budget
        if not sampled:
            end = start + budget
        batch.seqs.append(seq)
        batch.num_new_tokens.append(end - start)
        batch.samples.append(sampled)
        if end // self.block_size > start // self.block_size:  # it fills blocks
            self.block_manager.commit(seq, end)
        return end - start

    def _propose(self, seq: Sequence, budget: int, num_later: int) -> list[int]:
        """Drafts for a decoding sequence, within what is left of the budget after one token for each later running
        sequence, within max_tokens, and within the blocks free beyond one for each later running sequence: drafts
        never cause a preemption nor starve a running sequence; they shrink or vanish instead."""
        if seq.num_computed_tokens != len(seq.token_ids) - 1 or not _takes_drafts(seq):
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
        batch.num_new_tokens.append(1 + len(drafts))
        batch.samples.append(True)
        if len(seq.token_ids) % self.block_size == 0:
            self.block_manager.commit(seq, len(seq.token_ids))
        return 1 + len(drafts)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed (prompt and generated tokens) when readmitted."""
        self.block_manager.free(seq)
        self.freed_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _roll_back(self) -> None:
        """The previous step never completed (an exception, Ctrl-C): forget the blocks it committed, and recompute
        every running sequence, as after a preemption: one admitted in that step may count such blocks as computed."""
        self.block_manager.discard_unpublished()
        while self.running:
            self._preempt(self.running.pop())
        self.step_in_flight = False

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int | None]) -> list[Sequence]:
        """The step completed: publish the blocks it wrote, record computed tokens and sampled ones; return the
        sequences that got a token."""
        self.block_manager.publish()
        self.step_in_flight = False
        del self.freed_seq_ids[:len(batch.freed_seq_ids)]  # the runner has them; later ones were appended after
        grown = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, token_ids):
            if token is not None:  # None: a prompt chunk that did not reach the end of the sequence
                seq.token_ids.append(token)
                grown.append(seq)
            # After the append: interrupted in between, the sequence recomputes a token rather than skipping one.
            seq.num_computed_tokens += n
        for i, drafts in batch.draft_token_ids.items():
            batch.seqs[i].num_computed_tokens -= len(drafts)  # they count once accepted (accept_draft)
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


def _takes_drafts(seq: Sequence) -> bool:
    """Rows whose next distribution depends on drafted tokens through the output history get no drafts:
    penalties (output counts), bad words (the generated tail) and structured outputs (the grammar state) would
    need per-draft state the verifier does not model. min_tokens is modeled: its bans go by each row's position."""
    return not (seq.params.penalized or seq.bad_words_token_ids or seq.grammar_state is not None)
