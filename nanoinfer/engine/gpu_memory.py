"""Sizes the KV cache on CUDA from the memory left after a warm-up forward of the largest step."""
from collections.abc import Callable

import torch


def settled_mem_info(device: torch.device) -> tuple[int, int]:
    """(free, total) with the allocator's cache emptied first: memory it only caches (freed activations) is free."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def state_bytes_for_gpu(total: int, free: int, utilization: float) -> int:
    """Recurrent-state bytes: half of what utilization * total leaves after what is in use now (total - free, read
    with the allocator's cache emptied); the KV cache, sized after it by the warm-up, takes what then remains."""
    return max(0, int(total * utilization - (total - free)) // 2)


def kv_cache_blocks_for_gpu(total: int, free: int, peak: int, current: int, utilization: float,
                            block_bytes: int) -> int:
    """Blocks that fit in utilization * total, after what is in use now (weights, CUDA context, other processes:
    total - free, read with the allocator's cache emptied) and the activation headroom the warm-up needed above
    what stays allocated (peak - current)."""
    budget = total * utilization - (total - free) - (peak - current)
    return max(0, int(budget) // block_bytes)


def profile_kv_cache_blocks(warm_up: Callable[[], None], device: torch.device, utilization: float,
                            block_bytes: int) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warm_up()
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    # The warm-up's activations are freed but still cached by the allocator: counted in total - free they would
    # be subtracted twice, once as in use and once as the headroom peak - current.
    free, total = settled_mem_info(device)
    return kv_cache_blocks_for_gpu(total, free, stats["allocated_bytes.all.peak"],
                                   stats["allocated_bytes.all.current"], utilization, block_bytes)
