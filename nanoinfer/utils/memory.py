"""Process-wide allocator tuning for the CPU path."""
import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Make glibc serve large tensors from its heap and keep freed memory instead of unmapping it.

    By default every tensor above 32 MB is a fresh mmap whose pages fault in on first touch; in a
    prefill step that costs more than the elementwise ops themselves. Returns False if not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False
