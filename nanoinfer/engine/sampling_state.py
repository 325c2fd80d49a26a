"""Sampling state: each InputBatch row's sampling parameters in preallocated arrays, per-sequence token statistics
for penalties kept on the model's device, and the transfers around sampling (small, pinned, non_blocking)."""
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.layers.sampler import add_at
from nanoinfer.sampling_params import SamplingParams

# SamplingRows.flags bits: which features a row uses, so that a step learns from two reductions which it needs.
(GREEDY, TOP_K, TOP_P, MIN_P, PENALIZED, MIN_TOKENS, LOGPROBS, ALLOWED_TOKENS, LOGIT_BIAS,
 BAD_WORDS, STRUCTURED) = (1 << i for i in range(11))


class SamplingRows:
    """The sampling parameters of each InputBatch row, written once when a sequence gets its row; a step gathers
    those of its sampled rows with numpy fancy indexing (no per-sequence Python)."""

    def __init__(self, max_num_seqs: int):
        n = max_num_seqs
        self.flags = np.zeros(n, dtype=np.uint16)
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.penalties = np.zeros((n, 3), dtype=np.float32)  # repetition, presence, frequency
        self.num_logprobs = np.zeros(n, dtype=np.int64)
        self.min_len = np.zeros(n, dtype=np.int64)  # stop and EOS tokens are banned at positions below this
        self.seed = np.zeros(n, dtype=np.uint64)
        self.has_seed = np.zeros(n, dtype=bool)  # False until an unseeded sequence is first sampled: drawn then
        # Rows taken by a sequence with allowed_token_ids or a logit_bias since TokenTables last wrote its rows.
        self.new_token_rows: dict[int, SamplingParams] = {}

    def add(self, row: int, seq: Sequence) -> None:
        p = seq.params
        # The flags are decided here on the Python values, exactly as a per-step scan of the params would be.
        self.flags[row] = (GREEDY * (p.temperature == 0) | TOP_K * (p.top_k > 0) | TOP_P * (p.top_p < 1)
                           | MIN_P * (p.min_p > 0) | PENALIZED * p.penalized | MIN_TOKENS * (p.min_tokens > 0)
                           | LOGPROBS * (p.logprobs is not None) | ALLOWED_TOKENS * (p.allowed_token_ids is not None)
                           | LOGIT_BIAS * bool(p.logit_bias) | BAD_WORDS * bool(seq.bad_words_token_ids)
                           | STRUCTURED * (seq.grammar_state is not None))
        if p.allowed_token_ids is not None or p.logit_bias:
            self.new_token_rows[row] = p
        else:
            self.new_token_rows.pop(row, None)  # a previous owner's, never written
        # A top_k of the vocabulary or more filters nothing; int64's largest says as much for any larger one.
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = (
            p.temperature, min(p.top_k, np.iinfo(np.int64).max), p.top_p, p.min_p)
        self.penalties[row] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        self.num_logprobs[row] = p.logprobs or 0
        self.min_len[row] = seq.num_prompt_tokens + p.min_tokens
        self.set_seed(row, seq.seed)

    def set_seed(self, row: int, seed: int | None) -> None:
        self.seed[row], self.has_seed[row] = seed or 0, seed is not None


def bad_word_bans(seq: Sequence, pending: tuple[int, ...] = ()) -> list[int]:
    """The last token of each of seq's bad words whose other tokens its generated tokens, followed by `pending`
    (sampled, not yet on the host), end with (vLLM's rule: the prompt does not count; a one-token word is always
    banned)."""
    tokens = seq.token_ids
    tail = (*tokens[max(0, len(tokens) + 1 - max(map(len, seq.bad_words_token_ids))):], *pending)  # all it reads
    num_generated = seq.num_completion_tokens + len(pending)
    return [word[-1] for word in seq.bad_words_token_ids
            if len(word) <= num_generated + 1 and tail[len(tail) - len(word) + 1:] == word[:-1]]


def grammar_bitmask(seqs: list[Sequence], vocab: int, pending: list[tuple[int, ...]]) -> np.ndarray:
    """[len(seqs), ceil(vocab / 32)] int32: the tokens each sequence's grammar allows next, after its pending tokens
    (sampled, not yet on the host), packed 32 to a word (see Grammar.bitmask), one row per sequence. Each state first
    reads any tokens it has not (the engine updates it after each step; a step interrupted in between leaves it
    behind)."""
    for seq in seqs:
        seq.grammar_state.update(seq.token_ids, seq.num_prompt_tokens)
    masks = np.stack([seq.grammar_state.bitmask(seq.eos_token_ids, p) for seq, p in zip(seqs, pending)])
    assert masks.shape[1] == -(-vocab // 32), "the grammar was built for another vocabulary size"
    return masks.view(np.int32)


class HostStaging:
    """Small host arrays uploaded to the device together, in one copy. On CUDA they are packed into a persistent
    pinned buffer used as a ring (it wraps around once the copies from it have run) and copied non_blocking; on
    the CPU the arrays are the tensors; elsewhere (meta, in tests) a plain copy."""

    # Every array starts at a multiple of 16 bytes: a view of the packed bytes for every itemsize, and as aligned as
    # Triton marks a pointer argument (16), so a kernel reading one compiles once, not again for each other offset.
    ALIGN = 16

    def __init__(self, device: torch.device, capacity: int = 1 << 18):
        self.device = device
        self.on_cuda = device.type == "cuda"
        # pin_memory needs a CUDA build with a driver: only on CUDA.
        self.buffer = torch.empty(capacity if self.on_cuda else 0, dtype=torch.uint8, pin_memory=self.on_cuda)
        self.offset = 0
        self.lap = 0  # times the ring has wrapped around
        # Copies from the buffer that may not have run yet: (lap, start offset, event recorded after the copy),
        # oldest first.
        self.in_flight: deque[tuple[int, int, torch.cuda.Event]] = deque()
        self.new_event = torch.cuda.Event  # (a stand-in in tests)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if not self.on_cuda:
            return [t.to(self.device) for t in tensors]
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += -(-t.nbytes // self.ALIGN) * self.ALIGN
        host = self._claim(end)
        for t, start in zip(tensors, starts):
            host[start:start + t.nbytes].view(t.dtype).copy_(t.view(-1))
        packed = torch.empty(end, dtype=torch.uint8, device=self.device).copy_(host, non_blocking=True)
        copied = self.new_event()
        copied.record()
        self.in_flight.append((self.lap, self.offset - end, copied))
        return [packed[start:start + t.nbytes].view(t.dtype).view(t.shape) for t, start in zip(tensors, starts)]

    def _claim(self, nbytes: int) -> torch.Tensor:
        """nbytes of the buffer that no pending copy reads: the next ones, or, past its end, its start (the buffer
        grows if it is too small). Bytes an earlier lap's copy read are rewritten once that copy has run: the host
        waits for the newest such copy, a lap old, never for the ones just queued (they may sit behind this step's
        forward pass, which the host would then wait for too)."""
        if self.offset + nbytes > self.buffer.numel():
            if nbytes > self.buffer.numel():
                if self.in_flight:
                    self.in_flight[-1][2].synchronize()
                self.in_flight.clear()
                self.buffer = torch.empty(2 * nbytes, dtype=torch.uint8, pin_memory=self.buffer.is_pinned())
            self.lap += 1
            self.offset = 0
        end, read = self.offset + nbytes, None
        # Copies of the lap before that start below `end` read these bytes (or bytes before them); older laps' are
        # older than every copy of that lap, so waiting for the newest one popped covers them all.
        while self.in_flight and (lap := self.in_flight[0][0]) < self.lap and (
                lap < self.lap - 1 or self.in_flight[0][1] < end):
            read = self.in_flight.popleft()[2]
        if read is not None:
            read.synchronize()
        self.offset = end
        return self.buffer[end - nbytes:end]


class PenaltyCache:
    """Per penalized sequence, on the model's device: its prompt's tokens as a mask and its generated tokens' counts,
    which each step's sampled tokens update there (count_sampled), so that a step scheduled before the previous one's
    tokens reach the host (async scheduling) penalizes them too."""

    def __init__(self, upload: HostStaging):
        self.device = device = upload.device
        self.upload = upload  # the runner's: one staging ring for every small upload of a step
        self.prompt_mask = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [slots, V]
        self.output_counts = torch.zeros(0, 0, device=device)  # [slots, V] fp32
        self.one = torch.ones((), device=device)
        self.owners: list[Sequence | None] = []
        self.num_counted: list[int] = []  # the owner's generated tokens in output_counts, sampled ones in flight too
        self.slot_of: dict[int, int] = {}  # seq_id -> slot
        self.gathered: tuple[torch.Tensor, list[int]] | None = None  # the last gather's slots (device, host)

    def gather(self, seqs: list[Sequence], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt_mask and output_counts rows [len(seqs), V] of seqs, this step's sampled ones: a sequence seen for
        the first time gets a slot filled from its tokens, and so does one whose counts do not add up (a step that
        sampled for it failed before its token was appended: see count_sampled). Every index goes to the device in
        one copy."""
        assert not self.owners or self.output_counts.shape[1] == vocab
        slots, claimed, prompt, counted = [], [], ([], []), ([], [])
        for seq in seqs:
            slot = self.slot_of.get(seq.seq_id)
            # Counted: every generated token, appended or pending, but the one this step samples.
            if slot is None or self.num_counted[slot] != seq.num_completion_tokens + seq.num_pending_tokens - 1:
                slot = self._claim(seq, vocab)
                claimed.append(slot)
                prompt_ids = seq.prompt_token_ids or ()  # a prompt of embeddings has none
                prompt[0].extend([slot] * len(prompt_ids))
                prompt[1].extend(prompt_ids)
                counted[0].extend([slot] * seq.num_completion_tokens)
                counted[1].extend(seq.completion_token_ids)
                self.num_counted[slot] = seq.num_completion_tokens
            slots.append(slot)
        index, claimed_index, prompt_index, counted_index = self.upload(
            *(np.array(x, dtype=np.int64) for x in (slots, claimed, prompt, counted)))
        if claimed:
            # index_fill_ and device scalars: a Python scalar assigned through index tensors is made on the CPU and
            # copied blocking to the device by index_put_ on CUDA (torch 2.11).
            self.prompt_mask.index_fill_(0, claimed_index, False)
            self.output_counts.index_fill_(0, claimed_index, 0)
            self.prompt_mask.index_put_(tuple(prompt_index), self.prompt_mask.new_ones(()))
        if counted[0]:
            add_at(self.output_counts, counted_index[0] * vocab + counted_index[1], self.one)
        self.gathered = index, slots
        return self.prompt_mask[index], self.output_counts[index]

    def count_sampled(self, token_ids: torch.Tensor) -> None:
        """Add the tokens just sampled for the last gather's sequences (token_ids [len(seqs)], on the device) to
        their counts, before the host knows them."""
        index, slots = self.gathered
        add_at(self.output_counts, index * self.output_counts.shape[1] + token_ids, self.one)
        for slot in slots:
            self.num_counted[slot] += 1

    def _claim(self, seq: Sequence, vocab: int) -> int:
        """A slot for seq: its own (rebuilt), else one whose owner finished, else one whose owner waits (preempted: it
        is rebuilt when it runs again), else a new one. gather() sets its prompt mask and counts."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is None:
            slot = next((i for i, s in enumerate(self.owners) if s is None or s.is_finished), None)
        if slot is None:
            slot = next((i for i, s in enumerate(self.owners) if s.status == SequenceStatus.WAITING), None)
        if slot is None:
            slot = len(self.owners)
            self._grow(max(8, 2 * slot), vocab)
        if (old := self.owners[slot]) is not None:
            del self.slot_of[old.seq_id]
        self.owners[slot], self.num_counted[slot], self.slot_of[seq.seq_id] = seq, 0, slot
        return slot

    def _grow(self, num_slots: int, vocab: int) -> None:
        extra = num_slots - len(self.owners)
        self.prompt_mask = torch.cat([self.prompt_mask.view(-1, vocab), self.prompt_mask.new_zeros(extra, vocab)])
        self.output_counts = torch.cat([self.output_counts.view(-1, vocab), self.output_counts.new_zeros(extra, vocab)])
        self.owners += [None] * extra
        self.num_counted += [0] * extra


class TokenTables:
    """Per-InputBatch-row token tables on the model's device, written once when a sequence takes its row (from
    SamplingRows.new_token_rows, at the next step that needs them), then only gathered: allowed_token_ids as a
    mask [rows, V] (True: not allowed) and logit_bias as (token id, bias) pairs [rows, W], padded with (0, 0.0).
    Each is allocated when a row first uses it. A row's entries are stale once its sequence leaves: only rows whose
    flags say so are gathered."""

    def __init__(self, num_rows: int, upload: HostStaging):
        self.num_rows = num_rows
        self.upload = upload  # the runner's staging ring
        self.disallowed: torch.Tensor | None = None  # [num_rows, V] bool
        self.bias_ids: torch.Tensor | None = None  # [num_rows, W] int64
        self.bias_values: torch.Tensor | None = None  # [num_rows, W] fp32

    def write(self, new_rows: dict[int, SamplingParams], vocab: int) -> None:
        """Fill the tables of new_rows (then emptied) in one upload."""
        allowed = {row: p.allowed_token_ids for row, p in new_rows.items() if p.allowed_token_ids is not None}
        bias = {row: p.logit_bias for row, p in new_rows.items() if p.logit_bias}
        new_rows.clear()
        host = {}
        if allowed:
            rows = np.fromiter(allowed, dtype=np.int64)
            ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in allowed.values()])
            host["allowed_rows"] = rows
            host["allowed_pairs"] = np.stack([np.repeat(rows, [len(ids) for ids in allowed.values()]), ids])
        if bias:
            width = max(map(len, bias.values()))
            self._grow_bias(width)
            ids = np.zeros((len(bias), self.bias_ids.shape[1]), dtype=np.int64)
            values = np.zeros(ids.shape, dtype=np.float32)
            for i, b in enumerate(bias.values()):
                ids[i, :len(b)], values[i, :len(b)] = list(b), list(b.values())
            host.update(bias_rows=np.fromiter(bias, dtype=np.int64), bias_ids=ids, bias_values=values)
        if not host:
            return
        device = dict(zip(host, self.upload(*host.values())))
        if allowed:
            if self.disallowed is None:
                self.disallowed = torch.ones(self.num_rows, vocab, dtype=torch.bool, device=self.upload.device)
            self.disallowed.index_fill_(0, device["allowed_rows"], True)  # no Python scalars: see PenaltyCache.gather
            self.disallowed.index_put_(tuple(device["allowed_pairs"]), self.disallowed.new_zeros(()))
        if bias:
            self.bias_ids[device["bias_rows"]] = device["bias_ids"]
            self.bias_values[device["bias_rows"]] = device["bias_values"]

    def _grow_bias(self, width: int) -> None:
        """Room for `width` pairs a row (a power of two, so that growing is rare); the rows kept as they are."""
        have = 0 if self.bias_ids is None else self.bias_ids.shape[1]
        if width <= have:
            return
        new = 1 << (width - 1).bit_length()
        ids = torch.zeros(self.num_rows, new, dtype=torch.int64, device=self.upload.device)
        values = torch.zeros(self.num_rows, new, dtype=torch.float32, device=self.upload.device)
        if have:
            ids[:, :have], values[:, :have] = self.bias_ids, self.bias_values
        self.bias_ids, self.bias_values = ids, values


class HostTransfer:
    """Brings a step's small result tensors (token ids, logprobs) to the host in one copy. On CUDA, start() queues it
    non_blocking into one of two pinned buffers and records an event, and Results.wait() waits for that event alone,
    not for work queued after it: a step scheduled ahead (async scheduling) runs meanwhile, its results going to the
    other buffer. On the CPU nothing is copied."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers = [torch.empty(0, dtype=torch.float64) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else []  # one per buffer
        self.turn = 0

    def start(self, tensors: list[torch.Tensor]) -> "Results":
        if self.device.type != "cuda" or not tensors:
            return Results(tensors)
        # float64 holds token ids, ranks (< 2^53) and fp32 logprobs exactly.
        flat = torch.cat([t.reshape(-1).double() for t in tensors])
        # At most two steps' results are unread at once: the one in flight and the one scheduled ahead.
        self.turn ^= 1
        if self.buffers[self.turn].numel() < flat.numel():
            self.buffers[self.turn] = torch.empty(2 * flat.numel(), dtype=torch.float64, pin_memory=True)
        host = self.buffers[self.turn][:flat.numel()]
        host.copy_(flat, non_blocking=True)
        self.copied[self.turn].record()
        return Results(host=host, copied=self.copied[self.turn], layout=[(t.shape, t.dtype) for t in tensors])


@dataclass
class Results:
    """A step's result tensors on their way to the host (see HostTransfer)."""
    tensors: list[torch.Tensor] | None = None  # on the host: at once on the CPU, else once waited for
    host: torch.Tensor | None = None  # else the pinned buffer they are copied into, flat, in float64,
    copied: torch.cuda.Event | None = None  # recorded after that copy,
    layout: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)  # with each one's shape and dtype

    def wait(self) -> list[torch.Tensor]:
        if self.tensors is None:  # kept: the next step's sampling may read them first (see ModelRunner.last_launch)
            self.copied.synchronize()
            parts = self.host.split([shape.numel() for shape, _ in self.layout])
            self.tensors = [p.view(shape).to(dtype, copy=True) for p, (shape, dtype) in zip(parts, self.layout)]
        return self.tensors
