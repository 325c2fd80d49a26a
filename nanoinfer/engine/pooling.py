"""How LLM.embed pools a prompt's hidden states into one vector (vLLM's pooling types "cls", "mean", "last"), and the
pooling a model asks for: its sentence-transformers config's (modules.json's Pooling module), else "mean", and
L2-normalised where that config ends in a Normalize module."""
import json
from pathlib import Path

import torch

POOLING_TYPES = ("cls", "mean", "last")
# sentence-transformers' Pooling config flags, by the pooling each selects.
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_lasttoken": "last"}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


def pool(hidden_states: torch.Tensor, lens: list[int], pooling: str) -> torch.Tensor:
    """Packed prompts' hidden states [tokens, hidden] (lens[i] tokens of prompt i, in order) -> [prompts, hidden] in
    fp32: each prompt's first token's ("cls"), its last one's, or the mean of its tokens."""
    if pooling == "mean":
        return torch.stack([h.float().mean(0) for h in hidden_states.split(lens)])
    sizes = torch.tensor(lens)
    ends = sizes.cumsum(0)
    rows = ends - sizes if pooling == "cls" else ends - 1
    return hidden_states[rows.to(hidden_states.device)].float()


def model_pooling(model_path: Path) -> str:
    """The pooling of the model directory's sentence-transformers config (modules.json, then its Pooling module's
    config.json), or "mean" without one; a ValueError naming the file where it asks for one not in POOLING_TYPES."""
    pooling_dir = next((m.get("path") for m in _modules(model_path) if m.get("type") == _POOLING_MODULE), None)
    if pooling_dir is None:
        return "mean"
    config_file = model_path / pooling_dir / "config.json"
    config = _read_json(config_file)
    modes = sorted(name for name, on in (config or {}).items() if name.startswith("pooling_mode_") and on is True)
    if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
        raise ValueError(f"{config_file} asks for pooling {modes}; supported: one of "
                         f"{sorted(_SENTENCE_TRANSFORMERS_MODES)}; pass embed(pooling=...) to choose one of "
                         f"{list(POOLING_TYPES)}")
    return _SENTENCE_TRANSFORMERS_MODES[modes[0]]


def model_normalizes(model_path: Path) -> bool:
    """Whether the model directory's sentence-transformers config L2-normalises its embeddings (a Normalize module,
    as all-MiniLM-L6-v2's and BGE's have)."""
    return any(m.get("type") == _NORMALIZE_MODULE for m in _modules(model_path))


def _modules(model_path: Path) -> list[dict]:
    """The modules of the directory's sentence-transformers config (modules.json), none without one."""
    modules = _read_json(model_path / "modules.json")
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def _read_json(file: Path) -> object:
    """The file's JSON value, None if there is no such file; a ValueError naming it if it does not parse."""
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
