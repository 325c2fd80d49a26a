"""Which adapter each of the max_loras slots holds, and each step's token -> slot mapping (rank 0's bookkeeping,
kept beside the persistent input batch)."""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from nanoinfer.lora.request import LoRARequest


@dataclass
class LoRAMapping:
    """What a step's forward pass needs: the adapter each used slot must hold (loaded first where it does not), and
    the rows of the step's tokens that use it, a slice where they are contiguous; and each token's slot (-1: none),
    what a decode graph reads instead."""
    adapters: dict[int, LoRARequest]
    groups: list[tuple[int, slice | np.ndarray]]
    token_slots: np.ndarray


class LoRASlots:
    """Slots are handed out per InputBatch row: a sequence holds its adapter's slot while it holds a row. A new
    adapter takes a never-used slot, else the least recently used one no row holds; the scheduler admits no more
    distinct adapters than there are slots, so one is always free."""

    def __init__(self, max_loras: int, max_num_seqs: int):
        self.adapters: list[LoRARequest | None] = [None] * max_loras
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.num_rows = [0] * max_loras  # rows holding each slot
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))  # held by no row: LRU first
        self.row_slot = np.full(max_num_seqs, -1, dtype=np.int64)  # -1: the row's sequence has no adapter

    def add(self, row: int, request: LoRARequest | None) -> None:
        self.row_slot[row] = -1 if request is None else self._acquire(request)

    def remove(self, row: int) -> None:
        slot = int(self.row_slot[row])
        if slot < 0:
            return
        self.row_slot[row] = -1
        self.num_rows[slot] -= 1
        if not self.num_rows[slot]:
            self.idle[slot] = None  # most recently used

    def _acquire(self, request: LoRARequest) -> int:
        slot = self.slot_of.get(request.lora_int_id)
        if slot is None:
            assert self.idle, "more distinct adapters running than max_loras"
            slot = self.idle.popitem(last=False)[0]
            evicted = self.adapters[slot]
            if evicted is not None:
                del self.slot_of[evicted.lora_int_id]
            self.adapters[slot], self.slot_of[request.lora_int_id] = request, slot
        elif not self.num_rows[slot]:
            del self.idle[slot]
        self.num_rows[slot] += 1
        return slot

    def mapping(self, rows: np.ndarray, num_new_tokens: np.ndarray) -> LoRAMapping | None:
        """The step's mapping for the sequences in these InputBatch rows, computing num_new_tokens tokens each
        (in that order); None when none of them has an adapter."""
        seq_slots = self.row_slot[rows]
        if (seq_slots < 0).all():
            return None
        token_slots = np.repeat(seq_slots, num_new_tokens)
        used = np.unique(seq_slots[seq_slots >= 0]).tolist()
        return LoRAMapping({s: self.adapters[s] for s in used}, [(s, _token_rows(token_slots, s)) for s in used],
                           token_slots)


def _token_rows(token_slots: np.ndarray, slot: int) -> slice | np.ndarray:
    rows = np.flatnonzero(token_slots == slot)
    first, last = int(rows[0]), int(rows[-1])
    return slice(first, last + 1) if last - first + 1 == len(rows) else rows
