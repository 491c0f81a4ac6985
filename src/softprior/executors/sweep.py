"""Run a list of run configs: one driver (``execute``), several backends (``backends``).

The driver alone touches the store: it skips finished runs, trains parents of derived runs first,
claims runs in a transaction (so two sweeps on one store never train the same run), hands *pure*
jobs (configs in, results out: ``job.work``) to a backend, and writes each result as it arrives.
``run`` is a sweep of one.

Nothing is lost when a sweep is killed: a job (a run or a group) writes a checkpoint to its run
directory every ``checkpoint_seconds`` of training (default ``SWEEP_CHECKPOINT_SECONDS``; not on a
remote Ray cluster, which may not see the store's files, unless ``shared_store`` says every node
sees it), and the next sweep keeps a checkpointed group together and resumes it bit-identically. A
job whose worker process died is run again from its checkpoint (a pool job up to ``POOL_MAX_RETRIES``
times, a Ray job ``RAY_MAX_RETRIES``); out of retries, it has its runs recorded as failed and
keeps its checkpoint, so the next sweep resumes them. Workers write only these scratch files; the driver
alone writes results and the index.

A job is one run or a group of compatible runs trained together (``engine.train_group``). A failing
run (exception or NaN loss) is recorded with its error and the sweep goes on. When the group engine
itself raises, the driver first records the exception with its traceback in the store
(``RunStore.engine_errors``) and in the sweep report (``SweepReport.engine_errors``, printed by
``line()``), and only then falls back to training the group's runs one by one: an engine bug shows up
as an error, not as mere slowness.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from ..config import RunConfig
from ..store import RunStore
from ..store.errors import StoreError
from .backends import _Finished, _Serial, _backend
from .environment import _env_seconds
from .grouping import _jobs, group_sizes
from .ledger import _Ledger, _ledger_gemm_rate
from .progress import PROGRESS_SECONDS, _Progress

__all__ = ["execute", "run", "RunFailedError", "sweep_plan", "SweepReport", "SWEEP_CHECKPOINT_SECONDS"]


# a sweep job checkpoints after every this many seconds of training ($SOFTPRIOR_CHECKPOINT_SECONDS)
SWEEP_CHECKPOINT_SECONDS = 120.0


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


def _unique(cfgs):
    seen, out = set(), []
    for c in cfgs:
        if c.run_id not in seen:
            seen.add(c.run_id)
            out.append(c)
    return out


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
