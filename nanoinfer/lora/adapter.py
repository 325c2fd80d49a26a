"""Reads a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) and checks that its
settings are ones the engine applies exactly: plain LoRA on linear layers, scale alpha / r (alpha / sqrt(r) with
rsLoRA)."""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanoinfer.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: its wrappers' prefix, the base model's module name, then the adapter matrix.
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight$")
# Modules whose adapters are not linear-layer deltas (vLLM's extra vocabulary / new embeddings).
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def _false(value: object) -> bool:
    return not value


# adapter_config.json settings the engine cannot apply: (key, whether the value is fine, what is supported).
_UNSUPPORTED_SETTINGS = (
    ("peft_type", lambda v: v in (None, "LORA"), "only LoRA adapters (peft_type 'LORA') are supported"),
    ("bias", lambda v: v in (None, "none"), "only bias='none' is supported"),
    ("use_dora", _false, "DoRA adapters are not supported"),
    ("modules_to_save", _false, "fully trained modules (modules_to_save) are not supported"),
    ("rank_pattern", _false, "per-module ranks (rank_pattern) are not supported"),
    ("alpha_pattern", _false, "per-module alphas (alpha_pattern) are not supported"),
    ("fan_in_fan_out", _false, "fan_in_fan_out (Conv1D layers) is not supported"),
    ("lora_bias", _false, "LoRA biases (lora_bias) are not supported"),
    ("layer_replication", _false, "layer_replication is not supported"),
)


@dataclass
class PEFTAdapter:
    """The adapter's matrices per base-model module name (e.g. "model.layers.0.self_attn.q_proj"): (key of its
    lora_A tensor, A [r, in], B [out, r]); B is applied times `scale`."""
    file: Path  # adapter_model.safetensors, for error messages
    rank: int
    scale: float
    modules: dict[str, tuple[str, torch.Tensor, torch.Tensor]]


def read_peft_adapter(request: LoRARequest, max_lora_rank: int) -> PEFTAdapter:
    path = Path(request.path).expanduser()
    if not path.is_dir():
        raise ValueError(f"lora_path {request.path!r} of LoRA adapter {request.lora_name!r} is not a directory")
    rank, scale = _read_config(path / CONFIG_FILE, max_lora_rank)
    file = path / WEIGHTS_FILE
    return PEFTAdapter(file, rank, scale, _read_weights(file, rank))


def _read_config(file: Path, max_lora_rank: int) -> tuple[int, float]:
    """The adapter's rank and the scale of its B matrices."""
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter directory {str(file.parent)!r} holds no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    for key, fine, supported in _UNSUPPORTED_SETTINGS:
        if not fine(config.get(key)):
            raise ValueError(f"{key}={config[key]!r} in {file}: {supported}")
    _check_targets(config.get("target_modules"), file)
    rank, alpha, rslora = config.get("r", 8), config.get("lora_alpha", 8), config.get("use_rslora", False)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r={rank!r} in {file} must be an int >= 1")
    if rank > max_lora_rank:
        raise ValueError(f"r={rank} in {file} exceeds max_lora_rank={max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha={alpha!r} in {file} must be a finite number")
    if not isinstance(rslora, bool):
        raise ValueError(f"use_rslora={rslora!r} in {file} must be true or false")
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _check_targets(targets: object, file: Path) -> None:
    """target_modules: names (a module matches its own name or a dotted suffix) or one regex (PEFT's full match);
    neither may reach the embedding or the LM head."""
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise ValueError(f"target_modules={targets!r} in {file} is not a valid regex: {e}") from None
        hit = next((m for m in ("model.embed_tokens", "lm_head") if pattern.fullmatch(m)), None)
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        hit = next((t for t in targets if t.rpartition(".")[2] in _EMBEDDING_MODULES), None)
    elif targets is None:
        return
    else:
        raise ValueError(f"target_modules={targets!r} in {file} must be a list of module names or a regex string")
    if hit is not None:
        raise ValueError(f"target_modules={targets!r} in {file} reaches {hit!r}: LoRA on the embedding or the LM "
                         "head is not supported")


def _read_weights(file: Path, rank: int) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    if not file.is_file():
        raise ValueError(f"LoRA adapter directory {str(file.parent)!r} holds no {WEIGHTS_FILE} (adapter_model.bin "
                         "is not read: save the adapter with safetensors)")
    try:
        with safe_open(file, "pt", "cpu") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"cannot read LoRA weights {file}: {e}") from None
    matrices: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR_NAME.match(key)
        if m is None:
            raise ValueError(f"tensor {key!r} in {file} is not a lora_A/lora_B weight of a linear layer (embedding "
                             "adapters, biases and DoRA magnitudes are not supported)")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"tensor {key!r} in {file} must be a 2-D floating-point matrix, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        dim = 0 if m["matrix"] == "A" else 1  # A [r, in], B [out, r]
        if tensor.shape[dim] != rank:
            raise ValueError(f"tensor {key!r} in {file} has shape {tuple(tensor.shape)}: its dim {dim} must be the "
                             f"adapter's r={rank}")
        matrices.setdefault(m["module"], {})[m["matrix"]] = key, tensor
    modules = {}
    for module, pair in matrices.items():
        if len(pair) < 2:
            (key, _), = pair.values()
            raise ValueError(f"{file} holds {key!r} without its lora_{'B' if 'A' in pair else 'A'} partner")
        modules[module] = pair["A"][0], pair["A"][1], pair["B"][1]
    return modules
