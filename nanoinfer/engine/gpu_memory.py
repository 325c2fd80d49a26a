"""Sizes the KV cache on CUDA from the memory left after a warm-up forward at the largest prefill shape."""
from collections.abc import Callable

import torch


def kv_cache_blocks_for_gpu(total: int, free: int, peak: int, current: int, utilization: float,
                            block_bytes: int) -> int:
    """Blocks that fit in utilization * total, after what is in use now (weights, other processes, the
    allocator's cache: total - free) and the activation headroom the warm-up needed above that (peak - current)."""
    budget = total * utilization - (total - free) - (peak - current)
    return max(0, int(budget) // block_bytes)


def profile_kv_cache_blocks(warm_up: Callable[[], None], device: torch.device, utilization: float,
                            block_bytes: int) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warm_up()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return kv_cache_blocks_for_gpu(total, free, stats["allocated_bytes.all.peak"],
                                   stats["allocated_bytes.all.current"], utilization, block_bytes)
