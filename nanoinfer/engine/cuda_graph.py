"""Decode steps replayed from CUDA graphs, one captured per batch size; a batch is padded to the next captured
size and the LM head runs outside the graph. The bookkeeping is plain tensor code, tested on the CPU."""
import weakref
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import nn

from nanoinfer.layers.attention.metadata import AttentionMetadata
from nanoinfer.lora.layers import LoRAStep

MAX_CAPTURE_SIZE = 512
# Runners whose graphs were captured on CUDA and are alive. Every capture runs on torch's one capture stream, so the
# first allocates cuBLAS's workspace for that stream in its own graphs' pool and every later capture bakes in the same
# one: clearing the workspaces (ModelRunner.close) frees it under the graphs of any runner still alive.
CAPTURED: weakref.WeakSet["CUDAGraphRunner"] = weakref.WeakSet()


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including min(max_num_seqs, 512)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return sorted({s for s in (1, 2, 4, 8, *range(16, top + 1, 16)) if s <= top} | {top})


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs, or None (run eagerly) when num_seqs exceeds them all."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """What a decode graph reads; every row past the real sequences is inert padding."""
    input_ids: torch.Tensor  # [size] int64, padding 0
    positions: torch.Tensor  # [size] int64, padding 0
    slot_mapping: torch.Tensor  # [size] int64, padding -1: the store kernel skips the row
    context_lens: torch.Tensor  # [size] int32, padding 0: attention reads no key for the row
    block_tables: torch.Tensor  # [size, width] int32, padding -1 (never read: it lies past each context)
    # [size] int64, padding -1 (the spare slot, whose state nothing reads back); models with recurrent layers only
    state_slots: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None  # [size] int64, padding -1 (no adapter); with LoRA only


class CUDAGraph:
    """torch.cuda.CUDAGraph behind the calls the runner makes."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None], pool=None):
        """Records fn into the graph, allocating from `pool` (None: a new one); returns the pool used."""
        with torch.cuda.graph(self.graph, pool):
            fn()
        torch.cuda.synchronize()
        return self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class CUDAGraphRunner:
    """Static input buffers of the largest size, one graph per size writing into one output buffer."""

    def __init__(self, model: nn.Module, backend, max_num_seqs: int, max_model_len: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, recurrent: bool = False,
                 lora_step: LoRAStep | None = None, new_graph: Callable[[], CUDAGraph] | None = None) -> None:
        """recurrent: the model keeps recurrent state, in the slots a step's state_slots name. lora_step: the LoRA
        layers' step (LoRA enabled), whose token_slots the captured forward reads from a static buffer."""
        self.model, self.backend, self.block_size = model, backend, block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.max_seqlen_k = max_model_len
        top = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.buffers = DecodeInputs(torch.zeros(top, **i64), torch.zeros(top, **i64), torch.full((top,), -1, **i64),
                                    torch.zeros(top, **i32), torch.full((top, self.width), -1, **i32),
                                    torch.full((top,), -1, **i64) if recurrent else None,
                                    None if lora_step is None else torch.full((top,), -1, **i64))
        # cu_seqlens of a decode step: 0, 1, ..., size (recurrent layers read them on the device to find each row).
        self.cu_seqlens = torch.arange(top + 1, **i32)
        self.lora_step = lora_step
        self.outputs = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.new_graph = new_graph or CUDAGraph
        self.graphs: dict[int, CUDAGraph] = {}

    def metadata(self, size: int) -> AttentionMetadata:
        """Views of the static buffers; max_seqlen_k is the longest context a graph must serve. Only views: a graph
        reads its inputs where they were at capture, and a tensor made for one capture would be freed after it, its
        memory reused by the time the graph replays."""
        b = self.buffers
        cu = self.cu_seqlens[:size + 1]
        return AttentionMetadata(slot_mapping=b.slot_mapping[:size], block_tables=b.block_tables[:size],
                                 context_lens=b.context_lens[:size], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=1, max_seqlen_k=self.max_seqlen_k, block_size=self.block_size,
                                 state_slots=None if b.state_slots is None else b.state_slots[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first into one memory pool: it is sized by the largest and the others reuse its memory, which
        # is safe because graphs are replayed one at a time on one stream.
        pool = None
        for size in reversed(self.sizes):
            meta = self.metadata(size)
            self.backend.prepare(meta)

            def step(size: int = size, meta: AttentionMetadata = meta) -> None:
                # What layers derive from the step on the host (model_state) would be baked into the graph from the
                # warm-up's values: derived afresh, a host read fails the capture instead of replaying stale ones.
                meta.model_state = None
                if self.lora_step is not None:
                    self.lora_step.token_slots = self.buffers.lora_slots[:size]
                try:
                    self.outputs[:size] = self.model(self.buffers.input_ids[:size], self.buffers.positions[:size],
                                                     meta)
                finally:
                    if self.lora_step is not None:  # eager steps go by their token groups
                        self.lora_step.token_slots = None

            step()  # warm-up outside the graph (lazy initialisation, autotuning)
            graph = self.new_graph()
            pool = graph.capture(step, pool)
            self.graphs[size] = graph
        if self.outputs.is_cuda:
            CAPTURED.add(self)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode step of num_seqs sequences replays, or None: run it eagerly."""
        return padded_size(num_seqs, self.sizes)

    def load(self, inputs: DecodeInputs) -> DecodeInputs:
        """Copy a decode step's `inputs` (host staging, padded to a captured size) into the static buffers, one
        non_blocking copy each; returns the static views they went to, for ids fed on the device. Block-table
        columns past `inputs`' width keep ids of earlier steps; they lie past every context, so nothing reads them."""
        size, width = inputs.block_tables.shape
        static = {}
        for f in fields(inputs):
            if (src := getattr(inputs, f.name)) is None:  # a buffer this model has none of
                continue
            dst = getattr(self.buffers, f.name)
            dst = static[f.name] = dst[:size, :width] if f.name == "block_tables" else dst[:size]
            dst.copy_(src, non_blocking=True)
        return DecodeInputs(**static)

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Hidden states of the num_seqs real rows, from the graph of the padded size the inputs were loaded at."""
        self.graphs[size].replay()
        return self.outputs[:num_seqs]
