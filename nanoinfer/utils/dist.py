"""The tensor-parallel rank, size and process group that layers shard and communicate by: (0, 1, None) unless a
model is being built under `tp_scope`."""
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

_scope: tuple[int, int, dist.ProcessGroup | None] = (0, 1, None)


@contextmanager
def tp_scope(rank: int, size: int, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Layers constructed inside take this rank's shard and talk over group; the ModelRunner builds its model here."""
    global _scope
    previous, _scope = _scope, (rank, size, group)
    try:
        yield
    finally:
        _scope = previous


def tp_rank() -> int:
    return _scope[0]


def tp_size() -> int:
    return _scope[1]


def tp_group() -> dist.ProcessGroup | None:
    return _scope[2]
