"""Sweep progress (issue 30, item 2): the bar counts run-steps inside a group, the runs finished and an
ETA from the measured rate, and its timer ticks while the driver waits; reporting changes no bits."""

from __future__ import annotations


import softprior.executors.backends as backends
import softprior.executors.progress as ex
from softprior.executors.job import work
from softprior.executors.sweep import execute
from softprior.store import RunStore

from conftest import record_progress, state_dicts_equal, tiny_config


def test_a_job_reports_every_step_and_keeps_its_bits(tmp_path):
    cfgs = [tiny_config(seed=s, checkpoint_every=5) for s in range(2)]
    reports = []
    a = work(cfgs, checkpoints=str(tmp_path / "a"), checkpoint_seconds=10 ** 6,
             report=lambda step, started=False: reports.append((step, started)), report_seconds=0.0)
    assert reports == [(0, True)] + [(s, False) for s in range(1, 20)]  # every step of the group, in order
    b = work(cfgs, checkpoints=str(tmp_path / "b"), checkpoint_seconds=10 ** 6)
    for (ra, _), (rb, _) in zip(a.outs, b.outs):
        assert ra.metrics == rb.metrics and state_dicts_equal(ra.state_dict, rb.state_dict)
    # checkpoints are written when due as before (every 5 steps here), not at every report
    from softprior.store.files import RunFiles
    rids = [c.run_id for c in cfgs]
    for root in ("a", "b"):
        assert RunFiles(tmp_path / root).load_group_checkpoint(rids)["meta"]["step"] == 15


def test_the_sweep_bar_moves_inside_a_group(tmp_path, monkeypatch):
    """The bar used to move only when a whole group ended: 0/2 runs for the group's whole training."""
    monkeypatch.setattr(backends, "PROGRESS_SECONDS", 0.0)
    states = record_progress(monkeypatch)
    cfgs = [tiny_config(seed=s) for s in range(2)]
    rep = execute(cfgs, RunStore(tmp_path / "s"), group_size=2, progress=True, require_calibration=False)
    assert rep.trained == 2
    inside = [n for n, total, finished in states if finished == 0 and 0 < n < total]
    assert len(set(inside)) >= 5  # step after step, before the group ended
    shown = [n for n, _, _ in states]
    assert shown == sorted(shown) and states[-1] == (40, 40, 2)  # run-steps: 2 runs x 20 steps


def test_pool_workers_report_their_steps_and_the_timer_ticks(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "PROGRESS_SECONDS", 0.01)  # also the workers' reporting period (passed to them)
    states = record_progress(monkeypatch)
    cfgs = [tiny_config(seed=s, steps=60) for s in range(2)]
    rep = execute(cfgs, RunStore(tmp_path / "s"), workers=2, group_size=1, progress=True, require_calibration=False)
    assert rep.trained == 2
    assert sum(1 for n, _, _ in states if n == 0) >= 2  # redrawn while the workers start: the timer moves
    assert any(0 < n < total and finished == 0 for n, total, finished in states)  # steps from inside the workers
    assert states[-1] == (120, 120, 2)


def test_progress_counts_resumes_failures_and_engine_errors():
    cfgs = [tiny_config(seed=s, steps=100) for s in range(3)]
    p = ex._Progress(cfgs)
    try:
        a, b = p.start(cfgs[:2]), p.start(cfgs[2:])
        p.tick([(a, 40, True)])  # resumed at 40: 60 steps left for each of its runs
        assert (p.bar.n, p.bar.total) == (0, 220)
        p.tick([(a, 70, False), (b, 10, False)])
        assert (p.bar.n, p.bar.total) == (2 * 30 + 10, 220)
        p.engine_failed(cfgs[:2])  # its runs start again from 0, one by one
        p.tick([(a, 90, False)])  # a late report of the failed group: ignored
        assert (p.bar.n, p.bar.total) == (10, 300)
        p.ended(cfgs[2:], [(None, "diverged")])  # a failed run's untrained steps leave the total
        assert (p.bar.n, p.bar.total, p.finished, p.failed) == (10, 210, 1, 1)
        assert "runs 1/3 done, 1 failed" in str(p.bar)
        p.drop(cfgs[:1])  # e.g. claimed by another process
        assert (p.bar.n, p.bar.total) == (10, 110)
    finally:
        p.close()


def test_eta_is_the_work_left_at_the_measured_rate(monkeypatch):
    clock = [0.0]

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]
    monkeypatch.setattr(ex, "time", FakeTime)
    cfgs = [tiny_config(seed=s, steps=100) for s in range(2)]
    p = ex._Progress(cfgs)
    try:
        job = p.start(cfgs[:1])
        assert "ETA ?" in str(p.bar)  # nothing measured yet
        clock[0] = 10.0
        p.tick([(job, 20, False)])
        assert "ETA ?" in str(p.bar)
        clock[0] = 20.0
        p.tick([(job, 40, False)])  # 20 run-steps in 10 s; 160 left
        assert "ETA 01:20" in str(p.bar) and "40/200 run-steps" in str(p.bar)
    finally:
        p.close()
