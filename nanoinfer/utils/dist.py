"""Tensor-parallel rank and world size, (0, 1) when torch.distributed is not initialised."""
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
