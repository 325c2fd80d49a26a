"""Builds the CPU path's C kernels with the system compiler once per machine (cached), and calls them via ctypes.

Every wrapper takes fp32 CPU tensors; callers check `use_cpu_kernels(x)` first and keep a PyTorch path for
everything else (other dtypes and devices, or a machine where the kernels could not be built)."""
import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from nanoinfer.utils.default_model import cache_dir

_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention_cpu.c", "fused_ops_cpu.c")]
# -fopenmp: the library's libgomp.so.1 resolves to the one torch has already loaded (same soname).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention": [_P] * 6 + [_I] * 9 + [_F, _F, _P, _P],
    "rms_norm": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _F, _I],
    "rotary_neox": [_P, _I, _P, _P, _P, _P, _P, _F, _I, _I, _I, _I, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I],
    "store_kvcache": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I],
    "argmax_rows": [_P, _I, _I, _P, _I],
    "exponential_noise": [_P, _I, _I, _P, _I],
    "exponential_race": [_P, _I, _P, _I, _I, _P, _I],
}


def _machine() -> bytes:
    """What -march=native compiles for: a cached library must not move to a CPU without its instructions."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").encode()
    except OSError:
        return b""


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, path)  # atomic: concurrent builders never load a half-written file


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler found: the CPU path falls back to PyTorch ops (slower)")
        return None
    key = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES) + " ".join([compiler, *_FLAGS]).encode()
                         + _machine())
    path = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"building or loading the CPU kernels failed, the CPU path falls back to PyTorch ops "
                      f"(slower):\n{detail}")
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


def available() -> bool:
    """Whether the kernels were built (or found built) on this machine."""
    return _library() is not None


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether x [tokens, ...] can go through the C kernels: fp32 on the CPU, on a machine where they were built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 2 and available()


def _run(name: str, *args) -> None:
    """Call a kernel; while a torch profile is recording, under its name (record_function is not free)."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(f"nanoinfer::{name}"):
            getattr(_library(), name)(*args)
    else:
        getattr(_library(), name)(*args)


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (copied if need be) whose tokens' (dim 0's) elements are each contiguous, as in the q/k/v slices of a
    fused projection's output, and the floats between consecutive tokens."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            x = x.contiguous()
            break
        expected *= size
    return x, x.stride(0)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                           chunk: int | None = None) -> torch.Tensor:
    """q [seqs, heads, dim] fp32, one token per sequence (at position context - 1); caches [blocks, block_size,
    kv_heads, dim]; with a window, each query sees only the last `window` positions of its context; with a chunk,
    only the positions of its own chunk (from (context - 1) // chunk * chunk on); with soft_cap,
    each scaled score s becomes soft_cap * tanh(s / soft_cap); sinks [heads] fp32: a logit per head that joins each
    softmax's denominator (a key whose value is 0); alibi_slopes [heads] fp32: each head's score of the key at
    position t gains slope * (t - (context - 1))."""
    q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and block_tables.dtype == torch.int32 and all(
        x is None or x.dtype == torch.float32 and x.shape == q.shape[1:2] and x.is_contiguous()
        for x in (sinks, alibi_slopes))
    out = torch.empty_like(q)
    _run("paged_decode_attention", q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
         context_lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
         k_cache.shape[1], block_tables.shape[1], window or 0, chunk or 0, torch.get_num_threads(), scale,
         soft_cap or 0.0, *(None if x is None else x.data_ptr() for x in (sinks, alibi_slopes)))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [tokens, ..., dim]; with residual, (norm(x + residual), x + residual)."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    x, x_stride = _per_token(x)
    new_residual, residual_stride = None, 0
    if residual is not None:
        residual, residual_stride = _per_token(residual)
        new_residual = torch.empty(x.shape, dtype=x.dtype)
    _run("rms_norm", x.data_ptr(), x_stride, None if residual is None else residual.data_ptr(), residual_stride,
         None if residual is None else new_residual.data_ptr(), weight.contiguous().data_ptr(),
         out.data_ptr(), x.shape[0], math.prod(x.shape[1:-1]), dim, eps, torch.get_num_threads())
    return out if residual is None else (out, new_residual)


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [tokens, heads, dim] (token rows may be strided) rotated by the cos/sin rows [max_position, half] of
    `positions`; dims from 2 * half on pass through. With norm_weight, each head is RMS-normalised first."""
    tokens, heads, dim = x.shape
    assert positions.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    x, x_stride = _per_token(x)
    _run("rotary_neox", x.data_ptr(), x_stride, out.data_ptr(), positions.contiguous().data_ptr(), cos.data_ptr(),
         sin.data_ptr(), None if norm_weight is None else norm_weight.contiguous().data_ptr(), eps, tokens, heads,
         dim, cos.shape[-1], torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:] for a contiguous x whose last dim is 2n."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    _run("silu_and_mul", x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, torch.get_num_threads())
    return out


def store_kvcache(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, dim] (rows may be strided) into the caches' rows `slot_mapping` (int64; < 0 skips);
    v None: k alone."""
    row = k_cache[0, 0].numel()
    assert k_cache.is_contiguous() and (v is None or v_cache.is_contiguous()) and slot_mapping.dtype == torch.int64
    k, k_stride = _per_token(k)
    v, v_stride = (None, 0) if v is None else _per_token(v)
    _run("store_kvcache", k.data_ptr(), k_stride, None if v is None else v.data_ptr(), v_stride,
         k_cache.data_ptr(), None if v is None else v_cache.data_ptr(), slot_mapping.contiguous().data_ptr(),
         k.shape[0], row, torch.get_num_threads())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a 2-D x (torch's is single-threaded and not vectorised here: ~1.5 ms for 64 x 32,000)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _run("argmax_rows", x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampler's Exp(1) noise [rows, vocab] fp32 for keys [rows, 2] int64 (sampler.exponential_noise): the
    same hashes, and -log u correctly rounded (torch's fp32 log is within 1 ulp of it)."""
    keys = keys.contiguous()
    assert keys.dtype == torch.int64 and keys.shape[1:] == (2,)
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32)
    _run("exponential_noise", keys.data_ptr(), keys.shape[0], vocab, out.data_ptr(), torch.get_num_threads())
    return out


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(probs / exponential_noise(keys, vocab)).argmax(-1) for probs [rows, vocab] fp32 (rows may be strided), in
    one pass per row that never holds the [rows, vocab] noise in memory."""
    probs, stride = _per_token(probs)
    keys = keys.contiguous()
    assert keys.dtype == torch.int64 and keys.shape == (probs.shape[0], 2)
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    _run("exponential_race", probs.data_ptr(), stride, keys.data_ptr(), probs.shape[0], probs.shape[1],
         out.data_ptr(), torch.get_num_threads())
    return out
