"""One linear layer's adapter slots and their per-token application: y += scale * (x A^T) B^T, each token with
its own adapter's A and B."""
import torch
import torch.nn.functional as F

from nanoinfer.layers.linear import LinearBase, copy_weight


class LoRAStep:
    """The step's token groups, shared by every LoRALayer of a model: (slot, rows of the tokens using it) per slot
    in use; empty when no token has an adapter (then the layers do nothing). While a decode graph is captured,
    token_slots instead: each token's slot (-1: none) in the graph's static buffer, read on the device."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.token_slots: torch.Tensor | None = None


class LoRALayer:
    """This rank's part of a layer's slots: A [slots, R, in] and scale * B [out, slots, R], R holding one
    max-rank block per sub-projection the layer packs (q, k, v; gate, up) or one for an unpacked layer. Block i of
    B is zero outside sub-projection i's output rows, so one pair of products serves all of them. Sharded as the
    weight: a column-parallel layer holds all of A and its output rows of B, a row-parallel one its input columns
    of A and all of B (its partial products are summed by the layer's all-reduce). Every slot's A and B side by
    side are one matrix each, for a decode graph's products (add_every_slot)."""

    def __init__(self, layer: LinearBase, shard_ids: list[int | str | None], max_loras: int, max_rank: int,
                 step: LoRAStep):
        out_size, in_size = layer.weight.shape
        kwargs = dict(dtype=layer.weight.dtype, device=layer.weight.device)
        self.shard_ids, self.max_rank, self.step = shard_ids, max_rank, step
        rank = len(shard_ids) * max_rank
        self.lora_a = torch.zeros(max_loras, rank, in_size, **kwargs)
        self.lora_b = torch.zeros(out_size, max_loras, rank, **kwargs)
        self.active = [False] * max_loras  # whether the slot's adapter targets this layer
        # The slot of each column of every slot's A side by side, and whether that slot is active here.
        self.column_slot = torch.arange(max_loras, device=kwargs["device"]).repeat_interleave(rank)
        self.active_columns = torch.zeros(max_loras * rank, dtype=torch.bool, device=kwargs["device"])

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        if self.step.token_slots is not None:
            self.add_every_slot(y, x, self.step.token_slots)
            return
        for slot, rows in self.step.groups:
            if not self.active[slot]:
                continue
            delta = F.linear(F.linear(x[rows], self.lora_a[slot]), self.lora_b[:, slot])
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)

    def add_every_slot(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Each token through its own slot (-1: none) in shapes the batch size alone fixes, as a decode graph needs:
        x through every slot's A at once, the columns of the other slots (and of slots whose adapter leaves this
        layer alone) zeroed, then through every slot's B at once. max_loras x rank columns: a few dozen."""
        h = F.linear(x, self.lora_a.flatten(0, 1))
        # Selected, not multiplied by the mask: another slot's column that overflowed (fp16) would give inf * 0 = NaN.
        h = torch.where((token_slots.unsqueeze(1) == self.column_slot) & self.active_columns, h, 0)
        y += F.linear(h, self.lora_b.flatten(1))

    def set_active(self, slot: int, active: bool) -> None:
        self.active[slot] = active
        self.active_columns[slot * self.lora_a.shape[1]:(slot + 1) * self.lora_a.shape[1]] = active

    def local_weights(self, layer: LinearBase, targets: dict[int | str | None, tuple[str, torch.Tensor, torch.Tensor]],
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's A and B (fp32, on the CPU) from each targeted sub-projection's (key, A [r, in], B [out, r]),
        cut to this rank's shard by the layer's own weight_loader, as its weight is. Shard id None is the whole
        (maybe fused) layer: its B holds every output row, laid out as the checkpoint's weight, in the first block."""
        a = torch.zeros(self.lora_a.shape[1:])
        b = torch.zeros(self.lora_b.shape[0], self.lora_b.shape[2])
        row_parallel = layer.tp_dim == 1
        in_features = a.shape[1] * (layer.tp_size if row_parallel else 1)
        for shard_id, (key, lora_a, lora_b) in targets.items():
            if lora_a.shape[1] != in_features:
                raise ValueError(f"{key!r} has {lora_a.shape[1]} input features, the layer {in_features}")
            start = self.shard_ids.index(shard_id) * self.max_rank if shard_id in self.shard_ids else 0
            cols = slice(start, start + lora_a.shape[0])
            lora_b = lora_b.float() * scale
            if row_parallel:
                layer.weight_loader(a[cols], lora_a)
                copy_weight(b[:, cols], lora_b)
            else:
                a[cols] = lora_a
                _load_rows(layer, b[:, cols], lora_b, shard_id)
        return a, b

    def write(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Fill a slot with local_weights' A and B; None: the slot's adapter leaves this layer alone."""
        self.set_active(slot, weights is not None)
        if weights is not None:
            self.lora_a[slot].copy_(weights[0])
            self.lora_b[:, slot].copy_(weights[1])


def _load_rows(layer: LinearBase, b: torch.Tensor, lora_b: torch.Tensor, shard_id: int | str | None) -> None:
    """B's rows laid out (and sharded) as the weight's rows of that sub-projection."""
    if shard_id is None:
        layer.weight_loader(b, lora_b)
    else:
        layer.weight_loader(b, lora_b, shard_id)
