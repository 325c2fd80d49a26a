"""Builds the CPU path's C kernels with the system compiler once per machine (cached), and calls them via ctypes."""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from nanoinfer.utils.default_model import cache_dir

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
# -fopenmp: the library's libgomp.so.1 resolves to the one torch has already loaded (same soname).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


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
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(built, path)  # atomic: concurrent builders never load a half-written file


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler found: CPU decode attention falls back to PyTorch (slower)")
        return None
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *_FLAGS]).encode() + _machine())
    path = cache_dir() / "kernels" / f"{_SOURCE.stem}-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"building or loading {_SOURCE.name} failed, CPU decode attention falls back to PyTorch "
                      f"(slower):\n{detail}")
        return None
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float]
    return lib


def paged_decode_attention_available() -> bool:
    return _library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                           scale: float, window: int | None = None) -> torch.Tensor:
    """q [seqs, heads, dim] fp32, one token per sequence; caches [blocks, block_size, kv_heads, dim]; with a
    window, each query sees only the last `window` positions of its context."""
    q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and block_tables.dtype == torch.int32
    out = torch.empty_like(q)
    _library().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1],
        block_tables.shape[1], max_context, window or 0, scale)
    return out
