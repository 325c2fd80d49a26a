"""Paged KV-cache blocks: allocation, reference counts, and prefix caching keyed by a hash of the token prefix and
its LoRA adapter (a block joins the cache once the step writing it has completed); plus the recurrent-state slots
of models with linear attention, held by a sequence exactly while it holds blocks."""
from array import array
from collections import OrderedDict

import xxhash

from nanoinfer.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not (yet) a full, registered block
        self.token_ids: list[int] = []
        # Which block (and which use of it) preceded this one when its K/V were computed: together with
        # token_ids, this proves a cache hit has the right prefix, whatever the hash says.
        self.parent: tuple[int, int] | None = None
        self.generation = 0  # bumped on every reuse, invalidating children that recorded the old contents


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        # Made on first use: a GPU's cache can hold millions of blocks, and start-up must not build them all.
        self.blocks: dict[int, Block] = {}
        self.hash_to_block: dict[int, int] = {}  # the prefix cache: blocks whose K/V a completed step wrote
        # Blocks the step being scheduled writes: found only by sequences of that same step, until publish().
        self.step_hash_to_block: dict[int, int] = {}
        # Free blocks in the order they are taken: the never-used ones (ids from num_used_blocks up), then freed
        # ones, least recently freed first: cached contents survive until their block is reused.
        self.num_used_blocks = 0
        self.free_blocks: OrderedDict[int, None] = OrderedDict()  # the freed ones
        # A slot's state is valid only for the sequence holding it: freed (finish, abort, preemption) means gone.
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots))

    @staticmethod
    def compute_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix_hash != -1:
            h.update(prefix_hash.to_bytes(8, "little"))
        h.update(array("q", token_ids))  # int64s, as a buffer: no copy to bytes
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks + len(self.free_blocks)

    def _take_free_block(self) -> Block:
        if self.num_used_blocks < self.num_blocks:
            block = self.blocks[self.num_used_blocks] = Block(self.num_used_blocks)
            self.num_used_blocks += 1
            block.ref_count = 1
            return block
        block = self.blocks[self.free_blocks.popitem(last=False)[0]]
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        # Committed for a step in flight by a sequence that then finished (async scheduling): not to be published.
        if self.step_hash_to_block.get(block.hash) == block.block_id:
            del self.step_hash_to_block[block.hash]
        block.hash, block.token_ids, block.parent, block.ref_count = -1, [], None, 1
        block.generation += 1
        return block

    @staticmethod
    def _parent_key(previous: Block) -> tuple[int, int]:
        return previous.block_id, previous.generation

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        """Leading blocks already in the cache. The last token is never taken from it: its logits are needed."""
        hits: list[Block] = []
        if not self.enable_prefix_caching or seq.needs_prompt_logits or seq.prompt_embeds is not None:
            return hits
        prefix_hash, parent = self._root(seq)
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block(i)
            prefix_hash = self.compute_hash(tokens, prefix_hash)
            block = self.blocks.get(self.hash_to_block.get(prefix_hash, self.step_hash_to_block.get(prefix_hash)))
            # Check tokens and parent too: a hash collision must never hand out someone else's K/V.
            if (block is None or block.hash != prefix_hash or block.token_ids != tokens
                    or block.parent != (self._parent_key(hits[-1]) if hits else parent)):
                break
            hits.append(block)
        return hits

    def _root(self, seq: Sequence) -> tuple[int, tuple[int, int] | None]:
        """The hash and parent key a sequence's first block chains from: its LoRA adapter's (vLLM puts the adapter
        in every block's hash), so that K/V computed under different adapters, or none, are never shared."""
        if not seq.lora_int_id:
            return -1, None
        return self.compute_hash([-seq.lora_int_id]), (-1, seq.lora_int_id)

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        revived = sum(block.ref_count == 0 for block in hits)
        if self.num_state_slots and not self.free_state_slots:
            return False
        return seq.num_blocks - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._cached_prefix(seq)
        for block in hits:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if self.num_state_slots:
            seq.state_slot = self.free_state_slots.pop()

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU order evicts a sequence's tail before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1

    def append_slots(self, seq: Sequence) -> bool:
        """Grow the block table to cover every token of the sequence, its pending one included; False, taking
        nothing, if too few blocks are free."""
        missing = -(-(len(seq.token_ids) + seq.num_pending_tokens) // self.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def append_lookahead_slots(self, seq: Sequence, num_lookahead: int, num_reserved: int) -> int:
        """Grow the block table to cover up to num_lookahead tokens past the sequence's end (draft tokens), leaving at
        least num_reserved blocks free; return how many of those tokens it covers. The blocks stay with the sequence:
        its later tokens fill them."""
        covered = len(seq.block_table) * self.block_size - len(seq.token_ids)
        missing = -(-(num_lookahead - covered) // self.block_size)
        for _ in range(min(missing, self.num_free_blocks - num_reserved)):
            seq.block_table.append(self._take_free_block().block_id)
        return min(num_lookahead, len(seq.block_table) * self.block_size - len(seq.token_ids))

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among the first num_tokens tokens, whose K/V this step writes or has written.
        Until publish(), only sequences scheduled in the same step find the new ones: every layer stores the whole
        batch's K/V before attending, so they hold their K/V when read. A prompt of embeddings registers none: its
        token ids are placeholders."""
        if not self.enable_prefix_caching or seq.prompt_embeds is not None:
            return
        # Registered blocks are always a prefix of the table: step back only over the newly filled ones.
        end = start = num_tokens // self.block_size
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash == -1:
            start -= 1
        previous = self.blocks[seq.block_table[start - 1]] if start else None
        root_hash, root_parent = self._root(seq) if previous is None else (-1, None)
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block(i)
            block.hash = self.compute_hash(block.token_ids, root_hash if previous is None else previous.hash)
            block.parent = root_parent if previous is None else self._parent_key(previous)
            if block.hash not in self.hash_to_block:
                self.step_hash_to_block.setdefault(block.hash, block.block_id)
            previous = block

    def publish(self) -> None:
        """The step completed: the blocks it committed hold their K/V and join the prefix cache."""
        for h, block_id in self.step_hash_to_block.items():
            self.hash_to_block.setdefault(h, block_id)
        self.step_hash_to_block.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: benchmarks measure cold prefills after it). Only
        while no sequence holds blocks: False, forgetting nothing, otherwise."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self.blocks.values():
            block.hash, block.token_ids, block.parent = -1, [], None
        self.hash_to_block.clear()
        self.step_hash_to_block.clear()
        return True

    def discard_unpublished(self) -> None:
        """The step failed: forget the blocks it committed, whose K/V may never have been written."""
        for block_id in self.step_hash_to_block.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.parent = -1, [], None
        self.step_hash_to_block.clear()
