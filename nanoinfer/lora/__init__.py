"""Multi-LoRA serving: PEFT adapters applied per token in the linear layers, held in fixed slots."""
from nanoinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
