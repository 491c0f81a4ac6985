"""``softprior train``: a schedule longer than ``--steps`` is scaled and named so (issue 30, item 4);
the thread count is chosen from the free cores, ``--threads`` overrides it (item 6)."""

from __future__ import annotations

import json

import pytest
import torch

from softprior.cli import main
from softprior.store import RunStore


@pytest.fixture
def threads_restored():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _train(capsys, store, *argv):
    capsys.readouterr()
    rc = main(["train", "--store", str(store), "--json", "--no-progress", "--exploratory", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_fade_beyond_the_budget_is_scaled_and_named_so(tmp_path, capsys, threads_restored):
    """fade600 on 40 steps used to hold g = 0.5 to the end and be stored as fade600->0."""
    s, err = _train(capsys, tmp_path / "s", "--path", "fade600", "--steps", "40", "--threads", "1")
    assert s["path"] == "fade600->0 scaled 40/3600"  # in the stored summary, not only on screen
    assert "settles at step 1050" in s["label"] and "fade to 0 by step 12" in s["label"]
    assert "scaled x0.01111 as --quick does" in err and len(err.strip().splitlines()) == 2  # + the run line
    store = RunStore(tmp_path / "s")
    cfg = store.load_config(s["run_id"])
    assert cfg.label == s["label"] and cfg.path.pos.schedule.start_step == 7 and cfg.path.pos.schedule.width == 5
    assert store.metrics(s["run_id"])[-1]["g_pos"] == 0.0  # it did fade


def test_a_schedule_that_fits_keeps_its_name_and_run_id(tmp_path, capsys, threads_restored):
    from softprior.config import make_run_config
    s, err = _train(capsys, tmp_path / "s", "--path", "hard_switch3", "--steps", "4", "--threads", "1")
    assert s["path"] == "hard_switch3" and "label" not in s and "scaled" not in err
    assert s["run_id"] == make_run_config("assoc_recall", "hard_switch3", 0, steps=4).run_id
    # a path given too few steps is scaled; the default budget leaves every paper path as it is
    s, _ = _train(capsys, tmp_path / "s", "--path", "hard_switch5", "--steps", "4", "--threads", "1")
    assert s["path"] == "hard_switch5 scaled 4/3600"


def test_threads_flag_overrides_the_choice(tmp_path, capsys, threads_restored):
    s, err = _train(capsys, tmp_path / "s", "--path", "unforced", "--steps", "3", "--threads", "2")
    assert s["threads"] == 2 and "threads=2 (--threads)" in err


def test_a_single_run_takes_the_free_cores(tmp_path, capsys, monkeypatch, threads_restored):
    """On a machine whose other work keeps cores busy, a run used every core (torch's default)."""
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    torch.set_num_threads(3)
    s, err = _train(capsys, tmp_path / "s", "--path", "unforced", "--steps", "3")
    assert s["threads"] == 2 and "threads=2 (2 of 3 cores free)" in err


def test_bad_threads_is_a_usage_error(tmp_path, capsys):
    rc = main(["train", "--threads", "0", "--steps", "3", "--store", str(tmp_path / "s"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--threads" in err and len(err.strip().splitlines()) == 1


def test_choose_threads_is_each_workers_share_of_the_free_cores(monkeypatch):
    import os

    from softprior.training.runtime import choose_threads, free_cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for load, workers, want in ((0.1, 1, 8), (2.6, 1, 5), (7.9, 1, 1), (20.0, 1, 1), (0.0, 2, 4), (4.0, 2, 2)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert choose_threads(workers)[0] == want, (load, workers)
    monkeypatch.setattr(os, "getloadavg", lambda: (_ for _ in ()).throw(OSError()))
    assert free_cores() == 8  # load unknown: every core
