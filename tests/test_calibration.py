"""Calibration as a search (issue 14): criteria, spaces, the search end to end (killed and resumed),
pre-registration and the store's refusal of unregistered prediction rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softprior.calibration import CalibrationMissing, Criterion, Row, SpaceError, calibration_key, load_space
from softprior.calibration.criteria import CLAIMS, DIFFICULTY, Claim, Condition
from softprior.calibration.record import check_calibrated, make_record, save_record
from softprior.calibration.search import promising
from softprior.config import make_run_config
from softprior.executors import execute
from softprior.store import RunStore

U = Row(path="unforced")


# ------------------------------------------------------------------ criteria, worked by hand
def test_target_criterion_gap_is_distance_of_the_mean():
    c = Criterion(name="x", row=U, gates="normal", target=0.78, tol=0.05)
    r = c.check([0.70, 0.80, 0.90])  # mean .80: inside .73-.83, gap .02
    assert r.ok and r.gap == pytest.approx(0.02)
    r = c.check([1.0, 1.0, 0.23])  # mean .7433: inside, though bimodal
    assert r.ok and r.gap == pytest.approx(0.0367, abs=1e-4)
    assert not c.check([0.9]).ok


def test_each_seed_criterion_catches_a_bimodal_seed():
    c = Criterion(name="x", row=U, gates="normal", stat="each", lo=0.70, hi=0.86)
    r = c.check([1.0, 1.0, 0.23])  # .14 above, .14 above, .47 below
    assert not r.ok and r.gap == pytest.approx(0.14 + 0.14 + 0.47)
    assert c.check([0.71, 0.80, 0.85]).ok


def test_vs_chance_criterion_subtracts_the_chance_level():
    c = Criterion(name="m", row=Row(path="unforced", task={"p": 0.8}), gates="normal", lo=0.30, vs_chance=True)
    r = c.check([0.45], chance=0.107)  # .45 - .107 = .343 >= .30
    assert r.ok and r.mean == pytest.approx(0.343)
    r = c.check([0.38], chance=0.107)  # .273: .027 short
    assert not r.ok and r.gap == pytest.approx(0.027)


def test_criterion_needs_a_bound():
    with pytest.raises(ValueError, match="needs"):
        Criterion(name="x", row=U, gates="zero")
    with pytest.raises(ValueError, match="together"):
        Criterion(name="x", row=U, gates="zero", target=0.1)


def test_assoc_criteria_are_the_issue_numbers():
    c = {x.name: x for x in DIFFICULTY["assoc_recall"]}
    assert c["unforced normal"].bounds() == pytest.approx((0.73, 0.83))
    assert c["unforced normal per seed"].bounds() == (0.70, 0.86)
    assert c["forced_zero zero"].bounds() == pytest.approx((0.044, 0.144))
    assert c["unforced zero per seed"].bounds()[1] == 0.16


def test_promotion_rule():
    crit = DIFFICULTY["assoc_recall"]
    ok = [c.check(v) for c, v in zip(crit, [[0.80], [0.80], [0.10], [0.10], [0.09], [0.09]])]
    assert promising(crit, ok)
    # one seed outside [.70, .86] ends the candidate
    bad = [c.check(v) for c, v in zip(crit, [[0.95], [0.95], [0.10], [0.10], [0.09], [0.09]])]
    assert not promising(crit, bad)


def test_claim_predicates():
    cl = next(c for c in CLAIMS if c.name == "fade keeps")
    assert cl.holds({"fade600|zero": 0.7, "unforced|zero": 0.1}) is True
    assert cl.holds({"fade600|zero": 0.5, "unforced|zero": 0.1}) is False
    assert cl.holds({"fade600|zero": 0.7}) is None  # a row not measured: unknown, not false
    rel = Claim(name="r", statement="s", task="assoc_recall",
                conditions=(Condition(row=Row(path="hard_switch1050"), op="<=", value=-0.2,
                                      other=Row(path="fade600")),))
    assert rel.holds({"hard_switch1050|zero": 0.3, "fade600|zero": 0.7}) is True
    assert rel.holds({"hard_switch1050|zero": 0.6, "fade600|zero": 0.7}) is False
    # linear ICL (MSE, lower is better): the boundary claim holds unless the fade beats forced_zero by > .1
    lin = next(c for c in CLAIMS if c.task == "linear_icl")
    assert lin.holds({"fade600|zero": 0.30, "forced_zero|zero": 0.31}) is True
    assert lin.holds({"fade600|zero": 0.15, "forced_zero|zero": 0.31}) is False


# ------------------------------------------------------------------ spaces
def test_shipped_spaces_load_and_cover_the_axes():
    a = load_space("assoc_recall")
    for ax in ("task.n_pairs", "task.layout", "task.n_queries", "task.loss_on", "task.placement",
               "model.embed_init_std", "model.prior_init", "model.prior_layers", "model.content_rank",
               "model.gate_granularity"):
        assert ax in a.axes, ax
    m = load_space("markov")
    assert {"task.loss_on", "task.query"} <= set(m.axes)
    assert {"task.d", "task.n_points"} <= set(load_space("linear_icl").axes)


def test_space_errors_name_the_field(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name="x"\ntask="assoc_recall"\n[axes]\n"train.lr" = [0.01]\n')
    with pytest.raises(SpaceError, match="train.lr"):
        load_space(p)
    p.write_text('name="x"\ntask="assoc_recall"\nseeds=0\n')
    with pytest.raises(SpaceError, match="seeds"):
        load_space(p)
    p.write_text('name = [')
    with pytest.raises(SpaceError, match="cannot be parsed"):
        load_space(p)
    with pytest.raises(SpaceError, match="neither a file nor a shipped space"):
        load_space("no_such_space")


# ------------------------------------------------------------------ pre-registration
def _fade_cfg(n_pairs=4):
    return make_run_config("assoc_recall", "fade600", 0, steps=8, eval_every=4, n_val=32,
                           task_options={"n_pairs": n_pairs})


def test_store_refuses_an_unregistered_prediction_row(tmp_path):
    store = RunStore(tmp_path / "s")
    cfg = _fade_cfg()
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    with pytest.raises(CalibrationMissing, match=cfg.run_id):
        execute([cfg], store, progress=False)
    assert store.status(cfg.run_id) is None
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before
    # difficulty rows need no record; exploratory runs may skip it
    diff = make_run_config("assoc_recall", "unforced", 0, steps=8, eval_every=4, n_val=32, task_options={"n_pairs": 4})
    assert check_calibrated([diff], store.root) == {}
    # once a record covers the configuration, it trains, and the record is named
    space = load_space("tiny")
    rec = make_record(space, {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    save_record(store.root, rec)
    assert check_calibrated([cfg], store.root) == {cfg.run_id: rec["hash"]}
    assert not execute([cfg], store, progress=False).failed


def test_package_default_is_registered():
    cfg = make_run_config("assoc_recall", "fade600")
    assert check_calibrated([cfg], "/nonexistent")  # the shipped record covers it
    large = make_run_config("markov", "fade600", model="large", task_options={"p": 0.2})
    assert check_calibrated([large], "/nonexistent")


def test_cli_train_refuses_and_exploratory_trains(tmp_path, capsys):
    from softprior.cli import main
    args = ["train", "--task", "assoc_recall", "--path", "fade600", "--task-opt", "n_pairs=4", "--steps", "6",
            "--store", str(tmp_path / "s"), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("softprior: error:") and "calibration record" in err and len(err.strip().splitlines()) == 1
    assert main(args + ["--exploratory"]) == 0


# ------------------------------------------------------------------ the search end to end
def _calibrate(store, out, extra=(), **kw):
    cmd = [sys.executable, "-m", "softprior.cli", "calibrate", "assoc_recall", "--space", "tiny", "--budget", "4",
           "--steps", "12", "--store", str(store), "--out", str(out), "--no-progress", "--batch", "2", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_search_killed_and_resumed_gives_the_same_table(tmp_path):
    ref = _calibrate(tmp_path / "a", tmp_path / "out_a")
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    table = (tmp_path / "out_a" / "candidates.md").read_text()
    assert len([l for l in table.splitlines() if l.startswith("| ") and "status" not in l]) == 4
    assert (tmp_path / "out_a" / "candidates.png").stat().st_size > 1000  # the figure, before any fade600 run

    # the same search, killed with SIGKILL after its first runs are stored, then resumed
    p = _calibrate(tmp_path / "b", tmp_path / "out_b")
    deadline = time.time() + 300
    runs = tmp_path / "b" / "runs"
    while time.time() < deadline and not (runs.exists() and any(runs.glob("*/summary.json"))):
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    again = _calibrate(tmp_path / "b", tmp_path / "out_b")
    out2, err2 = again.communicate(timeout=600)
    assert again.returncode == 0, err2
    assert (tmp_path / "out_b" / "candidates.md").read_text() == table
    rows = json.loads((tmp_path / "out_b" / "candidates.json").read_text())
    assert {r["status"] for r in rows} <= {"passes", "fails", "pruned", "infeasible"}


# ------------------------------------------------------------------ provenance (issue 17)
def test_run_summary_carries_provenance_and_calibration_record(tmp_path):
    import platform

    import torch

    import softprior
    from softprior import load_results
    from softprior.calibration.record import shipped_records
    from softprior.runner import run
    store = RunStore(tmp_path / "s")
    s = run(make_run_config("assoc_recall", "fade600", 0, steps=4, eval_every=4, n_val=16), store)
    assert s["softprior_version"] == softprior.__version__
    assert s["torch_version"] == torch.__version__
    assert s["threads"] >= 1 and s["cpu"] and s["python_version"] == platform.python_version()
    assert s["calibration"] == shipped_records()["assoc_recall"]["hash"]
    assert "git_commit" in s  # None outside a git checkout
    df = load_results(store)
    assert {"softprior_version", "git_commit", "torch_version", "cpu", "threads", "calibration"} <= set(df.columns)


def test_report_warns_when_a_table_mixes_code_versions(tmp_path, capsys):
    from softprior.calibration.record import shipped_records
    from softprior.experiments import Cell
    from softprior.report import provenance_note
    from softprior.runner import run
    store = RunStore(tmp_path / "s")
    cfgs = [make_run_config("assoc_recall", "unforced", k, steps=4, eval_every=4, n_val=16) for k in (0, 1)]
    for c in cfgs:
        run(c, store)
    cells = [Cell(c, row="unforced") for c in cfgs]
    assert "Warning" not in provenance_note(store, cells)
    assert f"calibration record {shipped_records()['assoc_recall']['hash']} (2)" in provenance_note(store, cells)
    # rewrite one run's recorded version, as an older engine would have left it
    p = store.run_dir(cfgs[1].run_id) / "summary.json"
    d = json.loads(p.read_text())
    d["softprior_version"] = "0.0.9"
    p.write_text(json.dumps(d))
    import sqlite3
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(d), cfgs[1].run_id))
    note = provenance_note(store, cells)
    assert "mixes 2 code versions" in note and "0.0.9@" in note
    assert "warning" in capsys.readouterr().err
    # a difficulty row the search trained before any record existed is named as such
    d["calibration"] = None
    p.write_text(json.dumps(d))
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("UPDATE runs SET summary=? WHERE run_id=?", (json.dumps(d), cfgs[1].run_id))
    assert "difficulty row before registration (1)" in provenance_note(store, cells)


def test_register_refuses_after_a_prediction_row_and_names_the_record(tmp_path):
    from softprior.calibration.doc import register
    from softprior.calibration.search import Candidate, candidate_configs
    from softprior.calibration.robustness import prediction_rows
    space = load_space("tiny")
    store = RunStore(tmp_path / "s")
    cand = Candidate(0, {"task.n_pairs": "6", "model.prior_scale": "2.0"}, {"n_pairs": 6}, {"prior_scale": 2.0},
                     "fails", 0.5, 2, {"unforced|normal": 0.9}, {}, {}, [])
    doc = tmp_path / "CAL.md"
    rec = register(space, store, [cand], steps=4, doc=doc)
    assert rec["passes"] is False and len(rec["hash"]) == 16 and rec["registered_at"].endswith("Z")
    assert rec["hash"] in doc.read_text() and "NO candidate passes" in doc.read_text()
    (row, seed, cfg), *_ = candidate_configs(space, cand.task_options, cand.model_options, [0],
                                             rows=prediction_rows("assoc_recall"), steps=4)
    assert check_calibrated([cfg], store.root) == {cfg.run_id: rec["hash"]}
    # a second candidate whose prediction row was trained first cannot be pre-registered
    other = Candidate(1, {"task.n_pairs": "4"}, {"n_pairs": 4}, {}, "fails", 0.4, 2, {}, {}, {}, [])
    (_, _, early), *_ = candidate_configs(space, other.task_options, other.model_options, [0],
                                          rows=prediction_rows("assoc_recall"), steps=4)
    execute([early], store, progress=False, require_calibration=False)
    with pytest.raises(ValueError, match="trained before its calibration record"):
        register(space, store, [other], steps=4)


def test_formation_by_axis_names_the_axis_that_moves_formation():
    from softprior.calibration.report import formation_by_axis
    from softprior.calibration.search import Candidate

    def cand(n, std, pairs, formation):
        return Candidate(n, {"model.embed_init_std": json.dumps(std), "task.n_pairs": json.dumps(pairs)}, {}, {},
                         "fails", formation=formation)
    # embed std decides whether the circuit forms; n_pairs does not (each value: half of its seeds)
    cands = [cand(0, 0.3, 6, [900, 1200]), cand(1, 0.3, 10, [1500]), cand(2, 1.0, 6, [None]),
             cand(3, 1.0, 10, [None, None]), cand(4, 0.3, 6, [])]
    text = formation_by_axis(cands)
    assert "**embed_init_std**" in text
    assert "| embed_init_std | 0.3: 100% of 3, step 1200; 1.0: 0% of 3 |" in text
    assert "| n_pairs | 6: 67% of 3, step 1050; 10: 33% of 3, step 1500 |" in text
    assert formation_by_axis([cand(0, 0.3, 6, [])]) == ""
