"""The Triton layer kernels for CUDA tensors, loaded on first use; None without triton (the layers then stay
in PyTorch). CPU tensors never get here, so the CPU path never imports triton. And what the engine's Triton kernels
have compiled in this process."""
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


def engine_kernels() -> dict:
    """The engine's Triton kernels (JITFunctions) by name; none without triton."""
    if importlib.util.find_spec("triton") is None:
        return {}
    from triton.runtime.jit import JITFunction

    from nanoinfer.kernels import triton_attention, triton_kvcache, triton_layers, triton_sampling
    return {name: fn for module in (triton_attention, triton_kvcache, triton_layers, triton_sampling)
            for name, fn in vars(module).items() if isinstance(fn, JITFunction)}


def compiled_variants() -> dict[str, int]:
    """How many variants of each of the engine's Triton kernels this process has compiled, over every device (one
    compiled while requests are served costs about a second on a cold Triton cache)."""
    return {name: sum(len(caches[0]) for caches in fn.device_caches.values()) for name, fn in engine_kernels().items()}
