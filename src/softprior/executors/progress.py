"""A sweep's progress bar (``_Progress``): one bar in run-steps (a group of K runs of S steps is K x S),
with the runs finished and an ETA from the step rate measured over the last ``RATE_SECONDS``
(weighted by each job's cost per step, ``grouping._job_cost``, so a sweep that starts with its
large-model groups does not promise too much). The jobs report their steps every ``PROGRESS_SECONDS``
(``job._Reporter``, through the backends), and the driver redraws the bar as often while it waits, so
the timer ticks. Reporting reads the step count only: no run's numbers change.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from ..config import RunConfig
from .grouping import _job_cost


# while it trains, a job of a sweep that shows progress reports its step this often, and the driver
# redraws the bar (its timer) this often while it waits; the ETA is from the rate over the last RATE_SECONDS
PROGRESS_SECONDS = 1.0
RATE_SECONDS = 30.0


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
