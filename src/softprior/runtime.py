"""Process-level settings that make training fast: the memory allocator and denormal flushing.

Allocator (``tune_allocator``).

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

Denormals (``flush_denormals``). The soft prior's initial position bias is -(offset - h)^2, so in
layer 0 about 2% of the softmax outputs exp(s - max) land in float32's denormal range (below
1.18e-38), and so do their products in the backward. On x86 every arithmetic operation with a
denormal operand or result takes a microcode assist: ~35% of a training step on this machine
(1 thread: 10.5-11.4 -> 6.5-7.1 ms/step; docs/PERFORMANCE.md). Flush-to-zero + denormals-are-zero
(the MXCSR FTZ/DAZ bits, what ``torch.set_flush_denormal(True)`` sets) treat those values as 0.
Here they are summed with terms dozens of orders of magnitude larger (every softmax row has an
entry of at least 1/T), so they vanish in rounding either way: full runs end with bit-identical
weights and metrics with and without flushing (measured for associative recall unforced, fade600
and forced_zero, Markov and linear ICL; PERFORMANCE.md; a 40-step run is checked in the tests).

MXCSR is per thread. ``torch.set_flush_denormal`` sets it on the calling thread only, and OpenMP
worker threads inherit the creating thread's value only when they are created, so a pool that
already exists would keep the slow mode on every thread but the main one. ``flush_denormals``
therefore runs ``torch.set_flush_denormal(True)`` on every thread of the OpenMP team
(``GOMP_parallel``, the entry point libgomp and LLVM/Intel OpenMP export for ``#pragma omp
parallel``). ``SOFTPRIOR_FLUSH_DENORMALS=0`` turns it off. Where the CPU has no FTZ (non-x86) it is a
no-op.

Scope. Flush-to-zero changes float arithmetic for everything else the process computes, so training
does not leave it behind: ``train``, ``train_group`` (and so every sweep) run inside
``training_settings()``, which switches it on and, on exit, restores the calling thread's previous
setting on this thread and on every OpenMP thread (a notebook that trains a model and then computes
something with denormals gets the IEEE behaviour it had before). ``prepare_training()`` is the
unscoped form: it applies both settings for the rest of the process (the scripts in
``benchmarks/`` use it, timing code that runs outside ``train``; ``softprior bench`` runs inside
``training_settings()`` too). The allocator setting is
process-wide in either case; it changes no numbers, only where freed memory goes.

Threads (``choose_threads``). A sweep gives each worker process its share of the cores (cores //
workers, one thread each with ``--workers 2`` on 2 cores). A single run (``softprior train``) takes the
cores that are free: the usable cores less the 1-minute load average. On a machine where another
job keeps a core busy, torch's default (every core) made a base run ~3x slower than one thread: its
OpenMP team waits on the busy core at every parallel op. ``softprior train --threads N`` overrides
the choice. The thread count is recorded in every run summary (``provenance``); like the group size
it can change the last bits of a run (docs/DESIGN.md), so pin it with ``--threads`` to reproduce a
run bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading

__all__ = ["tune_allocator", "flush_denormals", "denormals_flushed", "prepare_training", "training_settings",
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


def _openmp_library() -> str | None:
    """Path of the OpenMP runtime loaded in this process (torch's libgomp, or libiomp / libomp)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def _on_every_openmp_thread(fn, n_threads: int) -> int:
    """Run ``fn()`` once on each thread of an OpenMP team of ``n_threads`` started from this thread
    (the pool torch's parallel kernels use). Returns how many distinct threads ran it (0 if no OpenMP
    runtime could be found)."""
    path = _openmp_library()
    if path is None:
        return 0
    try:
        gomp_parallel = ctypes.CDLL(path).GOMP_parallel
    except (OSError, AttributeError):
        return 0
    seen: set[int] = set()
    lock = threading.Lock()

    def body(_):
        fn()
        with lock:
            seen.add(threading.get_ident())

    cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(body)
    gomp_parallel.argtypes = [ctypes.CFUNCTYPE(None, ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp_parallel.restype = None
    gomp_parallel(cb, None, n_threads, 0)  # ctypes releases the GIL; each thread takes it to run body
    return len(seen)


def flush_denormals() -> bool:
    """Flush float denormals to zero on this thread and on every thread of torch's OpenMP pool
    (see the module docstring). Returns whether it applied to all ``torch.get_num_threads()``
    threads. Cheap (one empty parallel region); safe to call before every run."""
    if os.environ.get("SOFTPRIOR_FLUSH_DENORMALS", "1") == "0":
        return False
    import torch
    if not torch.set_flush_denormal(True):  # no FTZ on this CPU
        return False
    n = torch.get_num_threads()
    if n == 1:
        return True
    return _on_every_openmp_thread(lambda: torch.set_flush_denormal(True), n) == n


def denormals_flushed() -> bool:
    """Whether float32 denormals are flushed to zero on the calling thread (probed: 1e-20 * 1e-20 =
    1e-40 is a denormal, and comes out 0 under flush-to-zero)."""
    import torch
    return bool((torch.full((1,), 1e-20) * 1e-20).item() == 0.0)


def _set_flush_everywhere(flag: bool) -> None:
    """torch.set_flush_denormal(flag) on this thread and every thread of torch's OpenMP pool."""
    import torch
    torch.set_flush_denormal(flag)
    n = torch.get_num_threads()
    if n > 1:
        _on_every_openmp_thread(lambda: torch.set_flush_denormal(flag), n)


def prepare_training() -> dict[str, bool]:
    """Both settings, for the rest of the process (unscoped; ``training_settings`` is the scoped form
    that ``train`` and ``train_group`` use)."""
    return {"allocator_tuned": tune_allocator(), "denormals_flushed": flush_denormals()}


@contextlib.contextmanager
def training_settings():
    """``prepare_training()`` for the duration of a ``with`` block: flush-to-zero is switched back to
    the calling thread's previous setting (on every OpenMP thread) on exit, also after an exception.
    Yields the dict of what was applied."""
    before = denormals_flushed()
    applied = prepare_training()
    try:
        yield applied
    finally:
        if not before:  # (also when flushing reached only some threads)
            _set_flush_everywhere(False)


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
