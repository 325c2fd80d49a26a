"""Per-sequence recurrent state in slots (Gated DeltaNet, Mamba2, short convolutions): the base of the layers that
keep it, where each sequence of a step finds its slot, the causal depthwise conv they all start with, and the loading
of a tensor-parallel rank's channels of their weights (by linear.py's row segments)."""
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.attention import AttentionMetadata
from nanoinfer.layers.linear import Segments, load_row_shards, load_segments, local_rows

def load_rank_rows(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """This rank's equal share of dim 0 (per-head or per-channel parameters)."""
    load_row_shards(param, loaded, [(loaded.shape[0], True)])


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (+ bias, + SiLU). x [..., n, C] new inputs, state [..., K-1, C] the inputs just before
    them (zeros at a sequence's start), weight [C, K] (the oldest input's tap first), or taps of each token's own
    [..., n, C, K] -> (output [..., n, C], the new state). In 16-bit dtypes the
    products, their sum and the bias are taken in fp32 and rounded once before the SiLU, as F.conv1d (transformers'
    conv) does; in fp32 and fp64 the casts are no-ops."""
    windows, state = causal_windows(x, state)
    acc = torch.promote_types(x.dtype, torch.float32)
    out = (windows.to(acc) * weight.to(acc)).sum(-1)  # windows [..., n, C, K] . weight
    if bias is not None:
        out = out + bias.to(acc)
    out = out.to(x.dtype)
    return F.silu(out) if silu else out, state


def causal_windows(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n, C] new inputs, state [..., K-1, C] the inputs just before them -> (each input's window [..., n, C,
    K]: the K-1 inputs before it, then itself; the new state)."""
    full = torch.cat((state, x), -2)
    return full.unfold(-2, state.shape[-2] + 1, 1), full[..., full.shape[-2] - state.shape[-2]:, :]


@dataclass
class RecurrentBatch:
    """Where each sequence of a step keeps its recurrent state, derived once per step from the metadata."""
    fresh_slots: torch.Tensor  # slots of sequences starting at position 0: their state starts from zeros
    single_rows: torch.Tensor  # token rows of the sequences computing one token (batched recurrent form)
    single_slots: torch.Tensor
    spans: list[tuple[int, int, int]]  # (start row, end row, slot) of the others (chunked form, one at a time)

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata) -> "RecurrentBatch":
        if meta.state_slots is None:  # the encoder pass of LLM.embed: no sequences, no state
            raise ValueError("The model's recurrent layers (linear attention, state-space or convolution) are "
                             "causal: the model cannot run as a bidirectional encoder (LLM.embed)")
        if meta.is_decode:
            # One token per sequence: derived on the device alone, as a decode graph captures it. A sequence at its
            # first token starts from zeros; every other row resets the spare slot -1 instead (a graph's padding
            # rows use it too).
            slots = meta.state_slots
            return cls(fresh_slots=torch.where(meta.context_lens == 1, slots, -1),
                       single_rows=meta.cu_seqlens_q[:-1].long(), single_slots=slots, spans=[])
        host = meta.on_host
        cu, ctx, slots = host.cu_seqlens_q.tolist(), host.context_lens.tolist(), host.state_slots.tolist()
        single = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] == 1]

        def index(values: list[int]) -> torch.Tensor:  # where the state lives; not waiting for the queued work
            return torch.tensor(values, dtype=torch.long).to(meta.context_lens.device, non_blocking=True)

        return cls(
            fresh_slots=index([s for i, s in enumerate(slots) if ctx[i] == cu[i + 1] - cu[i]]),
            single_rows=index([cu[i] for i in single]),
            single_slots=index([slots[i] for i in single]),
            spans=[(cu[i], cu[i + 1], slots[i]) for i in range(meta.num_seqs) if cu[i + 1] - cu[i] > 1],
        )


class RowShardedWeight(nn.Module):
    """A weight [rows, *row_shape] and an optional bias [rows] that a layer applies itself (a depthwise conv's, in
    nn.Conv1d's layout [channels, 1, K] as checkpoints store it; Mamba's dt_proj): this rank's rows of `segments`."""

    def __init__(self, segments: Segments, row_shape: tuple[int, ...], bias: bool):
        super().__init__()
        self.segments = segments
        rows = local_rows(segments)
        self.weight = nn.Parameter(torch.empty(rows, *row_shape), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        load_segments(param, loaded, self.segments, shard_id)


class RecurrentLayer(nn.Module):
    """The recurrent counterpart of Attention: keeps every running sequence's state in a slot of its own across
    steps (the tensors allocated by ModelRunner, the slot assigned by the BlockManager): the conv's latest inputs,
    in the model's dtype, and, for layers with one, a recurrent state in fp32 at least (as transformers keeps it)."""

    def __init__(self, conv_kernel_size: int, conv_dim: int, ssm_state_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.conv_state_shape = (conv_kernel_size - 1, conv_dim)
        self.ssm_state_shape = ssm_state_shape
        self.conv_state = torch.empty(0)  # [num_slots, K-1, conv_dim]
        self.ssm_state = torch.empty(0)  # [num_slots, *ssm_state_shape]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The layer's own per-head or per-channel parameters (A_log, D, ...): this rank's share of them."""
        load_rank_rows(param, loaded)

    @staticmethod
    def ssm_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        ssm = math.prod(self.ssm_state_shape) * self.ssm_dtype(dtype).itemsize if self.ssm_state_shape else 0
        return math.prod(self.conv_state_shape) * dtype.itemsize + ssm

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv_state = torch.zeros(num_slots, *self.conv_state_shape, dtype=dtype, device=device)
        if self.ssm_state_shape:
            self.ssm_state = torch.zeros(num_slots, *self.ssm_state_shape, dtype=self.ssm_dtype(dtype), device=device)

    def free_state(self) -> None:
        self.conv_state = self.ssm_state = torch.empty(0)

    def reset_fresh_slots(self, batch: RecurrentBatch) -> None:
        """Sequences starting at position 0 start from zeros, whatever the slot's last sequence left there (fills,
        not assignments of a number: no tensor made from host data, which a graph would capture as a constant)."""
        if batch.fresh_slots.numel():
            self.conv_state.index_fill_(0, batch.fresh_slots, 0)
            if self.ssm_state_shape:
                self.ssm_state.index_fill_(0, batch.fresh_slots, 0)

    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, batch: RecurrentBatch,
                    bias: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
        """x [tokens, conv_dim] -> the conv over each sequence's inputs, carried on from its state (updated). weight
        [conv_dim, K], or [tokens, conv_dim, K]: each token's own taps (Inkling-2's dynamic convs)."""
        def conv(xs: torch.Tensor, state: torch.Tensor, rows: torch.Tensor | slice
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            taps = weight if weight.dim() == 2 else weight[rows].view(*xs.shape, -1)  # the rows of xs, shaped as xs
            return causal_conv1d(xs, state, taps, bias, silu)
        return self.carry_conv_state(x, batch, conv)

    def causal_windows(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """x [tokens, conv_dim] -> each token's window [tokens, conv_dim, K]: the K-1 inputs of its sequence before
        it (from the state, updated; zeros before a sequence's start), then its own; for convs a layer runs itself
        (ZAYA's)."""
        return self.carry_conv_state(x, batch, lambda xs, state, rows: causal_windows(xs, state))

    def carry_conv_state(self, x: torch.Tensor, batch: RecurrentBatch,
                         fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """fn(new inputs [..., n, C], the inputs just before them [..., K-1, C], the rows of x they are) -> (outputs
        [..., n, ...], the new state), over the sequences computing one token all at once and over each other one;
        returns the outputs [tokens, ...]."""
        out: torch.Tensor | None = None
        if batch.single_rows.numel():
            rows, slots = batch.single_rows, batch.single_slots
            y, self.conv_state[slots] = fn(x[rows].unsqueeze(1), self.conv_state[slots], rows)
            out = y.new_empty(x.shape[0], *y.shape[2:])
            out[rows] = y.squeeze(1)
        for start, end, slot in batch.spans:
            y, self.conv_state[slot] = fn(x[start:end], self.conv_state[slot], slice(start, end))
            if out is None:
                out = y.new_empty(x.shape[0], *y.shape[1:])
            out[start:end] = y
        return out

    def scan(self, batch: RecurrentBatch, step: Callable[..., torch.Tensor],
             sequence: Callable[..., tuple[torch.Tensor, torch.Tensor]], *inputs: torch.Tensor) -> torch.Tensor:
        """A recurrence over each sequence's tokens carried on from its ssm_state (updated). inputs [tokens, ...];
        step(*their rows, state [S, ...]) -> outputs, for the sequences computing one token, all at once, the state
        updated in place; sequence(*its rows, state) -> (outputs, the new state), for each other one. Returns the
        outputs [tokens, ...] (a delta rule's as wide as its values, which its queries need not be)."""
        results: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        if batch.single_rows.numel():
            rows, slots = batch.single_rows, batch.single_slots
            state = self.ssm_state[slots]
            results.append((rows, step(*(t[rows] for t in inputs), state)))
            self.ssm_state[slots] = state
        for start, end, slot in batch.spans:
            y, self.ssm_state[slot] = sequence(*(t[start:end] for t in inputs), self.ssm_state[slot])
            results.append((slice(start, end), y))
        out = results[0][1].new_empty(inputs[0].shape[0], *results[0][1].shape[1:])
        for rows, y in results:
            out[rows] = y
        return out
