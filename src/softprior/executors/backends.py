"""Where a sweep's jobs run (``_backend`` picks one for ``sweep.execute``):

- ``serial``: in this process;
- ``local`` with ``workers > 1``: a process pool, each worker with ``torch`` threads = cores/workers;
- ``ray``: one Ray task per job with ``num_cpus`` set, consumed with ``ray.wait`` as they finish,
  so a cluster without a shared filesystem works (results travel back through Ray's object store).
  A job whose worker process or node dies is run again by Ray (``RAY_MAX_RETRIES``), from its
  checkpoint where the node sees the store, else from step 0; results reach the store only through
  the driver, once per job, so a retried job neither duplicates nor half-writes a run (docs/CLUSTER.md).

A job whose pool worker died is run again from its checkpoint, up to ``POOL_MAX_RETRIES`` times.
A job's progress reports reach the driver in-process (serial), through a ``multiprocessing`` queue
(pool) or a ``ray.util.queue.Queue`` (Ray); the driver polls them every ``PROGRESS_SECONDS`` while it
waits.

Every backend: submit(cfgs, init_states, job) starts a job (``job``: its key for progress reports,
None when the sweep shows none); next_done(poll) waits for one to finish, calling ``poll()`` every
PROGRESS_SECONDS meanwhile; drain() returns the progress reports (job, step, started) that arrived.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
from pathlib import Path

from ..store import RunStore
from ..training.runtime import usable_cores
from .environment import _env_flag, _env_int
from .job import JobResult, work
from .progress import PROGRESS_SECONDS, _Progress


# a Ray job whose worker process or node dies (a system failure; an exception in training is a result,
# returned by ``work``) is run again up to this many times before its runs are recorded as failed
# ($SOFTPRIOR_RAY_MAX_RETRIES). Ray's own default (3, or $RAY_TASK_MAX_RETRIES) is not relied on.
RAY_MAX_RETRIES = 3
# the same for a job of the local process pool whose worker died (``_Pool``)
POOL_MAX_RETRIES = 3


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
        checkpoint and stops: ``loop.DeferredInterrupt``), then (cfgs, init_states, JobResult) of every
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
