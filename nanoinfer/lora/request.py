"""LoRARequest: which adapter a request runs with (vLLM's vllm.lora.request.LoRARequest)."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors), known to the engine by
    lora_int_id (>= 1): requests naming the same id share its slot and their prefix-cache blocks."""
    lora_name: str
    lora_int_id: int
    lora_path: str | os.PathLike

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str):
            raise TypeError(f"lora_name must be a str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise TypeError(f"lora_path must be a path (str or os.PathLike), got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return os.fspath(self.lora_path)
