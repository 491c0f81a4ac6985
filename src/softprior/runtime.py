"""Process-level settings that make training fast: the memory allocator.

A training step of the base model allocates and frees a few hundred tensors, several of them
0.1-1 MB (the layer-0 attention scores are [B*H, T, T] = 1 MB). glibc's malloc gives memory at the
top of its heap back to the OS as soon as more than ``M_TRIM_THRESHOLD`` is free there (and serves
large blocks with ``mmap``), so the next step faults the same pages in again: ~500 minor page
faults per step, measured with ``getrusage``, and 20-25% of the step time on this machine (1 thread:
9.1 -> 7.3 ms/step; docs/PERFORMANCE.md). Keeping freed memory in the process removes them; the
cost is that the process holds on to its peak heap (a few hundred MB at most for these models).

This is what ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` would do if set before the
process starts; ``mallopt`` applies it from inside (glibc ``mallopt(3)``). It changes no numbers,
only where freed memory goes. Elsewhere (macOS, musl, Windows) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["tune_allocator"]

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_TRIM_BYTES = 1 << 30  # keep up to 1 GiB of freed heap
_MMAP_BYTES = 64 << 20  # blocks under 64 MiB come from the heap, not a fresh mmap

_state: dict[str, bool] = {}


def tune_allocator() -> bool:
    """Keep freed memory in the process (once per process; idempotent). Returns whether it applied.
    ``SOFTPRIOR_TUNE_MALLOC=0`` turns it off."""
    if "applied" in _state:
        return _state["applied"]
    ok = False
    if os.environ.get("SOFTPRIOR_TUNE_MALLOC", "1") != "0":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES)) and bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES))
    _state["applied"] = ok
    return ok
