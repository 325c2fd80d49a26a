"""The Triton layer kernels for CUDA tensors, loaded on first use; None without triton (the layers then stay
in PyTorch). CPU tensors never get here, so the CPU path never imports triton."""
import functools
import importlib.util
from types import ModuleType


@functools.cache
def triton_layers() -> ModuleType | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from nanoinfer.kernels import triton_layers as kernels
    return kernels


@functools.cache
def triton_sampling() -> ModuleType | None:
    """The sampler's race kernel; None without triton (the sampler then races in torch ops)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from nanoinfer.kernels import triton_sampling as kernels
    return kernels
