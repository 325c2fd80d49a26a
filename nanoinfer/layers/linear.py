"""Linear layers that hold this rank's shard and know how to load it from a full checkpoint tensor."""
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.utils.dist import tp_group, tp_rank, tp_size

if TYPE_CHECKING:
    from nanoinfer.lora.layers import LoRALayer


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor | None:
    """oneDNN's blocked copy of an fp32 weight: 2.5-4x the GFLOP/s of F.linear on CPU for the M of a decode step."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):  # a private op: older builds may lack it
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def copy_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """loaded: a tensor, or a checkpoint slice (utils.loader.LazyTensor) read only now, by `[...]`."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, parameter {tuple(param.shape)}")
    param.data.copy_(loaded[...])


class LinearBase(nn.Module):
    """y = x W^T + b, with W of shape [output_size, input_size] on this rank; tp_dim is the sharded dim."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size, self.tp_group = tp_rank(), tp_size(), tp_group()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None
        self.lora: LoRALayer | None = None  # adapter slots, set by LoRAModel when LoRA is enabled

    def process_weights_after_loading(self, batch_size_hint: int) -> None:
        self.packed_weight = pack_weight(self.weight, batch_size_hint)
        if self.packed_weight is not None:
            self.weight.data = self.weight.data.new_empty(0)  # the packed copy is the one used from now on

    def shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and loaded.dim() > self.tp_dim:
            if loaded.shape[self.tp_dim] != param.shape[self.tp_dim] * self.tp_size:  # shard() would round down
                raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, parameter "
                                 f"{tuple(param.shape)} on each of {self.tp_size} ranks")
            loaded = self.shard(loaded, self.tp_dim)
        copy_weight(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add_to(y, x)
        return y


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size // tp_size(), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (e.g. gate_proj and up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """shard_id: which of the stacked matrices `loaded` is; None: all of them, stacked (Phi-3's gate_up_proj)."""
        if shard_id is None:
            load_stacked(self, param, loaded, list(enumerate(self.output_sizes)))
            return
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, "
                             f"expected {self.output_sizes[shard_id]}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_weight(param.data.narrow(0, offset, size), self.shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds its query heads and their KV heads. The value heads are
    `v_head_size` wide where that differs from the query and key heads' `head_size` (MiMo-V2-Flash's)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, v_head_size: int | None = None):
        tp = tp_size()
        self.head_size, self.v_head_size = head_size, v_head_size or head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // tp
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        output_size = total_num_heads * head_size + self.num_kv_heads * tp * (head_size + self.v_head_size)
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """shard_id: "q", "k" or "v"; None: the three stacked in one tensor (Phi-3's qkv_proj)."""
        if shard_id is None:
            q_rows, kv_heads = self.total_num_heads * self.head_size, self.total_num_kv_heads
            load_stacked(self, param, loaded, [("q", q_rows), ("k", kv_heads * self.head_size),
                                               ("v", kv_heads * self.v_head_size)])
            return
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        head_size = self.v_head_size if shard_id == "v" else self.head_size
        if loaded.shape[0] != total_heads * head_size:
            raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, "
                             f"expected {total_heads} heads x {head_size}")
        q_size, k_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, k_size),
                        "v": (q_size + k_size, self.num_kv_heads * self.v_head_size)}[shard_id]
        # With fewer KV heads than ranks, neighbouring ranks share (replicate) one KV head.
        head_start = self.tp_rank * total_heads // self.tp_size
        loaded = loaded.narrow(0, head_start * head_size, size)
        copy_weight(param.data.narrow(0, offset, size), loaded)


class RegroupedQKVLinear(QKVParallelLinear):
    """A fused q/k/v projection whose checkpoint rows a family lays out its own way (GPT-NeoX's per head, Falcon's per
    KV head, CodeGen's in 4 groups): `parts` splits the whole tensor into q, k and v, each in head order, and
    QKVParallelLinear's loader takes this rank's heads of each."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = (self.total_num_heads + 2 * self.total_num_kv_heads) * self.head_size
        if loaded.shape[0] != rows:
            raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, expected {rows} "
                             f"({self.total_num_heads} + 2 x {self.total_num_kv_heads} heads x {self.head_size})")
        for shard_id, part in self.parts(loaded[...]):
            super().weight_loader(param, part.reshape(-1, *loaded.shape[1:]), shard_id)

    def parts(self, loaded: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """("q", rows), ("k", rows), ("v", rows) of the checkpoint's weight or bias, in any order."""
        raise NotImplementedError


class KeyAsValueQKVParallelLinear(QKVParallelLinear):
    """Attention whose values are its keys' projection (Gemma 4's `attention_k_eq_v`): the checkpoint has no v_proj,
    and k_proj loads into both the k and the v rows. The k rows are computed twice (a tenth or less of the layer's
    projection) so that the attention stays the ordinary q, k, v one."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, v_head_size: int | None = None):
        if v_head_size not in (None, head_size):
            raise ValueError(f"values from the key projection are as wide as the keys ({head_size}), not {v_head_size}")
        super().__init__(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.num_shards = 2  # complete once q and k arrived

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id not in ("q", "k"):
            raise ValueError(f"a {shard_id or 'stacked qkv'} projection for attention whose values are its keys")
        super().weight_loader(param, loaded, shard_id)
        if shard_id == "k":
            super().weight_loader(param, loaded, "v")


def load_stacked(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, parts: list[tuple[int | str, int]]
                 ) -> None:
    """A checkpoint tensor holding several of the layer's matrices stacked along dim 0: each part (its shard id,
    its rows) goes through the layer's weight_loader, which takes this rank's slice of it."""
    total = sum(rows for _, rows in parts)
    if loaded.shape[0] != total:
        raise ValueError(f"shape mismatch: checkpoint tensor has {loaded.shape[0]} rows, expected {total} "
                         f"({' + '.join(f'{shard_id}: {rows}' for shard_id, rows in parts)})")
    start = 0
    for shard_id, rows in parts:
        layer.weight_loader(param, loaded.narrow(0, start, rows), shard_id)
        start += rows


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // tp_size(), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed_weight)
        if self.lora is not None:  # this rank's input columns: (x A^T) B^T sums over ranks with the rest
            self.lora.add_to(y, x)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y


# Rows of a checkpoint tensor stacked along dim 0: (rows, split), each split evenly over the tensor-parallel ranks
# (True) or kept whole on every rank (False).
Segments = list[tuple[int, bool]]


def local_rows(segments: Segments) -> int:
    """Rows this rank holds of `segments`."""
    return sum(rows // tp_size() if split else rows for rows, split in segments)


def load_row_shards(param: nn.Parameter, loaded: torch.Tensor, segments: Segments) -> None:
    """Copy this rank's rows of a checkpoint tensor made of `segments`: a split one's tp_rank-th share, a whole one
    all of it, in order."""
    total = sum(rows for rows, _ in segments)
    if loaded.shape[0] != total or any(split and rows % tp_size() for rows, split in segments):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, expected {total} rows in "
                         f"segments {segments} split over {tp_size()} ranks")
    parts, start = [], 0
    for rows, split in segments:
        size = rows // tp_size() if split else rows
        parts.append(loaded.narrow(0, start + tp_rank() * size if split else start, size))
        start += rows
    copy_weight(param, torch.cat(parts))


def load_row_segment(param: nn.Parameter, loaded: torch.Tensor, segments: Segments, index: int) -> None:
    """Copy this rank's rows of a checkpoint tensor holding segment `index` of `segments` alone (OLMo Hybrid's q, k
    and v projections and convs, stored apart) to their place among this rank's rows."""
    rows, split = segments[index]
    if loaded.shape[0] != rows:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, expected {rows} rows (segment "
                         f"{index} of {segments})")
    size = rows // tp_size() if split else rows
    start = tp_rank() * size if split else 0
    copy_weight(param.data.narrow(0, local_rows(segments[:index]), size), loaded.narrow(0, start, size))


def load_segments(param: nn.Parameter, loaded: torch.Tensor, segments: Segments, shard_id: int | None) -> None:
    """A checkpoint tensor of all the segments (shard_id None) or of segment shard_id alone."""
    if shard_id is None:
        load_row_shards(param, loaded, segments)
    else:
        load_row_segment(param, loaded, segments, shard_id)


class SegmentedColumnParallelLinear(LinearBase):
    """A column-parallel layer whose output rows are segments, each split over the ranks or whole on each (Mamba2's
    in_proj: z, x, dt split by heads; B and C by groups, or whole where the groups do not split; Qwen3.5's
    in_proj_qkv)."""

    def __init__(self, input_size: int, segments: Segments, bias: bool = False):
        super().__init__(input_size, local_rows(segments), bias, tp_dim=0)
        self.segments = segments

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        load_segments(param, loaded, self.segments, shard_id)
