"""One job of a sweep: one run, or a group of compatible runs trained together (``engine.train_group``).

``work`` is the job, pure but for its checkpoint files (configs in, ``JobResult`` out), so that it runs
alike in the driver's process, a pool worker or a Ray task (``backends``). A failing run (exception
or NaN loss) comes back as its error, and the sweep goes on; a group whose engine raises returns the
exception with its traceback (``JobResult.engine_error``), and the driver (``sweep``) retrains its
runs one by one. A job reports its step every ``PROGRESS_SECONDS`` while it trains (``_Reporter``,
through the training loop's checkpoint callback, which writes a checkpoint only when one is due as
before), and returns its wall time (``JobResult.timing``, ``_PieceClock``) for the time ledger.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import RunConfig
from .progress import PROGRESS_SECONDS

__all__ = ["JobResult", "work"]


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


def _set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(max(1, n))


class _Reporter:
    """The training loop's ``on_checkpoint`` for a job whose sweep shows progress. The loop calls it at
    the first step after every ``PROGRESS_SECONDS`` (and every ``checkpoint_every`` steps); it reports
    the step (``report(step)``) and passes the checkpoint on to ``save`` only when one is due as
    without progress: at a multiple of ``every_steps``, ``save_seconds`` after the last one it wrote,
    or at once when Ctrl-C stopped the loop (``meta["interrupted"]``, ``loop.DeferredInterrupt``)."""

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
        from ..store.files import RunFiles
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
    from ..training import engine
    from ..training.loop import train
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
