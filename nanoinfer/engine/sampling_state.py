"""Sampling state that lives on the model's device: per-sequence token statistics for penalties, updated with the
tokens generated since a sequence's last step, and the transfers around sampling (small, pinned, non_blocking)."""
import torch

from nanoinfer.engine.sequence import Sequence, SequenceStatus


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on device without waiting for the work queued there (pinned, non_blocking on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PenaltyCache:
    def __init__(self, device: torch.device):
        self.device = device
        self.prompt_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [slots, V]
        self.output_counts = torch.zeros(0, 0, device=device)  # [slots, V] fp32
        self.owners: list[Sequence | None] = []
        self.num_counted: list[int] = []  # the owner's generated tokens already in output_counts
        self.slot_of: dict[int, int] = {}  # seq_id -> slot

    def gather(self, seqs: list[Sequence], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt_mask and output_counts rows [len(seqs), V] of seqs, brought up to date first: a sequence seen
        for the first time gets a slot filled from its tokens, the others add the tokens appended since."""
        assert not self.owners or self.output_counts.shape[1] == vocab
        slots, count_rows, count_tokens = [], [], []
        for seq in seqs:
            slot = self.slot_of.get(seq.seq_id)
            if slot is None:
                slot = self._claim(seq, vocab)
            new = seq.token_ids[seq.num_prompt_tokens + self.num_counted[slot]:]
            count_rows += [slot] * len(new)
            count_tokens += new
            self.num_counted[slot] += len(new)
            slots.append(slot)
        if count_tokens:
            rows, tokens = to_device(torch.tensor([count_rows, count_tokens]), self.device)
            self.output_counts.index_put_((rows, tokens), torch.ones((), device=self.device), accumulate=True)
        index = to_device(torch.tensor(slots), self.device)
        return self.prompt_mask[index], self.output_counts[index]

    def _claim(self, seq: Sequence, vocab: int) -> int:
        """A slot for seq: one whose owner finished, else one whose owner waits (preempted: it is rebuilt when it
        runs again), else a new one. Its prompt mask is set and its counts are zero."""
        slot = next((i for i, s in enumerate(self.owners) if s is None or s.is_finished), None)
        if slot is None:
            slot = next((i for i, s in enumerate(self.owners) if s.status == SequenceStatus.WAITING), None)
        if slot is None:
            slot = len(self.owners)
            self._grow(max(8, 2 * slot), vocab)
        if (old := self.owners[slot]) is not None:
            del self.slot_of[old.seq_id]
        self.owners[slot], self.num_counted[slot], self.slot_of[seq.seq_id] = seq, 0, slot
        prompt = to_device(torch.tensor(seq.token_ids[:seq.num_prompt_tokens]), self.device)
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, prompt] = True
        self.output_counts[slot] = 0
        return slot

    def _grow(self, num_slots: int, vocab: int) -> None:
        extra = num_slots - len(self.owners)
        self.prompt_mask = torch.cat([self.prompt_mask.view(-1, vocab), self.prompt_mask.new_zeros(extra, vocab)])
        self.output_counts = torch.cat([self.output_counts.view(-1, vocab), self.output_counts.new_zeros(extra, vocab)])
        self.owners += [None] * extra
        self.num_counted += [0] * extra


class HostTransfer:
    """Brings a step's small result tensors (token ids, logprobs) to the host in one copy: on CUDA through a
    reused pinned buffer, non_blocking, then one synchronize; on the CPU nothing is copied."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.float64)

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.device.type != "cuda" or not tensors:
            return tensors
        # float64 holds token ids, ranks (< 2^53) and fp32 logprobs exactly.
        flat = torch.cat([t.reshape(-1).double() for t in tensors])
        if self.buffer.numel() < flat.numel():
            self.buffer = torch.empty(2 * flat.numel(), dtype=torch.float64, pin_memory=True)
        host = self.buffer[:flat.numel()]
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        parts = host.split([t.numel() for t in tensors])
        return [p.view(t.shape).to(t.dtype, copy=True) for p, t in zip(parts, tensors)]
