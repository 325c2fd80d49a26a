"""Memory as a GPU would treat it, on a CPU, for the tests: check_memory_bounds() fails an interpreted Triton
kernel's load or store outside the tensors it was launched with; poison_empty() fills the memory torch.empty and
its kin return with NaN (integers: a huge value), as a GPU's caching allocator hands back an earlier tensor's bytes
where a CPU's fresh pages are zeros, so that a read of memory nothing wrote shows.

The interpreted Triton tests use both. As a pytest plugin it poisons torch.empty for a whole run, by hand (it slows
every allocation; not part of the suite): PYTHONPATH=tests python -m pytest -p gpu_like_memory -m "not cuda"
"""
import functools

import numpy as np
import torch
import torch.utils._device


class OutOfBounds(AssertionError):
    pass


def _extents(args) -> list[tuple[int, int]]:
    """[first byte, last byte + 1) of each tensor argument, as the kernel sees it (a view: its own elements only)."""
    spans = []
    for arg in args:
        if isinstance(arg, tuple):
            spans += _extents(arg)
        elif isinstance(arg, torch.Tensor) and arg.numel() > 0:
            last = sum((size - 1) * stride for size, stride in zip(arg.shape, arg.stride()))
            spans.append((arg.data_ptr(), arg.data_ptr() + (last + 1) * arg.element_size()))
    return sorted(spans)


def check_memory_bounds() -> None:
    """Every address an interpreted kernel loads or stores (its active lanes) must lie inside a tensor it was launched
    with. On a GPU an access outside them reads or overwrites another tensor or faults (an illegal address, which
    ends the process's CUDA context); the interpreter reads host memory and lets it pass silently."""
    from triton.runtime import interpreter
    launch: list[tuple[str, list[tuple[int, int]]]] = []  # the kernel running now and its tensors' extents
    init_args, load, store = (interpreter.GridExecutor._init_args_hst, interpreter.InterpreterBuilder.create_masked_load,
                              interpreter.InterpreterBuilder.create_masked_store)

    def recording_init(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        launch[:] = [(self.fn.__name__, _extents([*args_hst, *kwargs_hst.values()]))]
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        name, spans = launch[0]
        itemsize = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64)
        starts = np.array([s for s, _ in spans] or [0], dtype=np.int64)
        ends = np.array([e for _, e in spans] or [0], dtype=np.int64)
        i = np.searchsorted(starts, addresses, side="right") - 1
        outside = addresses[(i < 0) | (addresses + itemsize > ends[i.clip(0)])]
        if outside.size:
            raise OutOfBounds(f"{name} {what}s {outside.size} addresses outside its tensors, e.g. {outside[0]:#x} "
                              f"(tensors at {[(hex(s), e - s) for s, e in spans]})")

    def checked_load(self, ptrs, mask, *args):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *args)

    def checked_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    interpreter.GridExecutor._init_args_hst = recording_init
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store


def _poison(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max // 3  # an index far out of every range


def _poisoned(make):
    @functools.wraps(make)
    def poisoned_make(*args, **kwargs):
        t = make(*args, **kwargs)
        if t.device.type != "meta" and t.numel():
            with torch.no_grad():
                t.fill_(_poison(t.dtype))
        return t
    return poisoned_make


def poison_empty() -> None:
    # `with torch.device(...)` redirects the constructors in a set it builds once: built now, it holds torch's own
    # torch.empty, which the poisoned one calls, so a model built under it still lands on that device.
    torch.utils._device._device_constructors()
    torch.empty, torch.empty_like = _poisoned(torch.empty), _poisoned(torch.empty_like)
    torch.empty_strided = _poisoned(torch.empty_strided)
    torch.Tensor.new_empty = _poisoned(torch.Tensor.new_empty)


def pytest_configure(config) -> None:
    poison_empty()
