"""A model's adapter slots: a LoRALayer on every dense projection it has, filled slot by slot from PEFT adapters
(this rank's shards) when a step first needs them, and the step's token groups those layers read."""
import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanoinfer.layers.linear import LinearBase
from nanoinfer.lora.adapter import read_peft_adapter
from nanoinfer.lora.layers import LoRALayer, LoRAStep
from nanoinfer.lora.request import LoRARequest
from nanoinfer.lora.slots import LoRAMapping
from nanoinfer.utils.loader import checkpoint_target

logger = logging.getLogger(__name__)

# The dense attention and MLP projections, packed (as the models hold them) or not (as some checkpoints name them);
# fc1 / fc2: the ungated MLP of the LayerNorm families.
TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "gate_proj",
                  "up_proj", "fc1", "fc2")

# An adapter as this rank's slots take it: per layer name, its A and B (see LoRALayer.local_weights).
LocalAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAModel:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 upload: Callable[..., list[torch.Tensor]]):
        """Before process_weights_after_loading: the layers' weights still have their shapes. upload: host arrays to
        the model's device (the runner's HostStaging: pinned, non_blocking), for each step's token groups."""
        self.model_name = type(model).__name__
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules_mapping", {})
        self.substitutions: dict[str, str] = getattr(model, "weight_name_substitutions", {})
        self.step = LoRAStep()
        self.modules = {name: m for name, m in model.named_modules()
                        if isinstance(m, LinearBase) and name.rpartition(".")[2] in TARGET_MODULES}
        self.layers: dict[str, LoRALayer] = {}
        for name, module in self.modules.items():
            leaf = name.rpartition(".")[2]
            shard_ids = [shard_id for dest, shard_id in self.packed.values() if dest == leaf] or [None]
            module.lora = self.layers[name] = LoRALayer(module, shard_ids, max_loras, max_lora_rank, self.step)
        self.device = next(model.parameters()).device
        self.upload = upload
        self.resident: list[int | None] = [None] * max_loras  # the lora_int_id each slot holds, once written
        self.known: dict[int, LoRARequest] = {}  # every adapter checked so far, by id
        # Checked adapters waiting for a slot (at most max_loras, the oldest dropped: read again when needed).
        self.checked: OrderedDict[int, LocalAdapter] = OrderedDict()

    def check(self, request: LoRARequest) -> None:
        """Read and validate an adapter when a request first names it (rank 0), so that a bad one is refused where
        it enters; an id stands for one adapter for the engine's life."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.path) != (request.lora_name, request.path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                                 f"{known.path!r}; got {request.lora_name!r} at {request.path!r}")
            return
        self.checked[request.lora_int_id] = self.local_adapter(request)
        self.known[request.lora_int_id] = request
        while len(self.checked) > self.max_loras:
            self.checked.popitem(last=False)

    def local_adapter(self, request: LoRARequest) -> LocalAdapter:
        """An adapter's A and B per layer it targets, as this rank's slots hold them."""
        adapter = read_peft_adapter(request, self.max_lora_rank)
        targets: dict[str, dict] = {}
        for module, (key, lora_a, lora_b) in adapter.modules.items():
            name, shard_id = self._target(module, key, adapter.file)
            layer_targets = targets.setdefault(name, {})
            layer_targets[shard_id] = key, lora_a, lora_b
            if None in layer_targets and len(layer_targets) > 1:  # a fused module (all of its rows) and a part of it
                keys = sorted(k for k, _, _ in layer_targets.values())
                raise ValueError(f"{adapter.file} targets {name!r} twice: {keys}")
        weights = {}
        for name, layer_targets in targets.items():
            try:
                weights[name] = self.layers[name].local_weights(self.modules[name], layer_targets, adapter.scale)
            except ValueError as e:
                keys = [key for key, _, _ in layer_targets.values()]
                raise ValueError(f"cannot load LoRA tensors {keys} in {adapter.file}: {e}") from None
        return weights

    def _target(self, module: str, key: str, file: object) -> tuple[str, int | str | None]:
        """The layer (and its sub-projection; None: all of it, e.g. a checkpoint's fused qkv) that an adapter's module
        name means, as for checkpoint weights."""
        param, shard_id = checkpoint_target(f"{module}.weight", self.packed, self.substitutions)
        name = param.removesuffix(".weight")
        if name not in self.layers or shard_id not in (None, *self.layers[name].shard_ids):
            raise ValueError(f"tensor {key!r} in {file}: LoRA on {module!r} is not supported by {self.model_name} "
                             "(only on the dense attention and MLP projections: q/k/v/o_proj, gate/up/down_proj)")
        return name, shard_id

    def set_step(self, mapping: LoRAMapping | None, groups: bool = True) -> None:
        """Before a forward pass: write the adapters its slots must hold where they do not yet, and publish its
        token groups to the layers (None: no token has an adapter, and the layers do nothing); without groups for a
        step replayed from a decode graph, which reads each token's slot from its static buffer instead."""
        self.step.groups = []
        if mapping is None:
            return
        for slot, request in mapping.adapters.items():
            if self.resident[slot] != request.lora_int_id:
                self._load(slot, request)
        if groups:
            arrays = [rows for _, rows in mapping.groups if not isinstance(rows, slice)]
            uploaded = iter(self.upload(*arrays) if arrays else ())
            self.step.groups = [(slot, rows if isinstance(rows, slice) else next(uploaded))
                                for slot, rows in mapping.groups]

    def warm_up_mapping(self, num_tokens: int) -> LoRAMapping:
        """Every token through slot 0 in every layer, for the warm-up that sizes the KV cache on CUDA, so that it
        counts the LoRA products' temporaries: the slot is still all zeros, and the first adapter loaded there sets
        again which layers it is active in."""
        for layer in self.layers.values():
            layer.set_active(0, True)
        return LoRAMapping({}, [(0, slice(0, num_tokens))], np.zeros(num_tokens, dtype=np.int64))

    def _load(self, slot: int, request: LoRARequest) -> None:
        self.resident[slot] = None  # until every layer is written: a failure here leaves it to be written again
        weights = self.checked.pop(request.lora_int_id, None) or self.local_adapter(request)
        for name, layer in self.layers.items():
            layer.write(slot, weights.get(name))
        self.resident[slot] = request.lora_int_id
        logger.debug("LoRA adapter %r (id %d) loaded into slot %d", request.lora_name, request.lora_int_id, slot)
