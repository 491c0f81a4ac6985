"""Run a list of run configs: one driver, several backends.

The driver alone touches the store: it skips finished runs, trains parents of derived runs first,
claims runs in a transaction (so two sweeps on one store never train the same run), hands *pure*
jobs (configs in, results out) to a backend, and writes each result as it arrives. Backends:

- ``serial``: in this process;
- ``local`` with ``workers > 1``: a process pool, each worker with ``torch`` threads = cores/workers;
- ``ray``: one Ray task per job with ``num_cpus`` set, consumed with ``ray.wait`` as they finish,
  so a cluster without a shared filesystem works (results travel back through Ray's object store).
  A job whose worker process or node dies is run again by Ray (``RAY_MAX_RETRIES``), from its
  checkpoint where the node sees the store, else from step 0; results reach the store only through
  the driver, once per job, so a retried job neither duplicates nor half-writes a run (docs/CLUSTER.md).

Nothing is lost when a sweep is killed: a job (a run or a group) writes a checkpoint to its run
directory every ``checkpoint_seconds`` of training (default ``SWEEP_CHECKPOINT_SECONDS``; not on a
remote Ray cluster, which may not see the store's files, unless ``shared_store`` says every node
sees it), and the next sweep keeps a checkpointed group together and resumes it bit-identically. A
job whose worker process died is run again from its checkpoint (a pool job up to ``POOL_MAX_RETRIES``
times, a Ray job ``RAY_MAX_RETRIES``); out of retries, it has its runs recorded as failed and
keeps its checkpoint, so the next sweep resumes them. Workers write only these scratch files; the driver
alone writes results and the index.

The time ledger: each job returns its wall time (``JobResult.timing``; a resumed job's earlier pieces
ride in its checkpoint's metadata), and the driver appends a row per job, with the FLOP it trained
(``bench.train_step_flops`` x steps), and one per sweep to the store's ledger (``RunStore.record_timing``;
``softprior report timings`` reads it). Timing only: no run's numbers change.

Progress (``_Progress``): one bar in run-steps (a group of K runs of S steps is K x S), with the runs
finished and an ETA from the step rate measured over the last ``RATE_SECONDS`` (weighted by each
job's cost per step, ``_job_cost``, so a sweep that starts with its large-model groups does not
promise too much). A job reports its step every ``PROGRESS_SECONDS`` while it trains (``_Reporter``,
through the training loop's checkpoint callback, which writes a checkpoint only when one is due as
before): a serial sweep in-process, a process pool through a ``multiprocessing`` queue, Ray through a
``ray.util.queue.Queue``; the driver polls them every ``PROGRESS_SECONDS`` while it waits, so the
timer ticks. Reporting reads the step count only: no run's numbers change.

A job is one run or a group of compatible runs trained together (``engine.train_group``). A failing
run (exception or NaN loss) is recorded with its error and the sweep goes on. When the group engine
itself raises, the driver first records the exception with its traceback in the store
(``RunStore.engine_errors``) and in the sweep report (``SweepReport.engine_errors``, printed by
``line()``), and only then falls back to training the group's runs one by one: an engine bug shows up
as an error, not as mere slowness.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .config import RunConfig
from .training.runtime import usable_cores
from .store import RunStore, StoreError

__all__ = ["execute", "run", "RunFailedError", "sweep_plan", "SweepReport", "JobResult", "work", "choose_group_size", "group_sizes",
           "group_scaling", "GROUP_SCALING", "GROUP_SCALING_BY_MODEL", "save_group_scaling",
           "load_group_scaling", "SWEEP_CHECKPOINT_SECONDS"]

# a sweep job checkpoints after every this many seconds of training ($SOFTPRIOR_CHECKPOINT_SECONDS)
SWEEP_CHECKPOINT_SECONDS = 120.0
# while it trains, a job of a sweep that shows progress reports its step this often, and the driver
# redraws the bar (its timer) this often while it waits; the ETA is from the rate over the last RATE_SECONDS
PROGRESS_SECONDS = 1.0
RATE_SECONDS = 30.0
# a Ray job whose worker process or node dies (a system failure; an exception in training is a result,
# returned by ``work``) is run again up to this many times before its runs are recorded as failed
# ($SOFTPRIOR_RAY_MAX_RETRIES). Ray's own default (3, or $RAY_TASK_MAX_RETRIES) is not relied on.
RAY_MAX_RETRIES = 3
# the same for a job of the local process pool whose worker died (``_Pool``)
POOL_MAX_RETRIES = 3

# ms per run-step of a base-model group of K runs at 1 thread (each sweep worker's setting), measured by
# ``benchmarks/scaling.py`` on the development machine (docs/PERFORMANCE.md): per-op overhead is paid
# once per group, so the cost falls to K = 4-8 and rises again at 16 (the working set leaves the cache).
# ``softprior bench`` measures this machine's own table and saves it (``save_group_scaling``);
# ``--group auto`` reads that, else this one. docs/PERFORMANCE.md quotes both built-in tables (section 6,
# the "built in" rows; tests/test_executors.py holds them equal).
GROUP_SCALING: dict[int, float] = {1: 7.82, 2: 8.07, 4: 6.80, 8: 6.22, 16: 6.72}
# the same for other model sizes (``model.size_label``), here measured on the development machine
# (session 2026-12-05, ``train.Runs.step`` at 1 thread, assoc recall, batch 64): the large model is
# compute-bound at batch 64, so a group only adds memory traffic and it trains fastest alone (sweeps
# measured ~185 s a run alone against ~218 s in a group of 6). A model size without a table uses
# the base one.
GROUP_SCALING_BY_MODEL: dict[str, dict[int, float]] = {"base": GROUP_SCALING,
                                                       "large": {1: 45.8, 2: 48.6, 4: 50.6, 6: 48.2}}


@dataclass
class SweepReport:
    total: int = 0
    skipped: int = 0
    trained: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run_id, error)
    engine_errors: list[tuple[list[str], str]] = field(default_factory=list)  # (group's run ids, error + traceback)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def line(self) -> str:
        s = (f"{self.total} runs: {self.skipped} already done, {self.trained} trained, {len(self.failed)} failed "
             f"({self.seconds:.1f} s)")
        if self.engine_errors:
            s += f", {len(self.engine_errors)} group engine error(s)"
        for rids, err in self.engine_errors:
            s += (f"\n  ENGINE ERROR in a group of {len(rids)} runs ({', '.join(r[:8] for r in rids)}): "
                  f"{_headline(err)}; retrained one by one (traceback in the store's engine_errors table)")
        for rid, err in self.failed:
            s += f"\n  FAILED {rid}: {err.splitlines()[-1] if err else ''}"
        return s


def _headline(err: str) -> str:
    """The 'Type: message' line of an error string that may carry a traceback after it."""
    return err.splitlines()[0] if err else ""


@dataclass
class JobResult:
    """What a job returns (picklable, crosses process and Ray boundaries). ``outs``: one
    (RunResult | None, error | None) per config; empty when ``engine_error`` is set (the group engine
    raised: 'Type: message' followed by the traceback), and the driver then retrains the runs alone."""
    outs: list = field(default_factory=list)
    engine_error: str | None = None
    # the job's wall time, measured where it ran (``work``): {"pieces": [[unix start, seconds], ...] (the
    # pieces before a resume, up to the checkpoint it resumed from, then this one), "from_step": the step
    # the first piece started at, "threads", "host"}; the driver writes it to the store's ledger
    timing: dict | None = None
    # the job's process died (a pool worker, or a Ray job out of retries): its runs fail in this sweep,
    # and its checkpoint stays for the next one to resume from
    crashed: bool = False


# ------------------------------------------------------------------------------------ pure work
def _set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(max(1, n))


class _Reporter:
    """The training loop's ``on_checkpoint`` for a job whose sweep shows progress. The loop calls it at
    the first step after every ``PROGRESS_SECONDS`` (and every ``checkpoint_every`` steps); it reports
    the step (``report(step)``) and passes the checkpoint on to ``save`` only when one is due as
    without progress: at a multiple of ``every_steps``, ``save_seconds`` after the last one it wrote,
    or at once when Ctrl-C stopped the loop (``meta["interrupted"]``, ``train.DeferredInterrupt``)."""

    def __init__(self, report: Callable, save: Callable | None, every_steps: int, save_seconds: float | None):
        self.report, self.save, self.every_steps, self.save_seconds = report, save, every_steps, save_seconds
        self.last = time.perf_counter()

    def __call__(self, ck: dict) -> None:
        done = ck["meta"]["step"]
        self.report(done)
        if self.save is None:
            return
        now = time.perf_counter()
        if ck["meta"].get("interrupted") or (self.every_steps and done % self.every_steps == 0) or \
                (self.save_seconds is not None and now - self.last >= self.save_seconds):
            self.last = now
            self.save(ck)


def work(cfgs: list[RunConfig], init_states: list | None = None, threads: int | None = None,
         checkpoints: str | None = None, checkpoint_seconds: float | None = None, progress: bool = False,
         report: Callable | None = None, report_seconds: float | None = None) -> JobResult:
    """Train ``cfgs`` (one run, or a group); pure but for checkpoint files: with ``checkpoints`` (a
    store's root) the job resumes from its checkpoint there, if any, and writes one every
    ``checkpoint_seconds`` of training. A group whose engine raises returns the exception and its
    traceback (``JobResult.engine_error``), not results: the driver records it, then retrains.
    ``report``: called as ``report(step, True)`` with the step it starts (resumes) at, then
    ``report(step)`` every ``report_seconds`` (default ``PROGRESS_SECONDS``) while it trains (``_Reporter``).
    The job's wall time comes back with it (``JobResult.timing``, ``_PieceClock``) for the store's ledger."""
    started, t0 = time.time(), time.perf_counter()
    if threads:
        _set_threads(threads)
    ck, clock = {}, _PieceClock(started, t0)
    if checkpoints is not None:
        from .store.files import RunFiles
        files, rids = RunFiles(Path(checkpoints)), [c.run_id for c in cfgs]
        if len(cfgs) == 1:
            ck = {"resume": files.load_checkpoint(rids[0]),
                  "on_checkpoint": lambda c: files.save_checkpoint(rids[0], clock.stamp(c))}
        else:
            ck = {"resume": files.load_group_checkpoint(rids),
                  "on_checkpoint": lambda c: files.save_group_checkpoint(rids, clock.stamp(c))}
        ck["checkpoint_seconds"] = checkpoint_seconds
        clock.resumed(ck["resume"])
    job = _work(cfgs, init_states, ck, progress, report, checkpoint_seconds, report_seconds)
    job.timing = clock.timing()
    return job


class _PieceClock:
    """A job's wall time, in pieces: a job resumed from a checkpoint carries the pieces before it in the
    checkpoint's metadata (``meta["ledger"]``: stamped on every checkpoint it writes; nothing the
    training reads), so a sweep killed and resumed counts the time of each piece up to the checkpoint
    the next one resumed from. Timing only: no run's numbers change."""

    def __init__(self, started: float, t0: float):
        self.started, self.t0, self.carried, self.from_step = started, t0, [], 0

    def resumed(self, ckpt: dict | None) -> None:
        if ckpt is None:
            return
        led = ckpt["meta"].get("ledger")
        if isinstance(led, dict) and isinstance(led.get("pieces"), list):
            self.carried, self.from_step = [list(p) for p in led["pieces"]], int(led.get("from_step", 0))
        else:  # a checkpoint without a ledger (``softprior train --checkpoint-every``): the steps before it untimed
            self.from_step = int(ckpt["meta"]["step"])

    def pieces(self) -> list[list[float]]:
        return self.carried + [[self.started, time.perf_counter() - self.t0]]

    def stamp(self, ckpt: dict) -> dict:
        ckpt["meta"]["ledger"] = {"pieces": self.pieces(), "from_step": self.from_step}
        return ckpt

    def timing(self) -> dict:
        import socket

        import torch
        return {"pieces": self.pieces(), "from_step": self.from_step, "threads": torch.get_num_threads(),
                "host": socket.gethostname()}


def _work(cfgs, init_states, ck, progress, report, checkpoint_seconds, report_seconds) -> JobResult:
    from .training import engine
    from .training.loop import train
    if report is not None and not (len(cfgs) > 1 and cfgs[0].snapshot_every):  # (a group keeps no snapshots)
        report(ck["resume"]["meta"]["step"] if ck.get("resume") else 0, True)
        save = ck.get("on_checkpoint")
        save_seconds = checkpoint_seconds if save is not None else None
        every = PROGRESS_SECONDS if report_seconds is None else report_seconds
        ck.update(on_checkpoint=_Reporter(report, save, cfgs[0].checkpoint_every, save_seconds),
                  checkpoint_seconds=every if save_seconds is None else min(every, save_seconds))
    if len(cfgs) == 1:
        try:
            return JobResult([(train(cfgs[0], init_state=(init_states or [None])[0], progress=progress, **ck), None)])
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            return JobResult([(None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")])
    try:
        return JobResult([(r, None) for r in engine.train_group(cfgs, init_states=init_states, progress=progress, **ck)])
    except Exception as e:  # noqa: BLE001 - reported by the driver, which then trains each run alone
        return JobResult(engine_error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


# ------------------------------------------------------------------------------------ backends
# Every backend: submit(cfgs, init_states, job) starts a job (``job``: its key for progress reports,
# None when the sweep shows none); next_done(poll) waits for one to finish, calling ``poll()`` every
# PROGRESS_SECONDS meanwhile; drain() returns the progress reports (job, step, started) that arrived.
class _Serial:
    def __init__(self, checkpoints: str | None, checkpoint_seconds: float | None, progress: bool,
                 sweep: "_Progress | None" = None):
        self.ck, self.progress, self.pending, self.sweep = (checkpoints, checkpoint_seconds), progress, [], sweep

    def submit(self, cfgs, init_states, job=None):
        report = None
        if job is not None and self.sweep is not None:  # in this process: straight to the bar
            def report(step, started=False):
                self.sweep.tick([(job, step, started)])
        self.pending.append((cfgs, init_states, work(cfgs, init_states, None, *self.ck, progress=self.progress,
                                                     report=report, report_seconds=PROGRESS_SECONDS)))

    def next_done(self, poll=None):
        return self.pending.pop(0)

    def drain(self):
        return []

    def busy(self):
        return bool(self.pending)

    def close(self):
        pass


_QUEUE = None  # in a pool worker: the queue to the driver's progress bar (``_Pool``)


def _pool_worker_init(q) -> None:
    global _QUEUE
    _QUEUE = q
    q.cancel_join_thread()  # progress is best effort: a worker exits without waiting to flush it


def _to_queue(job, step: int, started: bool = False) -> None:
    _QUEUE.put((job, step, started))


def _to_ray_queue(q, job, step: int, started: bool = False) -> None:
    try:
        q.put_nowait((job, step, started))
    except Exception:  # noqa: BLE001 - progress is best effort: a queue that cannot be reached fails no run
        pass


def _ray_work(cfgs, init_states, threads, checkpoints, *args, **kwargs) -> JobResult:
    """``work`` as a Ray task. A node that does not see the store (``shared_store`` said so, but the
    directory is not mounted there at the same path) trains without checkpoints rather than write
    them beside the store, on its own disk."""
    if checkpoints is not None and not (Path(checkpoints) / "index.sqlite").is_file():
        checkpoints = None
    return work(cfgs, init_states, threads, checkpoints, *args, **kwargs)


class _Pool:
    """A process pool (spawned workers, ``threads`` torch threads each). A worker that dies (killed, out
    of memory) breaks a ``ProcessPoolExecutor``: every job in it fails with ``BrokenProcessPool`` and
    it takes no more. The pool is then started again and each of those jobs submitted again, at most
    ``POOL_MAX_RETRIES`` times; a job resumes from its checkpoint and training is deterministic, so its
    runs come out bit-identical. The job that killed its worker cannot be told from the others in
    flight, so each of them spends a retry; out of retries, a job's runs fail in this sweep
    (``JobResult.crashed``; their checkpoint is kept) and the next sweep resumes them."""

    def __init__(self, workers: int, checkpoints: str | None, checkpoint_seconds: float | None, progress: bool = False):
        import multiprocessing as mp
        self.ctx = mp.get_context("spawn")
        self.workers = workers
        self.threads = max(1, usable_cores() // workers)
        self.progress, self.queue = progress, None  # the queue: handed to each worker as it starts
        self.futs = {}
        self.ck = (checkpoints, checkpoint_seconds)
        self.generation, self.ex = 0, None
        self._start()

    def _start(self):
        """A new pool, and a new progress queue: a worker killed while writing to the old one may have
        left it locked or holding half a message."""
        from concurrent.futures import ProcessPoolExecutor
        if self.ex is not None:
            self.ex.shutdown(wait=False, cancel_futures=True)
        if self.queue is not None:
            self.queue.cancel_join_thread()
            self.queue.close()
        self.queue = self.ctx.Queue() if self.progress else None
        self.ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=self.ctx,
                                      **({"initializer": _pool_worker_init, "initargs": (self.queue,)}
                                         if self.queue is not None else {}))
        self.generation += 1

    def submit(self, cfgs, init_states, job=None, tries: int = 0):
        from concurrent.futures.process import BrokenProcessPool
        report = functools.partial(_to_queue, job) if job is not None and self.queue is not None else None
        args = (work, cfgs, init_states, self.threads, *self.ck)
        try:
            f = self.ex.submit(*args, report=report, report_seconds=PROGRESS_SECONDS)
        except BrokenProcessPool:  # broke since its last result was collected
            self._start()
            f = self.ex.submit(*args, report=report, report_seconds=PROGRESS_SECONDS)
        self.futs[f] = (cfgs, init_states, job, tries, self.generation)

    def next_done(self, poll=None):
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures.process import BrokenProcessPool
        while True:
            done, _ = wait(list(self.futs), timeout=PROGRESS_SECONDS if poll else None, return_when=FIRST_COMPLETED)
            if not done:
                poll()
                continue
            f = next(iter(done))
            cfgs, inits, job, tries, generation = self.futs.pop(f)
            try:
                return cfgs, inits, f.result()
            except BrokenProcessPool as e:
                if generation == self.generation:  # the first of its jobs to be collected restarts the pool
                    self._start()
                if tries < POOL_MAX_RETRIES:
                    self.submit(cfgs, inits, job, tries + 1)
                    continue
                err = e
            except Exception as e:  # noqa: BLE001 - a worker crash fails its runs, not the sweep
                err = e
            return cfgs, inits, JobResult([(None, f"worker crashed: {type(err).__name__}: {err}")] * len(cfgs),
                                          crashed=True)

    def drain(self):
        out = []
        while self.queue is not None:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
            except Exception:  # noqa: BLE001 - a message cut short by a killed worker: progress is best effort
                break
        return out

    def busy(self):
        return bool(self.futs)

    def interrupt(self, timeout: float = 300.0) -> list:
        """After SIGINT or SIGTERM to the driver alone: SIGINT to every worker (a training job writes its
        checkpoint and stops: ``train.DeferredInterrupt``), then (cfgs, init_states, JobResult) of every
        job that finished, to be written to the store. Jobs still running after ``timeout`` are left to
        their checkpoints."""
        import signal
        from concurrent.futures import wait
        for proc in list((getattr(self.ex, "_processes", None) or {}).values()):
            with contextlib.suppress(OSError, AttributeError):
                os.kill(proc.pid, signal.SIGINT)
        pending = list(self.futs)
        while pending:
            try:
                wait(pending, timeout=timeout)
                break
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
                break
        out = []
        for f, (cfgs, inits, _job, _tries, _gen) in list(self.futs.items()):
            if f.done() and not f.cancelled() and f.exception() is None:
                res = f.result()
                if res.engine_error is None and not res.crashed:
                    out.append((cfgs, inits, res))
        self.futs.clear()
        return out

    def close(self):
        self.ex.shutdown(cancel_futures=True)
        if self.queue is not None:
            self.queue.close()


class _Ray:
    """One Ray task per job. A task whose worker process or node dies is retried by Ray
    (``RAY_MAX_RETRIES``; not on an exception, which ``work`` returns as a result): the retry starts
    over from the job's checkpoint when it can see one, else from step 0, and training is deterministic,
    so its runs come out bit-identical. The driver waits on each job's one result, so a retried job is
    collected (and written to the store) once. Out of retries, its runs are recorded as failed in this
    sweep (``JobResult.crashed``; their checkpoint is kept) and the next sweep trains them again, from it."""

    def __init__(self, address: str | None, workers: int, checkpoints: str | None, checkpoint_seconds: float | None,
                 progress: bool = False):
        try:
            import ray
        except ImportError:
            raise RuntimeError("the ray executor needs Ray: pip install 'softprior[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        # a job's CPUs (and torch threads): on a cluster at ``address``, 1; on a local Ray, an equal share
        # of its CPUs per worker (of the Ray this process started or joined, which may have fewer CPUs
        # than the machine: a job asking for more than it has would wait forever)
        cpus_per_job = 1
        if address is None:  # a share of the Ray's CPUs, at most the largest node's (a job runs on one node)
            node = max((n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
            total = ray.cluster_resources().get("CPU", os.cpu_count() or 1)
            cpus_per_job = max(1, min(int(total) // max(workers, 1), int(node) or 1))
        retries = _env_int("SOFTPRIOR_RAY_MAX_RETRIES", RAY_MAX_RETRIES)
        self.remote = ray.remote(num_cpus=cpus_per_job, max_retries=retries, retry_exceptions=False)(_ray_work)
        self.cpus = cpus_per_job
        self.refs = {}
        self.ck = (checkpoints, checkpoint_seconds)
        self.queue = None
        if progress:  # an actor the jobs put their steps into, wherever they run; on the driver's node, so
            # that the death of another node does not take the queue with it
            from ray.util.queue import Queue
            options = {"num_cpus": 0}
            try:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=True)
            except Exception:  # noqa: BLE001 - e.g. a Ray client driver, on no node: anywhere
                pass
            self.queue = Queue(actor_options=options)

    def submit(self, cfgs, init_states, job=None):
        report = functools.partial(_to_ray_queue, self.queue, job) if job is not None and self.queue is not None else None
        self.refs[self.remote.remote(cfgs, init_states, self.cpus, *self.ck, report=report,
                                     report_seconds=PROGRESS_SECONDS)] = (cfgs, init_states)

    def next_done(self, poll=None):
        while True:
            done, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=PROGRESS_SECONDS if poll else None)
            if done:
                break
            poll()
        ref = done[0]
        cfgs, inits = self.refs.pop(ref)
        try:
            return cfgs, inits, self.ray.get(ref)
        except Exception as e:  # noqa: BLE001 - out of retries: its runs fail, not the sweep
            return cfgs, inits, JobResult([(None, f"ray task failed: {type(e).__name__}: {e}")] * len(cfgs), crashed=True)

    def drain(self):
        if self.queue is None:
            return []
        try:
            n = self.queue.qsize()
            return self.queue.get_nowait_batch(n) if n else []
        except Exception:  # noqa: BLE001 - progress is best effort; the results come through ray.wait
            return []

    def busy(self):
        return bool(self.refs)

    def close(self):
        if self.queue is not None:
            try:
                self.queue.shutdown()
            except Exception:  # noqa: BLE001
                pass


# ------------------------------------------------------------------------------------ progress
@dataclass
class _RunProgress:
    steps: int  # the run's step budget
    to_train: int  # the steps this sweep trains (fewer when it resumes from a checkpoint)
    cost: float  # relative cost of one of its steps (``_job_cost``), for the ETA
    done: int = 0  # the steps trained so far in this sweep


class _Progress:
    """The sweep's progress bar: run-steps trained / to train in this sweep (a resumed job's steps
    before its checkpoint are not counted), runs finished, failures, and the ETA: the work left over
    the rate measured in the last ``RATE_SECONDS``, both weighted by each run's cost per step
    (``_job_cost``). ``tick(reports)`` applies the jobs' step reports (job, step, started) and
    redraws, so the timer moves on every poll."""

    def __init__(self, cfgs: list[RunConfig]):
        self.runs: dict[str, _RunProgress] = {}
        self.jobs: dict[tuple, int] = {}  # a job in flight (its run ids) -> the step it started at
        self.finished = self.failed = 0
        self.samples: collections.deque = collections.deque()  # (time, work done), from the first step trained
        self.bar = None  # drawn with the first run to train: a sweep with nothing to train (cached) draws none
        self.add(cfgs)

    def add(self, cfgs) -> None:
        """Runs this sweep trains."""
        for c in cfgs:
            self.runs.setdefault(c.run_id, _RunProgress(c.total_steps, c.total_steps, _job_cost([c]) / c.total_steps))
        self.tick()

    def drop(self, cfgs) -> None:
        """Runs this sweep will not train after all (another process has them, or their parent failed)."""
        for c in cfgs:
            self.runs.pop(c.run_id, None)
        self.tick()

    def start(self, cfgs) -> tuple:
        """A job is submitted; returns its key for ``work``'s reports."""
        job = tuple(c.run_id for c in cfgs)
        self.jobs[job] = 0
        return job

    def tick(self, reports=()) -> None:
        for job, step, started in reports:
            if job not in self.jobs:  # a report that arrived after its job ended
                continue
            if started:  # resumed at ``step``: the steps before it were trained by an earlier sweep
                self.jobs[job] = step
            for r in (self.runs[rid] for rid in job if rid in self.runs):
                if started:
                    r.to_train, r.done = r.steps - step, 0
                else:
                    r.done = max(r.done, min(r.to_train, step - self.jobs[job]))
        self._redraw()

    def ended(self, cfgs, outs) -> None:
        """A job returned: a run that trained counts in full, a failed one's untrained steps leave the total."""
        self.jobs.pop(tuple(c.run_id for c in cfgs), None)
        for c, (res, _) in zip(cfgs, outs):
            r = self.runs.get(c.run_id)
            if r is not None:
                if res is not None:
                    r.done = r.to_train
                else:
                    r.to_train = r.done
            self.finished += 1
            self.failed += res is None
        self._redraw()

    def engine_failed(self, cfgs) -> None:
        """A group's engine raised: its runs train again, one by one, from step 0."""
        self.jobs.pop(tuple(c.run_id for c in cfgs), None)
        for r in (self.runs[c.run_id] for c in cfgs if c.run_id in self.runs):
            r.to_train, r.done = r.steps, 0
        self._redraw()

    def _redraw(self) -> None:
        if self.bar is None:
            if not self.runs:
                return
            from tqdm.auto import tqdm
            self.bar = tqdm(total=0, desc="sweep", dynamic_ncols=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} run-steps [{elapsed}{postfix}]")
        now, runs = time.perf_counter(), self.runs.values()
        done, total = sum(r.done for r in runs), sum(r.to_train for r in runs)
        work_done, work_total = sum(r.done * r.cost for r in runs), sum(r.to_train * r.cost for r in runs)
        if done or self.samples:
            self.samples.append((now, work_done))
            while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_SECONDS:
                self.samples.popleft()
        eta = "ETA ?"
        (t0, w0), (t1, w1) = (self.samples[0], self.samples[-1]) if self.samples else ((0, 0), (0, 0))
        if t1 > t0 and w1 > w0:
            eta = f"ETA {self.bar.format_interval((work_total - work_done) * (t1 - t0) / (w1 - w0))}"
        self.bar.total, self.bar.n = total, done
        self.bar.set_postfix_str(f"{eta}, runs {self.finished}/{len(self.runs)} done"
                                 + (f", {self.failed} failed" if self.failed else ""), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------ driver
def _unique(cfgs):
    seen, out = set(), []
    for c in cfgs:
        if c.run_id not in seen:
            seen.add(c.run_id)
            out.append(c)
    return out


def _scaling_file():
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "softprior" / "group_scaling.json"


def save_group_scaling(scaling: dict[int, float], model: str = "base") -> str:
    """Save this machine's measured group scaling of ``model`` (a size label) where ``--group auto``
    finds it (one file; the other sizes' tables in it are kept)."""
    f = _scaling_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    import torch
    tables = _saved_tables()
    tables[model] = {str(k): v for k, v in scaling.items()}
    f.write_text(json.dumps({"ms_per_run_step": tables.get("base", {}),
                             "by_model": {m: t for m, t in tables.items() if m != "base"},
                             "torch": torch.__version__}))
    return str(f)


def _saved_tables() -> dict[str, dict]:
    try:
        d = json.loads(_scaling_file().read_text())
        tables = {"base": dict(d["ms_per_run_step"]), **{m: dict(t) for m, t in d.get("by_model", {}).items()}}
        return {m: t for m, t in tables.items() if t}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load_group_scaling(model: str = "base") -> dict[int, float] | None:
    """The saved table of ``model`` (``save_group_scaling``), or None when this machine has none (or it
    is unreadable)."""
    try:
        return {int(k): float(v) for k, v in _saved_tables()[model].items()} or None
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def group_scaling(model: str = "base") -> dict[int, float]:
    """The table ``--group auto`` uses for a model size: this machine's (``softprior bench``) if saved,
    else the development machine's (``GROUP_SCALING_BY_MODEL``), else the base model's."""
    return load_group_scaling(model) or GROUP_SCALING_BY_MODEL.get(model) or load_group_scaling() or GROUP_SCALING


def choose_group_size(n_runs: int, workers: int, scaling: dict[int, float] | None = None) -> int:
    """``--group auto``: the K that finishes ``n_runs`` soonest on ``workers`` workers, by the measured
    per-run-step time (``scaling``: K -> ms per run-step; default: the base model's ``group_scaling``).

    A K makes ceil(n / K) groups of equal size s (as ``_jobs`` builds them) that run in
    ceil(groups / workers) rounds, so the sweep takes ~ rounds x s x ms(s) per step (ms linearly
    interpolated between the measured K, the last one beyond). The smallest K within 5% of the best
    estimate wins: smaller groups balance better where the table's differences are noise. (9 runs on
    2 workers: K = 5, two groups at once, not K = 4, whose three groups leave one to run alone.)"""
    if scaling is None:
        scaling = group_scaling()
    n, w = max(1, n_runs), max(1, workers)
    ks = sorted(scaling)

    def ms(k):
        if k <= ks[0]:
            return scaling[ks[0]]
        for a, b in zip(ks, ks[1:]):
            if k <= b:
                return scaling[a] + (scaling[b] - scaling[a]) * (k - a) / (b - a)
        return scaling[ks[-1]]

    def estimate(k):
        groups = -(-n // k)
        size = -(-n // groups)
        return -(-groups // w) * size * ms(size)
    est = {k: estimate(k) for k in range(1, min(n, ks[-1]) + 1)}
    best = min(est.values())
    return min(k for k, e in est.items() if e <= 1.05 * best)


def group_sizes(cfgs: list[RunConfig], group_size: int | str, workers: int) -> dict[str, int]:
    """The group size of each model size (``model.size_label``) among ``cfgs``: ``group_size`` for
    all, or for "auto" each size's own ``choose_group_size`` over its own table and run count."""
    from collections import Counter

    from .model.config import size_label
    counts = Counter(size_label(c.model) for c in cfgs)
    if group_size == "auto":
        return {m: choose_group_size(n, workers, group_scaling(m)) for m, n in counts.items()}
    return {m: group_size for m in counts}


def _jobs(cfgs: list[RunConfig], group_size: int | dict[str, int], kept: list[list[str]] = ()) -> list[list[RunConfig]]:
    """The jobs of a sweep: groups of up to ``group_size`` compatible runs (``engine.group_key``;
    ``group_size`` one K, or one per model size as ``group_sizes`` gives). A group in ``kept`` (run ids
    of a group checkpoint that a killed sweep left) is kept together, so it resumes where it stopped,
    whatever size the new plan would give it."""
    from .training.engine import group_key
    from .model.config import size_label
    by_id = {c.run_id: c for c in cfgs}
    jobs = [[by_id[r] for r in g] for g in kept]
    cfgs = [c for c in cfgs if not any(c.run_id in g for g in kept)]
    sizes = group_size if isinstance(group_size, dict) else {size_label(c.model): group_size for c in cfgs}
    buckets: dict[str, list[RunConfig]] = {}
    # snapshot runs train alone: a single run's checkpoint keeps its snapshots so far, a group's does not
    jobs += [[c] for c in cfgs if c.snapshot_every]
    for c in (c for c in cfgs if not c.snapshot_every):
        buckets.setdefault(group_key(c), []).append(c)
    for b in buckets.values():
        n = -(-len(b) // max(1, sizes.get(size_label(b[0].model), 1)))  # as few groups as K allows, equal (13 -> 5, 4, 4)
        jobs += [b[i::n] for i in range(n)]
    # longest first (LPT): the costly groups start early and the short ones fill in at the end, so the
    # workers finish together instead of the last large group running alone
    return sorted(jobs, key=_job_cost, reverse=True)


class SettingError(ValueError):
    """An environment variable the executors read holds a value they cannot use (one line at the CLI)."""


def _env_int(name: str, default: int) -> int:
    """An integer from the environment (``default`` when unset); a value that is not one is a one-line
    error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"${name} must be an integer, got {raw!r}") from None


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (``default`` when unset); anything else is a
    one-line error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise SettingError(f"${name} must be a positive number of seconds, got {raw!r}")
    return value


def _env_flag(name: str) -> bool:
    """A yes/no switch from the environment: unset, 0, false, no or off is no; 1, true, yes or on is yes;
    anything else a one-line error naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"${name} must be 1 or 0 (yes / no), got {raw!r}")


# a step of a positional scheme against a fast-path step of the same size without one, where they
# differ: the contextual schemes run their own code on every logit (benchmarks/contextual_fastpath.py,
# column "fast / nope": 1 thread, assoc recall and Markov, K = 1 and 4; CoPE 2.7-3.3, DAPE 3.5-4.0,
# GPSA 1.5-1.6). Every other scheme costs about what the soft prior's step does.
STEP_COST: dict[str, float] = {"cope": 3.0, "dape": 3.7, "gpsa": 1.5}
# a step through vmap of the readable model (a scheme the fast path does not know, or active hooks)
# against a plain fast-path step: NoPE and the bias schemes measured ~2.0x (docs/PERFORMANCE.md); a
# contextual scheme there costs about its own factor (CoPE 3.8, DAPE 4.6, GPSA 2.5 in the same benchmark)
READABLE_STEP_COST = 2.0


def _job_cost(job: list[RunConfig]) -> float:
    """A relative cost estimate for scheduling: steps x runs x layers x width^2 x context, times the
    scheme's measured factor (``STEP_COST``), at least ``READABLE_STEP_COST`` off the fast path."""
    from .model.fastpath import supports
    m = job[0].model
    factor = STEP_COST.get(m.positional, 1.0)
    if not supports(m):
        factor = max(factor, READABLE_STEP_COST)
    return job[0].total_steps * len(job) * m.n_layers * m.d_model ** 2 * m.n_ctx * factor


def sweep_plan(cfgs: list[RunConfig], store: RunStore, group_size: int | str,
               workers: int) -> tuple[list[RunConfig], dict[str, int]]:
    """(the distinct configs of ``cfgs`` that ``store`` has not finished, the group size a sweep of them
    uses per model size: ``group_size``, or for "auto" ``group_sizes`` of what is left)."""
    if group_size != "auto" and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive int or 'auto', got {group_size!r}")
    todo = [c for c in _unique(cfgs) if not store.is_done(c.run_id)]
    return todo, group_sizes(todo, group_size, workers)


def execute(cfgs: list[RunConfig], store: RunStore, *, executor: str = "local", workers: int = 1,
            group_size: int | str = 1, address: str | None = None, progress: bool = True,
            wait_for_others: bool = True, poll_seconds: float = 2.0, sweep_bar: bool = True,
            on_result: Callable[[RunConfig, dict | None, str | None], None] | None = None,
            require_calibration: bool = True, checkpoint_seconds: float | None = None,
            shared_store: bool | None = None) -> SweepReport:
    """Make sure every config in ``cfgs`` is in ``store``; return what happened.

    ``group_size``: runs per group (``engine.train_group``), or "auto" (``group_sizes``: per model size).
    ``checkpoint_seconds``: how often a job checkpoints (default ``$SOFTPRIOR_CHECKPOINT_SECONDS`` or
    ``SWEEP_CHECKPOINT_SECONDS``); a killed sweep's next run resumes from there.
    ``shared_store``: every node of the Ray cluster at ``address`` sees the store's directory at the
    same path (default: ``$SOFTPRIOR_SHARED_STORE`` set, and not to 0), so its jobs checkpoint there
    too and a job retried after its node died resumes instead of starting over (a local Ray always
    checkpoints; a node that turns out not to see the store trains without checkpoints, ``_ray_work``).
    ``require_calibration``: refuse (``CalibrationMissing``) before training anything when a
    prediction row to be trained has no pre-registered calibration record (``store.record_clock.check_calibrated``)."""
    t0, started = time.perf_counter(), time.time()
    if executor not in ("local", "ray"):
        raise ValueError(f"unknown executor {executor!r}; allowed: local, ray")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    cfgs = _unique(cfgs)
    todo, group_size = sweep_plan(cfgs, store, group_size, workers)
    if require_calibration:
        store.check_calibrated(todo)
    report = SweepReport(total=len(cfgs))
    report.skipped = len(cfgs) - len(todo)
    gemm = _ledger_gemm_rate() if todo else None  # for the time ledger, before any worker starts
    # derived runs need their parents: parents form the first phase
    parents = _unique([c.parent() for c in cfgs if c.parent() is not None])
    phases = [[p for p in parents if p.run_id not in {c.run_id for c in cfgs}], [c for c in cfgs if c.parent() is None],
              [c for c in cfgs if c.parent() is not None]]
    if checkpoint_seconds is None:
        checkpoint_seconds = _env_seconds("SOFTPRIOR_CHECKPOINT_SECONDS", SWEEP_CHECKPOINT_SECONDS)
    # the bar counts every run this sweep may train (parents included); runs it does not train leave it
    sweep = _Progress([c for ph in phases for c in ph if not store.is_done(c.run_id)]) if progress and sweep_bar else None
    backend = _backend(store, executor, workers, address, shared_store, checkpoint_seconds, progress, sweep)
    failed_ids: set[str] = set()
    ledger = _Ledger(store, ("ray" if executor == "ray" else "pool" if workers > 1 else "serial"), workers, gemm)
    collect = functools.partial(_collect, backend, store, report, failed_ids, sweep, on_result, ledger)
    try:
        with _terminate_as_interrupt():
            for phase in phases:
                waiting = _run_phase(phase, store, backend, sweep, report, failed_ids, collect, group_size)
                if wait_for_others:  # runs claimed by another live process: wait until that process finishes or dies
                    _wait_for_others(waiting, store, backend, sweep, report, failed_ids, collect, poll_seconds)
    except KeyboardInterrupt:
        # SIGINT or SIGTERM to this process alone (``kill -INT``, ``timeout``): the workers did not get it.
        # They are told (each checkpoints and stops), and every job that finished is kept
        for job in (backend.interrupt() if hasattr(backend, "interrupt") else []):
            _collect(_Finished([job]), store, report, failed_ids, None, on_result, ledger)
        for c in cfgs:
            store.release(c.run_id)
        raise
    finally:
        backend.close()
        if sweep is not None:
            sweep.close()
    report.seconds = time.perf_counter() - t0
    if ledger.jobs:  # the driver's whole wall time, over its jobs (start-up, claims, writing results)
        ledger.write("sweep", f"sweep of {len(cfgs)} runs: {report.trained} trained, {report.skipped} already done",
                     report.seconds, runs=report.trained, started_at=started,
                     detail={"total": len(cfgs), "trained": report.trained, "skipped": report.skipped,
                             "failed": len(report.failed), "jobs": ledger.jobs,
                             "group_size": group_size if isinstance(group_size, (int, str)) else dict(group_size)})
    return report


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Within: SIGTERM raises KeyboardInterrupt, as SIGINT does (in the main thread only), so that a
    sweep stopped either way keeps its finished runs and its checkpoints."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class _Finished:
    """A backend holding jobs that already finished (``execute`` collects them after an interrupt)."""

    def __init__(self, jobs):
        self.jobs = list(jobs)

    def next_done(self, poll=None):
        return self.jobs.pop(0)

    def drain(self):
        return []


def _backend(store: RunStore, executor: str, workers: int, address: str | None, shared_store: bool | None,
             checkpoint_seconds: float, progress: bool, sweep: "_Progress | None"):
    """The backend ``execute`` hands its jobs to (module docstring), checkpointing under the store's root."""
    ck = str(Path(store.root).resolve())  # a Ray worker's working directory is not the driver's
    if executor == "ray":  # a remote cluster may not see the store's files: no checkpoints there unless shared
        if shared_store is None:
            shared_store = _env_flag("SOFTPRIOR_SHARED_STORE")
        return _Ray(address, workers, ck if address is None or shared_store else None, checkpoint_seconds,
                    progress=sweep is not None)
    if workers > 1:
        return _Pool(workers, ck, checkpoint_seconds, progress=sweep is not None)
    return _Serial(ck, checkpoint_seconds, progress, sweep)


def _run_phase(phase: list[RunConfig], store: RunStore, backend, sweep: "_Progress | None", report: SweepReport,
               failed_ids: set[str], collect: Callable, group_size) -> list[RunConfig]:
    """Train one phase of ``execute`` (parents, then plain runs, then derived runs): claim each run not done
    (a derived run whose parent is not available fails), keep checkpointed groups together, submit the
    jobs and collect them. Returns the runs another live process has claimed."""
    if sweep is not None:  # finished meanwhile by another process
        sweep.drop([c for c in phase if store.is_done(c.run_id)])
    todo = [c for c in phase if not store.is_done(c.run_id)]
    waiting: list[RunConfig] = []
    mine: list[RunConfig] = []
    for c in todo:
        parent = c.parent()
        if parent is not None and (parent.run_id in failed_ids or not store.is_done(parent.run_id)):
            failed_ids.add(c.run_id)
            store.record_failure(c, f"parent run {parent.run_id} is not available")
            report.failed.append((c.run_id, f"parent run {parent.run_id} is not available"))
            continue
        (mine if store.claim(c) else waiting).append(c)
    mine_ids = {c.run_id for c in mine}
    if sweep is not None:  # another process trains these (or their parent failed)
        sweep.drop([c for c in todo if c.run_id not in mine_ids])
    kept: list[list[str]] = []
    for c in mine:
        g = store.files.checkpointed_group(c.run_id)
        if g and set(g) <= mine_ids and not any(set(g) & set(k) for k in kept):
            kept.append(g)
    for job in _jobs(mine, group_size, kept):
        inits = None
        if any(c.parent() is not None for c in job):
            inits = [store.load_state(c.parent().run_id) if c.parent() is not None else None for c in job]
        _submit(backend, sweep, job, inits)
        while isinstance(backend, _Serial) and backend.busy():
            collect()
    while backend.busy():
        collect()
    return waiting


def _wait_for_others(waiting: list[RunConfig], store: RunStore, backend, sweep: "_Progress | None",
                     report: SweepReport, failed_ids: set[str], collect: Callable, poll_seconds: float) -> None:
    """Wait until every run of ``waiting`` (claimed by another live process) is done or failed there,
    polling every ``poll_seconds``; a run whose owner died is taken over and trained here."""
    while waiting:
        still = []
        for c in waiting:
            st = store.status(c.run_id)
            if st == "done":
                continue
            if st == "failed":
                report.failed.append((c.run_id, "failed in another process"))
                failed_ids.add(c.run_id)
                continue
            if store.claim(c):  # its owner died: take it over
                if sweep is not None:
                    sweep.add([c])
                _submit(backend, sweep, [c], [store.load_state(c.parent().run_id)] if c.parent() else None)
                while backend.busy():
                    collect()
                continue
            still.append(c)
        waiting = still
        if waiting:
            _sleep(poll_seconds, sweep)


def _ledger_gemm_rate() -> float | None:
    """The GEMM rate (GFLOP/s) a sweep records in the ledger beside its jobs: ``$SOFTPRIOR_GEMM_GFLOPS``
    if set, else ``bench.gemm_rate()`` measured once per process, before the sweep's workers start."""
    global _GEMM_RATE
    env = os.environ.get("SOFTPRIOR_GEMM_GFLOPS")
    if env:
        return float(env)
    if _GEMM_RATE is None:
        from .flops import gemm_rate
        _GEMM_RATE = gemm_rate()
    return _GEMM_RATE


_GEMM_RATE: float | None = None


class _Ledger:
    """Writes a sweep's rows to the store's time ledger (``RunStore.record_timing``), from the driver
    alone: each job's wall time (``JobResult.timing``, measured where it ran), the FLOP it trained
    (``bench.train_step_flops`` x the steps its pieces trained, over the runs that finished), the code
    version (``provenance.code_version``) and the sweep's GEMM rate. Timing only: a row that cannot be
    written is reported on stderr, and the sweep goes on."""

    def __init__(self, store, executor: str, workers: int, gemm: float | None):
        self.store, self.executor, self.workers, self.gemm, self.jobs = store, executor, workers, gemm, 0
        self._version = None

    def version(self, summary: dict | None = None) -> str:
        from .provenance import code_version, provenance
        if summary and "softprior_version" in summary:
            return code_version(summary)
        if self._version is None:
            self._version = code_version(provenance())
        return self._version

    def job(self, cfgs: list[RunConfig], job: JobResult) -> None:
        if job.timing is None:  # a worker that crashed (or an older worker) returned no timing
            return
        from .flops import train_step_flops
        from .model.config import size_label
        t = job.timing
        steps = {c.run_id: c.total_steps - t["from_step"] for c in cfgs}
        ok = [c for c, (res, _) in zip(cfgs, job.outs) if res is not None]
        flop = sum(train_step_flops(c) * steps[c.run_id] for c in ok)
        status = "engine_error" if job.engine_error is not None else "ok" if len(ok) == len(cfgs) else "failed"
        c0 = cfgs[0]
        name = f"{c0.task.name}/{size_label(c0.model)} " + (f"{c0.path.name} s{c0.seed}" if len(cfgs) == 1 else
                                                          f"x{len(cfgs)}: " + ", ".join(f"{c.path.name} s{c.seed}" for c in cfgs))
        summary = next((res.summary for res, _ in job.outs if res is not None), None)
        self.jobs += 1
        self.write("job", name, sum(sec for _, sec in t["pieces"]), flop, len(ok), t["pieces"][0][0], t.get("host"),
                   self.version(summary), {"run_ids": [c.run_id for c in cfgs], "pieces": t["pieces"],
                                           "steps": sum(steps[c.run_id] for c in ok), "from_step": t["from_step"],
                                           "status": status, "threads": t.get("threads"), "executor": self.executor,
                                           "workers": self.workers})

    def write(self, kind: str, name: str, seconds: float, flop: float = 0.0, runs: int = 0,
              started_at: float | None = None, host: str | None = None, version: str | None = None,
              detail: dict | None = None) -> None:
        try:
            self.store.record_timing(kind, name, seconds, flop, runs, started_at, host, version or self.version(),
                                     self.gemm, detail)
        except StoreError as e:
            print(f"softprior: the time ledger could not record {kind} {name!r}: {e}", file=sys.stderr)


def _submit(backend, sweep: _Progress | None, cfgs: list[RunConfig], inits) -> None:
    backend.submit(cfgs, inits, sweep.start(cfgs) if sweep is not None else None)


def _sleep(seconds: float, sweep: _Progress | None) -> None:
    """``time.sleep(seconds)``, redrawing the bar every PROGRESS_SECONDS (its timer ticks)."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, PROGRESS_SECONDS) if sweep is not None else left)
        if sweep is not None:
            sweep.tick()


def _collect(backend, store, report, failed_ids, sweep, on_result, ledger=None):
    poll = (lambda: sweep.tick(backend.drain())) if sweep is not None else None
    cfgs, inits, job = backend.next_done(poll)
    if sweep is not None:
        sweep.tick(backend.drain())
    store.heartbeat()  # the sweep's other claims stay alive while it works (another host's expire in 6 h)
    # a group's checkpoint lives in its first run's directory. A crashed job's stays, so the next sweep
    # resumes from it, once: a job that crashes again from it (out of memory at its group size, say)
    # loses it, and the next sweep may group its runs anew
    if not job.crashed or store.files.note_crash(cfgs[0].run_id):
        store.files.drop_checkpoint(cfgs[0].run_id)
    if ledger is not None and job.engine_error is not None:
        ledger.job(cfgs, job)
    if job.engine_error is not None:
        # record and report the engine's exception first, then fall back to one run per job
        rids = [c.run_id for c in cfgs]
        store.record_engine_error(rids, job.engine_error)
        report.engine_errors.append((rids, job.engine_error))
        print(f"softprior: the group engine failed for {len(rids)} runs ({_headline(job.engine_error)}); "
              "recorded in the store, retraining them one by one", file=sys.stderr)
        if sweep is not None:
            sweep.engine_failed(cfgs)
        for i, c in enumerate(cfgs):
            _submit(backend, sweep, [c], [inits[i]] if inits else None)
        return
    for c, (res, err) in zip(cfgs, job.outs):
        if res is not None:
            store.save_result(res)
            report.trained += 1
            if on_result:
                on_result(c, res.summary, None)
        else:
            store.record_failure(c, err or "unknown error")
            report.failed.append((c.run_id, err or "unknown error"))
            failed_ids.add(c.run_id)
            if on_result:
                on_result(c, None, err)
    if ledger is not None:
        ledger.job(cfgs, job)
    if sweep is not None:
        sweep.ended(cfgs, job.outs)


# ------------------------------------------------------------------------------------ one run
class RunFailedError(StoreError):
    pass


def run(cfg: RunConfig, store: RunStore, *, progress: bool = False, require_calibration: bool = True) -> dict:
    """Ensure ``cfg`` is trained and stored; return its summary (``softprior train`` and the Python API).
    It is a sweep of one (``execute``), so a single run, a local sweep and a Ray sweep share one code path:
    finished runs are never trained again, derived runs (post hoc continuation) train their parent first,
    and a run killed mid-way resumes from its last checkpoint. A prediction row needs a pre-registered
    calibration record unless ``require_calibration=False`` (``store.record_clock.check_calibrated``)."""
    if not store.is_done(cfg.run_id):
        report = execute([cfg], store, progress=progress, sweep_bar=False, require_calibration=require_calibration)
        if report.failed:
            rid, err = report.failed[-1]
            raise RunFailedError(f"run {rid} failed: {err.strip().splitlines()[0]}")
    return store.summary(cfg.run_id)
