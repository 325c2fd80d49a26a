"""Engine settings given to `LLM(...)`, checked against the model's own config."""
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from nanoinfer.sampling_params import check_seed
from nanoinfer.utils.gguf_loader import load_gguf_config, resolve_gguf

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class Config:
    model: str | os.PathLike
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    hf_config: PretrainedConfig = field(init=False, repr=False)
    gguf_path: Path | None = field(init=False, default=None)
    eos_token_ids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        path = Path(os.fspath(self.model)).expanduser()
        if not path.exists():
            raise ValueError(f"model path {str(path)!r} does not exist")
        self.model_path = path
        self.gguf_path = resolve_gguf(path)
        if self.gguf_path is not None:
            self.hf_config = load_gguf_config(self.gguf_path)
        elif (path / "config.json").is_file():
            self.hf_config = AutoConfig.from_pretrained(path)
        else:
            raise ValueError(f"{str(path)!r} holds neither a config.json nor a .gguf file")
        self.torch_dtype = self._resolve_dtype()
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(limit, 4096)
        _positive("max_model_len", self.max_model_len)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size"):
            _positive(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        check_seed("seed", self.seed)
        if self.num_kvcache_blocks is not None:
            _positive("num_kvcache_blocks", self.num_kvcache_blocks)
            if self.num_kvcache_blocks * self.kvcache_block_size < self.max_model_len:
                raise ValueError(
                    f"num_kvcache_blocks={self.num_kvcache_blocks} x kvcache_block_size={self.kvcache_block_size} "
                    f"cannot hold one sequence of max_model_len={self.max_model_len}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        self._check_shardable()
        self.eos_token_ids = self._eos_token_ids()

    def _check_shardable(self) -> None:
        """Each rank holds whole heads and an equal share of the MLP; fewer KV heads than ranks are replicated."""
        tp, cfg = self.tensor_parallel_size, self.hf_config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        for name, value in (("num_attention_heads", heads), ("intermediate_size", cfg.intermediate_size)):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({value})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads ({kv_heads}): "
                             "one must divide the other")

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            # The engine runs on the CPU, where bf16/fp16 matmuls are several times slower than fp32 without AMX.
            return torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
        return _DTYPES[self.dtype]

    def _eos_token_ids(self) -> list[int]:
        eos = None
        if self.gguf_path is None and (self.model_path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        if eos is None:
            eos = self.hf_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
