"""Loads checkpoint tensors (safetensors, single or sharded, or GGUF) into a model's fused, sharded parameters."""
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanoinfer.layers.fused_moe import expert_weight_target
from nanoinfer.layers.linear import copy_weight

# Derived buffers some checkpoints carry; they have no parameter here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LazyTensor:
    """A checkpoint tensor not read yet: a weight_loader narrows it to this rank's shard, and only that is read."""

    def __init__(self, tensor_slice, file: Path) -> None:  # safetensors' PySafeSlice, valid while its file is open
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())
        self.file = file
        self.stored_dtype: str = tensor_slice.get_dtype()  # safetensors' name: "F32", "BF16", "I64", ...

    def is_floating_point(self) -> bool:
        return self.stored_dtype.startswith(("F", "BF"))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self[(slice(None),) * dim + (slice(start, start + length),)]

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]

    def __getattr__(self, name: str):
        """Any other tensor method (a loader that needs it all, e.g. `.float()`) reads the whole tensor."""
        return getattr(self._slice[...], name)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, LazyTensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir}")
    for file in files:
        try:
            f = safe_open(file, "pt", "cpu")
        except SafetensorError as e:  # truncated, empty or not safetensors at all
            raise ValueError(f"cannot read checkpoint file {file}: {e}") from None
        with f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name), file)


def safetensors_names(model_dir: Path) -> set[str]:
    """The names of every tensor in the checkpoint's files (read from their headers)."""
    return {name for name, _ in iter_safetensors(model_dir)}


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
                 checkpoint: Path | None = None) -> None:
    """Route every checkpoint tensor to the weight_loader of the module owning its parameter (copy_weight if it
    has none), which copies this rank's slice into the parameter where it lives; fail on strays and on gaps.
    checkpoint: the file that errors name for tensors that do not know theirs (a LazyTensor does)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules_mapping", {})
    # A packed parameter is complete once every source mapped to it has arrived (experts: see FusedMoE).
    shards_per_param = {target: sum(t == target for t, _ in packed.values()) for target, _ in packed.values()}
    loaded: dict[str, set] = {}
    # Tied parameters (lm_head sharing the embedding, Zamba2's shared blocks) appear once; a checkpoint copy of the
    # alias (named as the checkpoint names it: the packed q/k/v of a shared block route to its qkv_proj) is redundant.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    ignored_prefixes: tuple[str, ...] = getattr(model, "ignored_weight_prefixes", ())
    ignored_suffixes = _IGNORED_SUFFIXES + getattr(model, "ignored_weight_suffixes", ())
    # Checkpoint names that differ from the model's own, e.g. Mixtral's `.block_sparse_moe.` for `.mlp.`.
    substitutions: dict[str, str] = getattr(model, "weight_name_substitutions", {})
    # A family whose checkpoints hold tensors no renaming maps (one to split in two: Inkling's Hub layout) converts
    # the stream first.
    convert = getattr(model, "convert_checkpoint", None)
    for name, tensor in weights if convert is None else convert(weights):
        if name.endswith(ignored_suffixes) or name.startswith(ignored_prefixes):
            continue
        target, shard = checkpoint_target(name, packed, substitutions)
        if target in aliases:
            continue
        param = params.get(target)
        lazy = isinstance(tensor, LazyTensor)
        where = f" in {tensor.file}" if lazy else f" in {checkpoint}" if checkpoint is not None else ""
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r}{where} has no parameter in {type(model).__name__}")
        if param.is_floating_point() and not tensor.is_floating_point():  # copy_ would cast it silently
            raise ValueError(f"checkpoint tensor {name!r}{where} holds {tensor.stored_dtype if lazy else tensor.dtype}"
                             f" values, but {target!r} is a floating-point parameter")
        # Looked up on the module, not stored on the parameter: a bound method there would make a module <->
        # parameter reference cycle, keeping a closed engine's weights alive until the garbage collector runs.
        weight_loader = getattr(modules[target.rpartition(".")[0]], "weight_loader", copy_weight)
        try:
            if shard is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r}{where}: {e}") from None
        loaded.setdefault(target, set()).add(shard)
    # Complete: loaded whole (shard None, e.g. all experts stacked in one tensor), or every shard arrived.
    missing = [n for n, p in params.items() if None not in loaded.get(n, ()) and len(loaded.get(n, ())) < getattr(
        p, "num_shards", shards_per_param.get(_packed_key(n, packed), 1))]
    if missing:
        where = f" {checkpoint}" if checkpoint is not None else ""
        raise ValueError(f"checkpoint{where} is missing weights for {len(missing)} parameter(s), e.g. {missing[:5]}")


def checkpoint_target(name: str, packed: dict[str, tuple[str, int | str]], substitutions: dict[str, str]
                      ) -> tuple[str, object]:
    """The parameter a checkpoint tensor's name loads into, and its shard id (None: the whole parameter)."""
    return _route(_substitute(name, substitutions), packed)


def _substitute(name: str, substitutions: dict[str, str]) -> str:
    """Each `old` replaced by its `new`, in order; an `old` that starts with "^" only at the start of the name."""
    for old, new in substitutions.items():
        if not old.startswith("^"):
            name = name.replace(old, new)
        elif name.startswith(old[1:]):
            name = new + name[len(old) - 1:]
    return name


def _route(name: str, packed: dict[str, tuple[str, int | str]]) -> tuple[str, object]:
    expert = expert_weight_target(name)  # before the packed names: an expert's gate_proj is not a dense MLP's
    if expert is not None:
        return expert
    for source, (dest, shard_id) in packed.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{dest}."), shard_id
    return name, None


def _packed_key(param_name: str, packed: dict[str, tuple[str, int | str]]) -> str | None:
    return next((dest for dest, _ in packed.values() if f".{dest}." in param_name), None)
