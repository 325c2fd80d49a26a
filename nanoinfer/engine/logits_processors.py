"""The custom logits processors of an engine (on rank 0, which samples) and the batch they see: the rows a step
samples, one per sequence, in order. From one step to the next they get the BatchUpdate that turns the last step's
rows into this one's: a sequence that skips a step (preempted, or a prompt prefilled in chunks) leaves the batch and
joins it again."""
import torch

from nanoinfer.config import Config
from nanoinfer.engine.sequence import Sequence
from nanoinfer.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality, OutputTokenIds


class CustomLogitsProcessors:
    def __init__(self, classes: tuple[type[LogitsProcessor], ...], config: Config, device: torch.device):
        self.processors = [cls(config, device, device.type == "cuda") for cls in classes]
        # Asked once, as vLLM asks: the sampler runs these for rows drawn at random only, the others for every row.
        self.argmax_invariant = tuple(p for p in self.processors if p.is_argmax_invariant())
        self.argmax_changing = tuple(p for p in self.processors if not p.is_argmax_invariant())
        self.rows: list[int] = []  # the seq_id at each index of the last step's batch

    def update(self, seqs: list[Sequence]) -> None:
        """Tell every processor this step's batch: seqs, the sampled sequences in the order of their logits rows."""
        update = batch_update(self.rows, seqs)
        self.rows = [seq.seq_id for seq in seqs]
        for p in self.processors:
            p.update_state(update)


def batch_update(previous: list[int], seqs: list[Sequence]) -> BatchUpdate | None:
    """The BatchUpdate from the batch `previous` (a seq_id per index) to seqs (sequence i at index i); None if they are
    the same. An added sequence takes its own index when no kept one holds it, else the first index none holds;
    then each index from 0 up gets its sequence by a move (into an empty index) or a swap."""
    ids = [seq.seq_id for seq in seqs]
    if ids == previous:
        return None
    wanted = set(ids)
    removed = [i for i, seq_id in enumerate(previous) if seq_id not in wanted]
    holder = {i: seq_id for i, seq_id in enumerate(previous) if seq_id in wanted}  # index -> seq_id
    index = {seq_id: i for i, seq_id in holder.items()}
    added, free = [], 0
    for i, seq in enumerate(seqs):
        if seq.seq_id in index:
            continue
        if i in holder:
            while free in holder:
                free += 1
            i = free
        holder[i], index[seq.seq_id] = seq.seq_id, i
        added.append((i, seq.params, seq.prompt_token_ids, OutputTokenIds(seq)))
    moved = []
    for i, seq_id in enumerate(ids):
        at = index[seq_id]
        if at == i:
            continue
        other = holder.get(i)
        if other is None:
            moved.append((at, i, MoveDirectionality.UNIDIRECTIONAL))
            del holder[at]
        else:
            moved.append((at, i, MoveDirectionality.SWAP))
            holder[at], index[other] = other, at
        holder[i], index[seq_id] = seq_id, i
    return BatchUpdate(len(ids), removed, added, moved)
