"""Process-level settings for training: the memory allocator, and the thread count.

Allocator (``tune_allocator``).

A training step of the base model allocates and frees a few hundred tensors, several of them
0.1-1 MB (the layer-0 attention scores are [B*H, T, T] = 1 MB). glibc's malloc gives memory at the
top of its heap back to the OS as soon as more than ``M_TRIM_THRESHOLD`` is free there (and serves
large blocks with ``mmap``), so the next step faults the same pages in again: ~500 minor page
faults per step, measured with ``getrusage``. Keeping freed memory in the process removes them and
makes a whole run faster (``benchmarks/speed_machinery.py``: docs/PERFORMANCE.md, section 5, the
allocator's row, with its share of the whole paper). The cost is that the process holds on to its
peak heap (a few hundred MB at most for these models).

This is what ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` would do if set before the
process starts; ``mallopt`` applies it from inside (glibc ``mallopt(3)``). It changes no numbers,
only where freed memory goes. Elsewhere (macOS, musl, Windows) it is a no-op.

Denormal flushing was measured and removed: flush-to-zero saved less than the 3% the project keeps
speed code for (``benchmarks/speed_machinery.py``: docs/PERFORMANCE.md, section 5, "Tried and not kept").

``train``, ``train_group``, ``softprior bench`` and the scripts in ``benchmarks/`` call
``prepare_training()``: the allocator setting, process-wide (nothing to restore), which changes no
numbers, only where freed memory goes.

Threads (``choose_threads``). A sweep gives each worker process its share of the cores (cores //
workers, one thread each with ``--workers 2`` on 2 cores). A single run (``softprior train``) takes the
cores that are free: the usable cores less the 1-minute load average. On a machine where another
job keeps a core busy, torch's default (every core) made a base run several times slower than one
thread: its OpenMP team waits on the busy core at every parallel op (docs/PERFORMANCE.md, section 1,
"Threads"). ``softprior train --threads N`` overrides the choice. The thread count is recorded in
every run summary (``provenance``); like the group size it can change the last bits of a run
(docs/DESIGN.md), so pin it with ``--threads`` to reproduce a run bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

__all__ = ["tune_allocator", "prepare_training",
           "usable_cores", "free_cores", "choose_threads"]

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


def prepare_training() -> dict[str, bool]:
    """The allocator setting, for the rest of the process (``train`` and ``train_group`` apply it);
    returns what was applied."""
    return {"allocator_tuned": tune_allocator()}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """The usable cores that other work does not keep busy: ``usable_cores()`` less the 1-minute load
    average (rounded), at least 1; all of them where the load is unknown."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores
    return max(1, min(cores, cores - round(load)))


def choose_threads(workers: int = 1) -> tuple[int, str]:
    """(torch threads for each of ``workers`` training processes, why): its share of the free cores
    (``free_cores() // workers``, at least 1) and never more than its share of the usable ones (what a
    sweep gives each worker: cores // workers)."""
    cores, free, w = usable_cores(), free_cores(), max(1, workers)
    n = max(1, min(cores // w, free // w))
    return n, f"{free} of {cores} cores free" + (f", {w} workers" if w > 1 else "")


@contextlib.contextmanager
def one_thread():
    """Run the block on one intra-op thread, then restore the count.

    ATen splits a full reduction (a sum over one output) and an elementwise kernel across its threads,
    and each thread's share has its own vector body and scalar tail, so the sum's order and which
    elements take the scalar code depend on the thread count. The gradient clipping's norms and the
    AdamW update over a large model's tensors (tens of thousands of elements: past ATen's grain of
    32,768) gave other bits at 1 and 2 threads. In one thread they are computed as a one-thread
    run computes them, so a run's weights do not depend on the thread count (docs/DESIGN.md,
    "Bit-identity"; tests/training/test_bit_identity.py). Its cost is in docs/PERFORMANCE.md."""
    import torch
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)

