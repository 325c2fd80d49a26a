"""BlockManager + Sequence: allocation, reference counts, prefix caching, LRU eviction of cached blocks.

Unit tests on hand-built scenarios, then a hypothesis state machine that drives a BlockManager with random
allocate / prefill-chunk / decode / preempt / finish operations and checks, after every step, the block
accounting and -- through a simulated KV cache -- that every token a sequence attends to holds exactly the
K/V of its own prefix (which is what a wrong prefix-cache hit or a premature eviction would break).
"""
from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams

BS = 4


def free_order(bm: BlockManager) -> list[int]:
    """The free block ids in the order they will be taken: never-used ones first, then freed ones (LRU)."""
    return [*range(bm.num_used_blocks, bm.num_blocks), *bm.free_blocks]


def make_seq(tokens, block_size=BS) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), block_size)


def allocate_and_compute(bm: BlockManager, tokens, block_size=BS) -> Sequence:
    """Admit a sequence and 'prefill' it completely in one completed step, as the scheduler does (commit of every
    computed token, published when the step completes)."""
    seq = make_seq(tokens, block_size)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    bm.commit(seq, len(seq))
    bm.publish()
    seq.num_computed_tokens = len(seq)
    return seq


def filler(n_blocks: int, start: int = 10_000) -> Sequence:
    """A sequence of never-repeated tokens filling exactly n_blocks blocks (never committed: no cache entries)."""
    return make_seq(range(start, start + n_blocks * BS))


# ----------------------------------------------------------------------------------------------------------
# Allocation and free
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9, 16, 17])
def test_allocate_takes_ceil_len_over_block_size_and_free_returns_them(length):
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq(range(length))
    expected = -(-length // BS)
    assert seq.num_blocks == expected
    bm.allocate(seq)
    assert len(seq.block_table) == expected
    assert len(set(seq.block_table)) == expected
    assert bm.num_free_blocks == 10 - expected
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert not set(seq.block_table) & set(free_order(bm))
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0  # nothing cached in a fresh manager
    held = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 10
    assert all(bm.blocks[b].ref_count == 0 for b in held)
    assert set(free_order(bm)) == set(range(10))


def test_two_sequences_get_disjoint_blocks_and_allocate_takes_least_recently_freed_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(100, 109)), make_seq(range(200, 207))  # 3 and 2 blocks, unrelated tokens
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    bm.free(a)  # freed tail first: LRU order of the free list is now 5, 6, 7, 2, 1, 0
    assert free_order(bm) == [5, 6, 7, 2, 1, 0]
    c = make_seq(range(300, 316))  # 4 blocks, no prefix in common with anything
    bm.allocate(c)
    assert c.block_table == [5, 6, 7, 2]


def test_append_slots_grows_table_only_on_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(7))
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    seq.token_ids.append(7)  # 8 tokens: still 2 blocks
    assert bm.append_slots(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    seq.token_ids.append(8)  # 9 tokens: a third block
    assert bm.append_slots(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 1
    assert len(set(seq.block_table)) == 3


# ----------------------------------------------------------------------------------------------------------
# Prefix caching
# ----------------------------------------------------------------------------------------------------------

def test_prefix_hit_shares_leading_blocks_and_sets_num_cached_tokens():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 60))  # 10 tokens: blocks [50..53] [54..57] [58 59]
    a = allocate_and_compute(bm, prompt)
    b = make_seq(prompt[:8] + [7, 7, 7])  # same two full leading blocks, different tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert bm.num_free_blocks == 12 - 3 - 1  # b took only one new block


@pytest.mark.parametrize("budget", [3, 64])  # prompt chunks of 3 tokens (ending mid-block), or the whole prompt
def test_scheduler_commits_every_block_a_step_fills(budget):
    """Blocks filled by a prompt chunk that starts mid-block, or by a single decode token, join the prefix cache:
    a later prompt holding those tokens finds all of them (the scheduler commits only in steps that fill blocks)."""
    config = SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=budget, kvcache_block_size=BS,
                             enable_prefix_caching=True, scheduling_policy="fcfs")
    scheduler = Scheduler(config, num_kvcache_blocks=16)
    seq = make_seq(range(100, 107))  # 7 tokens; decoding tokens 7 and 11 fills blocks 1 and 2
    scheduler.add(seq)
    while len(seq) < 13:
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [200 + len(seq) if sampled else None for sampled in batch.samples])
    assert seq.num_computed_tokens == 12
    later = make_seq(seq.token_ids[:12] + [1])
    scheduler.add(later)
    scheduler.schedule()
    assert later.num_cached_tokens == 12 and later.block_table[:3] == seq.block_table[:3]


def test_commit_registers_only_full_blocks_within_num_tokens():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 62))  # 12 tokens, 3 full blocks
    a = make_seq(prompt)
    bm.allocate(a)
    b = make_seq(prompt + [1])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 0, "nothing is cached before commit"
    bm.free(b)
    bm.commit(a, 7)  # only block 0 is full among the first 7 tokens
    assert [bm.blocks[x].hash != -1 for x in a.block_table] == [True, False, False]
    assert len(bm.step_hash_to_block) == 1 and bm.hash_to_block == {}
    bm.publish()
    assert len(bm.hash_to_block) == 1 and bm.step_hash_to_block == {}
    c = make_seq(prompt + [1])
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]


def test_blocks_committed_in_a_step_are_shared_within_it_and_cached_once_it_completes():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 60))  # 2 full blocks + 2 tokens
    a = make_seq(prompt)
    bm.allocate(a)
    bm.commit(a, len(a))  # scheduled: this step writes its K/V
    b = make_seq(prompt)  # admitted later in the same step: attends after every layer stored a's K/V
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.hash_to_block == {}, "not in the prefix cache before the step completes"
    bm.publish()
    shared = a.block_table[:2]
    assert sorted(bm.hash_to_block.values()) == sorted(shared) and bm.step_hash_to_block == {}
    bm.free(a)
    bm.free(b)
    c = make_seq(prompt)  # a later step: a cache hit
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == shared


def test_blocks_of_a_failed_step_never_reach_the_prefix_cache():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 60))
    a = make_seq(prompt)
    bm.allocate(a)
    bm.commit(a, len(a))
    held = list(a.block_table)
    bm.discard_unpublished()  # the step failed: their K/V may never have been written
    bm.free(a)
    assert bm.hash_to_block == {} and bm.step_hash_to_block == {}
    assert all(bm.blocks[x].hash == -1 for x in held)
    b = make_seq(prompt)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    bm.commit(b, len(b))  # recomputed in a step that completes: cached from then on
    bm.publish()
    assert len(bm.hash_to_block) == 2


@pytest.mark.parametrize("length", [8, 9, 12])
def test_prefix_hit_never_includes_the_block_holding_the_last_prompt_token(length):
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 62))  # 12 tokens, all 3 blocks committed
    a = allocate_and_compute(bm, prompt)
    assert len(bm.hash_to_block) == 3
    b = make_seq(prompt[:length])
    bm.allocate(b)
    last_block = (length - 1) // BS
    expected_hits = last_block  # every full block before the one holding the last token
    assert b.num_cached_tokens == expected_hits * BS < length
    assert b.block_table[:expected_hits] == a.block_table[:expected_hits]
    assert b.block_table[last_block] not in a.block_table


def test_ref_counts_on_shared_blocks_go_2_1_0():
    bm = BlockManager(num_blocks=12, block_size=BS)
    prompt = list(range(50, 60))
    a = allocate_and_compute(bm, prompt)
    b = make_seq(prompt[:8] + [1, 2])
    bm.allocate(b)
    shared = a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in shared] == [2, 2]
    assert bm.blocks[a.block_table[2]].ref_count == 1 and bm.blocks[b.block_table[2]].ref_count == 1
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in shared] == [1, 1]
    assert not set(shared) & set(free_order(bm)), "a block still used by b must not be free"
    assert a.block_table == []
    bm.free(b)
    assert [bm.blocks[x].ref_count for x in shared] == [0, 0]
    assert set(shared) <= set(free_order(bm))
    assert bm.num_free_blocks == 12


def test_freed_cached_block_is_revived_until_evicted_by_lru_reuse():
    n = 8
    bm = BlockManager(num_blocks=n, block_size=BS)
    prompt = list(range(50, 62))  # 3 full blocks, all registered
    a = allocate_and_compute(bm, prompt)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == n and len(bm.hash_to_block) == 3

    # Revived from the free list: same block ids, and they leave the free list.
    b = make_seq(prompt + [1])
    bm.allocate(b)
    assert b.block_table[:3] == a_blocks and b.num_cached_tokens == 12
    assert bm.num_free_blocks == n - 4
    assert all(bm.blocks[x].ref_count == 1 for x in a_blocks)
    bm.free(b)  # free order appends b's tail, then a's blocks 2, 1, 0
    assert bm.num_free_blocks == n

    # Reuse the never-cached free blocks: the cached ones survive (they are the most recently freed).
    f1 = filler(n - 4)
    bm.allocate(f1)
    assert not set(f1.block_table) & set(a_blocks)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 3
    assert not bm.can_allocate(make_seq(prompt + list(range(90, 95))))  # 5 blocks > 4 free, hits or not
    c = make_seq(prompt + [2])
    assert bm.can_allocate(c)  # 3 revived + 1 new == 4 free
    bm.allocate(c)
    assert c.block_table[:3] == a_blocks and c.num_cached_tokens == 12
    assert bm.num_free_blocks == 0
    bm.free(c)
    bm.free(f1)

    # Now take blocks until exactly the least recently freed cached block (a's block 2, freed before 1 and 0)
    # is evicted.
    order = free_order(bm)
    evict_at = order.index(a_blocks[2])
    assert evict_at < order.index(a_blocks[1]) < order.index(a_blocks[0])
    f2 = filler(evict_at + 1, start=20_000)
    bm.allocate(f2)
    assert a_blocks[2] in f2.block_table and not {a_blocks[0], a_blocks[1]} & set(f2.block_table)
    assert bm.blocks[a_blocks[2]].hash == -1 and a_blocks[2] not in bm.hash_to_block.values()
    assert len(bm.hash_to_block) == 2
    d = make_seq(prompt + [3])
    bm.allocate(d)
    assert d.num_cached_tokens == 8, "only the two surviving cached blocks are reused"
    assert d.block_table[:2] == a_blocks[:2] and d.block_table[2] != a_blocks[2]


def test_hash_collision_does_not_hand_out_another_prefix(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix_hash=-1: 42))
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = allocate_and_compute(bm, [1, 2, 3, 4, 5])
    assert bm.hash_to_block == {42: a.block_table[0]}
    # Same (colliding) hash, different tokens: the tokens decide -- no hit.
    b = make_seq([9, 9, 9, 9, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.blocks[a.block_table[0]].ref_count == 1
    # Same hash and same tokens: a hit.
    c = make_seq([1, 2, 3, 4, 6])
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]


def test_hash_collision_guard_checks_the_whole_prefix(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix_hash=-1: 42))
    bm = BlockManager(num_blocks=10, block_size=BS)
    allocate_and_compute(bm, [1, 2, 3, 4, 8])
    b = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 6])  # block 1 has block 0's tokens but a different prefix
    bm.allocate(b)
    assert len(set(b.block_table)) == len(b.block_table), f"block repeated in one table: {b.block_table}"
    assert b.num_cached_tokens == 4  # only block 0 is really cached


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(50, 62))
    a = allocate_and_compute(bm, prompt)
    assert bm.hash_to_block == {}
    assert all(bm.blocks[x].hash == -1 for x in a.block_table)
    b = make_seq(prompt + [1])
    assert bm.can_allocate(b) and bm.num_free_blocks == 9
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.free(a)
    c = make_seq(prompt + [2])
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(b.block_table)


def test_can_allocate_counts_revived_cached_blocks_against_the_free_list():
    n = 6
    bm = BlockManager(num_blocks=n, block_size=BS)
    prompt = list(range(50, 62))  # 3 blocks
    a = allocate_and_compute(bm, prompt)

    # Live hits cost nothing: 5 blocks needed, 3 shared with the live a, so 2 new ones from 3 free.
    big = make_seq(prompt + list(range(80, 88)))
    assert big.num_blocks == 5 and bm.num_free_blocks == 3
    assert bm.can_allocate(big)
    # Without the hits it would not fit.
    assert not bm.can_allocate(make_seq(range(100, 120)))

    a_blocks = list(a.block_table)
    bm.free(a)
    f = filler(3)  # takes the 3 never-used blocks; only a's 3 cached blocks remain free
    bm.allocate(f)
    assert bm.num_free_blocks == 3 and set(free_order(bm)) == set(a_blocks)
    # 4 blocks, 3 of them cached but free (revived from the free list): needs 4 free blocks in total.
    assert not bm.can_allocate(make_seq(prompt + [1]))
    assert not bm.can_allocate(make_seq(prompt + [1, 2, 3, 4]))
    # 3 blocks, 2 cached and revived + 1 new == 3 free blocks: fits exactly.
    fits = make_seq(prompt[:8] + [1])
    assert bm.can_allocate(fits)
    bm.allocate(fits)
    assert fits.num_cached_tokens == 8 and bm.num_free_blocks == 0
    assert fits.block_table[:2] == a_blocks[:2]
    # Now nothing, not even a one-token prompt, fits.
    assert not bm.can_allocate(make_seq([1]))


def test_append_slots_respects_free_count_and_may_evict_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    cached = allocate_and_compute(bm, range(50, 54))  # 1 block, registered
    cached_block = cached.block_table[0]
    bm.free(cached)
    seq = make_seq(range(8))  # exactly 2 blocks
    bm.allocate(seq)
    assert bm.num_free_blocks == 1 and len(bm.hash_to_block) == 1  # the free block is the cached one
    seq.token_ids.append(8)  # needs a third block: only the cached one is left, and it is evictable
    assert bm.append_slots(seq)
    assert seq.block_table[-1] == cached_block
    assert bm.num_free_blocks == 0 and bm.hash_to_block == {}
    for t in range(9, 12):  # fills the third block: no new block needed even with nothing free
        seq.token_ids.append(t)
        assert bm.append_slots(seq)
    assert len(seq.block_table) == 3
    seq.token_ids.append(12)
    assert not bm.append_slots(seq)
    assert len(seq.block_table) == 3  # nothing taken


# ----------------------------------------------------------------------------------------------------------
# Stateful property test
# ----------------------------------------------------------------------------------------------------------

def chain_hash(tokens, block_size) -> int:
    h = -1
    for i in range(0, len(tokens), block_size):
        h = BlockManager.compute_hash(list(tokens[i:i + block_size]), h)
    return h


class BlockManagerMachine(RuleBasedStateMachine):
    """Random scheduler-like traffic against one BlockManager, checked against a simulated KV cache.

    kv[slot] holds the full token prefix whose last token was "computed" into that slot; a sequence that
    has computed position p must find its own prefix tokens[:p + 1] there -- for blocks it computed itself
    and for blocks it got from the prefix cache.
    """

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(2, 12),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size, num_blocks, caching):
        self.bs, self.n = block_size, num_blocks
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.history: list[list[int]] = []
        self.kv: dict[int, tuple[int, ...]] = {}
        self.seen: dict[int, tuple[int, ...]] = {}  # hash -> the token prefix it was observed for

    # --- helpers ---------------------------------------------------------------------------------------
    def _slot(self, seq: Sequence, p: int) -> int:
        return seq.block_table[p // self.bs] * self.bs + p % self.bs

    def _compute(self, seq: Sequence, n: int) -> None:
        """One scheduled step of n tokens: commit (as the scheduler does), write their K/V, publish (completed)."""
        start = seq.num_computed_tokens
        assert 0 < n <= len(seq) - start
        assert len(seq.block_table) * self.bs >= start + n
        self.bm.commit(seq, start + n)
        for p in range(start, start + n):
            self.kv[self._slot(seq, p)] = tuple(seq.token_ids[:p + 1])
        self.bm.publish()
        seq.num_computed_tokens += n

    # --- rules -----------------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=10), base=st.integers(0, 10**6),
          cut=st.integers(0, 16))
    def add(self, tokens, base, cut):
        prefix = self.history[base % len(self.history)][:cut] if self.history else []
        ids = (prefix + tokens)[:16] or [0]
        self.history.append(ids)
        self.waiting.append(Sequence(ids, SamplingParams(), self.bs))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 10**6), chunk=st.integers(1, 16))
    def allocate(self, i, chunk):
        seq = self.waiting[i % len(self.waiting)]
        ok = self.bm.can_allocate(seq)
        trial_bm, trial_seq = copy.deepcopy((self.bm, seq))
        try:
            trial_bm.allocate(trial_seq)
            fits = True
        except KeyError:  # popitem from an empty free list
            fits = False
        assert ok == fits, f"can_allocate={ok} but allocate {'succeeded' if fits else 'ran out of blocks'}"
        if not ok:
            return
        self.bm.allocate(seq)
        self.waiting.remove(seq)
        self.running.append(seq)
        assert len(seq.block_table) == seq.num_blocks
        assert seq.num_cached_tokens == seq.num_computed_tokens
        assert seq.num_cached_tokens % self.bs == 0 and seq.num_cached_tokens < len(seq)
        if not self.bm.enable_prefix_caching:
            assert seq.num_cached_tokens == 0
        for p in range(seq.num_computed_tokens):  # the cached prefix must hold exactly our K/V
            assert self.kv.get(self._slot(seq, p)) == tuple(seq.token_ids[:p + 1]), "wrong prefix-cache hit"
        self._compute(seq, min(chunk, len(seq) - seq.num_computed_tokens))

    @precondition(lambda self: any(s.num_computed_tokens < len(s) for s in self.running))
    @rule(i=st.integers(0, 10**6), chunk=st.integers(1, 16))
    def continue_prefill(self, i, chunk):
        todo = [s for s in self.running if s.num_computed_tokens < len(s)]
        seq = todo[i % len(todo)]
        self._compute(seq, min(chunk, len(seq) - seq.num_computed_tokens))

    @precondition(lambda self: any(s.num_computed_tokens < len(s) for s in self.running))
    @rule(i=st.integers(0, 10**6), chunk=st.integers(1, 16), written=st.integers(0, 16))
    def failed_step(self, i, chunk, written):
        """A step that commits, writes only some of its K/V (wrongly), and fails: the scheduler's roll-back."""
        todo = [s for s in self.running if s.num_computed_tokens < len(s)]
        seq = todo[i % len(todo)]
        start = seq.num_computed_tokens
        n = min(chunk, len(seq) - start)
        self.bm.commit(seq, start + n)
        for p in range(start, start + min(n, written)):
            self.kv[self._slot(seq, p)] = ("garbage",)
        self.bm.discard_unpublished()
        self.preempt_seq(seq)  # recomputed when readmitted

    @precondition(lambda self: any(s.num_computed_tokens == len(s) for s in self.running))
    @rule(i=st.integers(0, 10**6), token=st.integers(0, 2))
    def decode(self, i, token):
        ready = [s for s in self.running if s.num_computed_tokens == len(s)]
        seq = ready[i % len(ready)]
        if len(seq) >= 24:  # "max_tokens": finish instead
            self.finish_running(seq)
            return
        seq.token_ids.append(token)  # the sampled token; its K/V is computed next step
        needed, free = seq.num_blocks - len(seq.block_table), self.bm.num_free_blocks
        ok = self.bm.append_slots(seq)
        assert ok == (needed <= free)
        if ok:
            assert len(seq.block_table) == seq.num_blocks
            self._compute(seq, 1)
        else:
            self.preempt_seq(seq)

    def preempt_seq(self, seq):
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    def finish_running(self, seq):
        self.bm.free(seq)
        assert seq.block_table == []
        self.running.remove(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10**6))
    def preempt(self, i):
        self.preempt_seq(self.running[i % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10**6))
    def finish(self, i):
        self.finish_running(self.running[i % len(self.running)])

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 10**6))
    def drop_waiting(self, i):
        self.waiting.pop(i % len(self.waiting))

    # --- invariants ------------------------------------------------------------------------------------
    @invariant()
    def block_accounting(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        for s in self.waiting:
            assert s.block_table == []
        users = Counter(b for s in self.running for b in s.block_table)
        for s in self.running:
            assert len(set(s.block_table)) == len(s.block_table), f"block twice in one table: {s.block_table}"
            assert len(s.block_table) == s.num_blocks, "the table must cover the sequence's tokens"
        for block in bm.blocks.values():
            assert block.ref_count == users[block.block_id], f"block {block.block_id} ref_count"
        free = set(free_order(bm))
        assert len(free) == bm.num_free_blocks
        assert free == {i for i in range(bm.num_blocks) if i not in bm.blocks or bm.blocks[i].ref_count == 0}
        assert len(users) + bm.num_free_blocks == self.n

    @invariant()
    def kv_and_hashes_consistent(self):
        if not hasattr(self, "bm"):
            return
        bm, bs = self.bm, self.bs
        for s in self.running:
            for p in range(s.num_computed_tokens):
                assert self.kv.get(self._slot(s, p)) == tuple(s.token_ids[:p + 1]), "K/V overwritten"
            for i, b in enumerate(s.block_table):
                block = bm.blocks[b]
                if block.hash != -1:
                    prefix = tuple(s.token_ids[:(i + 1) * bs])
                    assert block.token_ids == list(prefix[-bs:])
                    assert block.hash == chain_hash(prefix, bs)
                    self.seen[block.hash] = prefix
                elif bm.enable_prefix_caching:
                    assert (i + 1) * bs > s.num_computed_tokens, "a computed full block was not committed"
        if not bm.enable_prefix_caching:
            assert bm.hash_to_block == {}
            return
        for h, b in bm.hash_to_block.items():
            block = bm.blocks[b]
            assert block.hash == h
            assert h in self.seen
            prefix = self.seen[h]
            assert chain_hash(prefix, bs) == h and block.token_ids == list(prefix[-bs:])
            for j in range(bs):  # a registered block (live or free) still holds the K/V its hash promises
                assert self.kv.get(b * bs + j) == prefix[:len(prefix) - bs + j + 1]


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_a_large_cache_starts_without_building_its_blocks():
    # A GPU cache of a tiny model holds millions of blocks: they are made on first use, not at start-up.
    bm = BlockManager(num_blocks=10**9, block_size=BS)
    a = make_seq(range(9))
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and len(bm.blocks) == 3 and bm.num_free_blocks == 10**9 - 3
