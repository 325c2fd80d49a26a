"""The persistent input batch (vLLM v1's InputBatch): each running sequence owns a row of preallocated arrays (block
table, sampling parameters, last sampled token), and a step's model inputs are written with vectorized numpy into
fixed staging buffers, then copied once."""
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from nanoinfer.engine.cuda_graph import DecodeInputs
from nanoinfer.engine.sampling_state import SamplingRows
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.lora.slots import LoRAMapping, LoRASlots


@dataclass
class StepBuffers:
    """Flat buffers a step fills a prefix of. block_tables holds the step's [num_seqs, width] table row-major."""
    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    logit_rows: torch.Tensor  # [max_tokens] int64: hidden rows whose logits are computed
    context_lens: torch.Tensor  # [max_num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [max_num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [max_num_seqs + 1] int32
    block_tables: torch.Tensor  # [max_num_seqs * max_blocks] int32
    sampled_rows: torch.Tensor  # [max_num_seqs] int64: rows of the sequences sampled this step
    fed_index: torch.Tensor  # [max_num_seqs] int64: input_ids entries taken from last_sampled ...
    fed_rows: torch.Tensor  # [max_num_seqs] int64: ... of these rows
    state_slots: torch.Tensor  # [max_num_seqs] int64: recurrent-state slots (models with recurrent layers)
    lora_slots: torch.Tensor  # [max_num_seqs] int64: a decode step's adapter slots (LoRA enabled; -1: none)

    @classmethod
    def allocate(cls, max_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device,
                 pin_memory: bool = False) -> "StepBuffers":
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin_memory)
        i64, i32 = torch.int64, torch.int32
        return cls(buf(max_tokens, i64), buf(max_tokens, i64), buf(max_tokens, i64), buf(max_tokens, i64),
                   buf(max_num_seqs, i32), buf(max_num_seqs + 1, i32), buf(max_num_seqs + 1, i32),
                   buf(max_num_seqs * max_blocks, i32), buf(max_num_seqs, i64), buf(max_num_seqs, i64),
                   buf(max_num_seqs, i64), buf(max_num_seqs, i64), buf(max_num_seqs, i64))


class InputBatch:
    """Rows that persist across steps: block tables (written only where a sequence gained blocks), sampling
    parameters (written when a sequence gets its row) and the token last sampled into each row, kept on the
    device; and the staging buffers of a step: pinned host memory on CUDA, copied non_blocking into device
    buffers; on the CPU the staging buffers are the step's tensors.

    With feed_sampled_ids, a decode token's input id is taken on the device from last_sampled (see feed_sampled),
    so that it never has to come from the host; the host's copy of it is overwritten.

    With lora_slots (LoRA enabled), each row also holds its sequence's adapter slot, and a step's LoRAMapping is
    made from the rows (lora_mapping)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, block_size: int,
                 device: torch.device, feed_sampled_ids: bool = True, lora_slots: LoRASlots | None = None):
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest row
        self.block_table = np.full((max_num_seqs, self.max_blocks), -1, dtype=np.int32)  # -1 past each row's blocks
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)  # entries of each row written so far
        self.sampling = SamplingRows(max_num_seqs)
        self.feed_sampled_ids = feed_sampled_ids
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # The position in its sequence of the token in last_sampled (-1: none): a step whose only token for a row
        # is at that position (a decode step after the row's sampled token was appended) feeds it from there.
        self.sampled_at = np.full(max_num_seqs, -1, dtype=np.int64)
        # This step's sampled rows and the positions of the tokens sampled into them (see prepare).
        self.sampled_rows = self.sampled_positions = np.zeros(0, dtype=np.int64)
        self.num_fed = 0  # this step's input ids taken from last_sampled
        # A padded decode graph reads up to max_num_seqs rows of the token buffers too.
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.on_cuda = device.type == "cuda"
        # pin_memory needs a CUDA build with a driver: only on CUDA, where it makes non_blocking copies asynchronous.
        self.host = StepBuffers.allocate(max_tokens, max_num_seqs, self.max_blocks, torch.device("cpu"), self.on_cuda)
        self.np = {f.name: getattr(self.host, f.name).numpy() for f in fields(StepBuffers)}
        self.device = StepBuffers.allocate(max_tokens, max_num_seqs, self.max_blocks, device) if self.on_cuda \
            else self.host
        # Recorded after each step's uploads: the host buffers are rewritten only once the GPU has read them.
        self.uploaded = torch.cuda.Event() if self.on_cuda else None
        self.lora_slots = lora_slots
        self.lora_mapping: LoRAMapping | None = None  # this step's (see prepare)
        # This step's tokens given as prompt embeddings: (their indices among the step's tokens, [n, hidden] values).
        self.prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    def remove(self, seq_ids: list[int]) -> None:
        """Release the rows of finished or preempted sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.block_table[row, :self.num_blocks[row]] = -1
                self.num_blocks[row] = 0
                self.free_rows.append(row)
                if self.lora_slots is not None:
                    self.lora_slots.remove(row)

    def _add(self, seq: Sequence) -> int:
        assert self.free_rows, "more running sequences than max_num_seqs"
        row = self.rows[seq.seq_id] = self.free_rows.pop()
        self.sampling.add(row, seq)
        self.sampled_at[row] = -1
        if self.lora_slots is not None:
            self.lora_slots.add(row, seq.lora_request)
        return row

    def _sync_block_tables(self, seqs: list[Sequence], rows: np.ndarray, ends: np.ndarray) -> None:
        """Copy in the block ids each sequence gained: its row covers the blocks of its first `end` tokens."""
        have = self.num_blocks[rows]
        # A row keeps the blocks its drafts reached beyond its accepted tokens (the sequence keeps them too).
        need = np.maximum(-(-ends // self.block_size), have)
        for i in np.flatnonzero(need > have):
            self.block_table[rows[i], have[i]:need[i]] = seqs[i].block_table[have[i]:need[i]]
        self.num_blocks[rows] = need

    def _wait_for_uploads(self) -> None:
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def prepare(self, batch: ScheduledBatch, samples: list[bool]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input_ids, positions and attention metadata (views of the host staging buffers, valid until the next
        step), and the rows whose logits are sampled."""
        self._wait_for_uploads()
        self.remove(batch.freed_seq_ids)
        rows, token_ids, embeds = [], [], []
        drafts = batch.draft_token_ids
        for i, (seq, start, n) in enumerate(zip(batch.seqs, batch.starts, batch.num_new_tokens)):
            row = self.rows.get(seq.seq_id)
            rows.append(self._add(seq) if row is None else row)
            if seq.prompt_embeds is not None and start < seq.num_prompt_tokens:
                embeds.append((len(token_ids), seq.prompt_embeds[start:start + n]))
            # A pending token (async scheduling) is not on the host yet: the device feeds it (see feed_sampled).
            token_ids += seq.token_ids[start:start + n] or [0]
            if drafts and i in drafts:
                token_ids += drafts[i]
        self.prompt_embeds = _embedded_tokens(embeds) if embeds else None
        rows, num_new = np.array(rows, dtype=np.int64), np.array(batch.num_new_tokens, dtype=np.int64)
        starts = np.array(batch.starts, dtype=np.int64)
        ends = starts + num_new
        self._sync_block_tables(batch.seqs, rows, ends)
        num_seqs, num_tokens = len(rows), len(token_ids)
        h = self.np
        h["input_ids"][:num_tokens] = token_ids
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu_q[1:])
        h["cu_seqlens_q"][:num_seqs + 1] = cu_q
        h["cu_seqlens_k"][0] = 0
        np.cumsum(ends, out=h["cu_seqlens_k"][1:num_seqs + 1], dtype=np.int32)
        h["context_lens"][:num_seqs] = ends
        # Position of token j of sequence i: starts[i] + j - cu_q[i].
        positions = h["positions"][:num_tokens]
        np.subtract(np.arange(num_tokens), np.repeat(cu_q[:-1] - ends + num_new, num_new), out=positions)
        blocks = self.block_table[np.repeat(rows, num_new), positions // self.block_size]
        np.add(blocks * np.int64(self.block_size), positions % self.block_size, out=h["slot_mapping"][:num_tokens])
        width = int(self.num_blocks[rows].max())
        np.take(self.block_table[:, :width], rows, axis=0,
                out=h["block_tables"][:num_seqs * width].reshape(num_seqs, width))
        b = self.host
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:num_tokens],
            block_tables=b.block_tables[:num_seqs * width].view(num_seqs, width),
            context_lens=b.context_lens[:num_seqs],
            cu_seqlens_q=b.cu_seqlens_q[:num_seqs + 1],
            cu_seqlens_k=b.cu_seqlens_k[:num_seqs + 1],
            max_seqlen_q=int(num_new.max()),
            max_seqlen_k=int(ends.max()),
            block_size=self.block_size,
            has_cached_prefix=bool(ends.sum() > num_tokens),
        )
        sampled = np.array(samples, dtype=bool)
        sampled_seq_rows = rows[sampled]
        if drafts:
            sample_rows = self._sample_drafts(batch, rows, ends, cu_q, sampled)
        else:
            self.sampled_rows, self.sampled_positions = sampled_seq_rows, ends[sampled]
            sample_rows = cu_q[1:][sampled] - 1
        if self.lora_slots is not None:
            self.lora_mapping = self.lora_slots.mapping(rows, num_new)
        if self.feed_sampled_ids:
            h["sampled_rows"][:len(sampled_seq_rows)] = sampled_seq_rows  # once per sequence: see record_verified
            fed = (num_new == 1) & (self.sampled_at[rows] == starts)
            self.num_fed = np.count_nonzero(fed)
            h["fed_index"][:self.num_fed] = cu_q[:-1][fed]
            h["fed_rows"][:self.num_fed] = rows[fed]
        return b.input_ids[:num_tokens], b.positions[:num_tokens], meta, sample_rows.tolist()

    def _sample_drafts(self, batch: ScheduledBatch, rows: np.ndarray, ends: np.ndarray, cu_q: np.ndarray,
                       sampled: np.ndarray) -> np.ndarray:
        """The hidden rows sampled in a step with drafts: every position of a drafted sequence (each draft's and the
        one after the last), so sampled_rows/positions repeat its row once per position. Its sequences' sampled
        tokens are kept once verified (record_verified), not by record_sampled."""
        counts = sampled.astype(np.int64)
        counts[list(batch.draft_token_ids)] += [len(d) for d in batch.draft_token_ids.values()]
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        self.sampled_rows = np.repeat(rows, counts)
        self.sampled_positions = np.repeat(ends - counts + 1, counts) + offsets
        return np.repeat(cu_q[1:] - counts, counts) + offsets

    def record_verified(self, token_ids: torch.Tensor, positions: np.ndarray) -> None:
        """A step with drafts: keep each sampled sequence's last emitted token (token_ids [S], on the device, at
        `positions`) in its row, for the next step to feed."""
        if not self.feed_sampled_ids:
            return
        self.sampled_at[self.host.sampled_rows[:len(positions)].numpy()] = positions
        self.last_sampled[self.device.sampled_rows[:len(positions)]] = token_ids  # uploaded by feed_sampled

    def _stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t in the host staging buffer `name` (copied there unless it is already that buffer's prefix)."""
        buf = getattr(self.host, name)
        if t.data_ptr() == buf.data_ptr():
            return t
        return buf[:t.numel()].view(t.shape).copy_(t)

    def _upload(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Host tensor t (a step input) in this rank's device buffer `name`: one non_blocking copy from staging."""
        return getattr(self.device, name)[:t.numel()].view(t.shape).copy_(self._stage(name, t), non_blocking=True)

    def to_device(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's inputs (prepare()'s host tensors, or the same received from rank 0) in this rank's device
        buffers. On the CPU nothing is copied."""
        if not self.on_cuda:
            return input_ids, positions, meta
        self._wait_for_uploads()
        names = ("input_ids", "positions", "slot_mapping", "context_lens", "cu_seqlens_q", "cu_seqlens_k",
                 "block_tables")
        ids, pos, slots, ctx, cu_q, cu_k, tables = (
            self._upload(name, t) for name, t in zip(names, (input_ids, positions, meta.slot_mapping,
                                                              meta.context_lens, meta.cu_seqlens_q,
                                                              meta.cu_seqlens_k, meta.block_tables)))
        state_slots = None if meta.state_slots is None else self._upload("state_slots", meta.state_slots)
        return ids, pos, replace(meta, slot_mapping=slots, block_tables=tables, context_lens=ctx, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, state_slots=state_slots, host=meta)

    def state_slots(self, slots: list[int]) -> torch.Tensor:
        """The recurrent-state slots of a step's sequences (after prepare), in their host staging buffer."""
        self.np["state_slots"][:len(slots)] = slots
        return self.host.state_slots[:len(slots)]

    def logit_index(self, logit_rows: list[int]) -> torch.Tensor:
        """logit_rows as an index tensor on this rank's device."""
        self._wait_for_uploads()
        rows = self.host.logit_rows[:len(logit_rows)]
        self.np["logit_rows"][:len(logit_rows)] = logit_rows
        return self._upload("logit_rows", rows) if self.on_cuda else rows

    def decode_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      size: int, lora_mapping: LoRAMapping | None = None) -> DecodeInputs:
        """A decode step's inputs padded to `size` rows in the host staging buffers (token 0, position 0, slot -1,
        context length 0, no blocks, the spare recurrent-state slot -1, no adapter), for a graph to copy into its
        static buffers; with LoRA, each token's adapter slot from the step's lora_mapping (None: none has one)."""
        self._wait_for_uploads()
        n, width = meta.block_tables.shape
        for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", meta.slot_mapping),
                        ("context_lens", meta.context_lens), ("block_tables", meta.block_tables),
                        ("state_slots", meta.state_slots)):
            if t is not None:
                self._stage(name, t)
        h = self.np
        h["input_ids"][n:size] = h["positions"][n:size] = h["context_lens"][n:size] = 0
        h["slot_mapping"][n:size] = h["state_slots"][n:size] = -1
        h["block_tables"][n * width:size * width] = -1
        if self.lora_slots is not None:
            h["lora_slots"][:size] = -1
            if lora_mapping is not None:
                h["lora_slots"][:n] = lora_mapping.token_slots
        b = self.host
        return DecodeInputs(b.input_ids[:size], b.positions[:size], b.slot_mapping[:size], b.context_lens[:size],
                            b.block_tables[:size * width].view(size, width),
                            None if meta.state_slots is None else b.state_slots[:size],
                            None if self.lora_slots is None else b.lora_slots[:size])

    def feed_sampled(self, input_ids: torch.Tensor) -> None:
        """Overwrite, on this rank's device, the input ids of this step's decode tokens that were sampled into
        their rows by the previous step (input_ids: the step's ids there, a graph's static buffer included); and
        upload the rows this step samples into, for record_sampled, with the step's other inputs."""
        if not self.feed_sampled_ids:
            return
        if self.on_cuda:
            self._upload("sampled_rows", self.host.sampled_rows[:len(self.sampled_rows)])
        if not self.num_fed:
            return
        index, rows = self.host.fed_index[:self.num_fed], self.host.fed_rows[:self.num_fed]
        if self.on_cuda:
            index, rows = self._upload("fed_index", index), self._upload("fed_rows", rows)
        input_ids[index] = self.last_sampled[rows]

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        """Keep this step's sampled tokens (in the order of prepare's sample_rows) on the device, in their rows."""
        if not self.feed_sampled_ids:
            return
        self.last_sampled[self.device.sampled_rows[:len(self.sampled_rows)]] = token_ids  # uploaded by feed_sampled
        self.sampled_at[self.sampled_rows] = self.sampled_positions

    def record_uploads(self) -> None:
        """Mark the host buffers free to rewrite once the uploads queued so far have run."""
        if self.uploaded is not None:
            self.uploaded.record()


def _embedded_tokens(pieces: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of its first token in the step, embeddings) per sequence -> (every embedded token's index, values)."""
    index = torch.cat([torch.arange(first, first + len(values)) for first, values in pieces])
    return index, torch.cat([values for _, values in pieces])
