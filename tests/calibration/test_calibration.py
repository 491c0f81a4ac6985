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

from softprior.calibration.criteria import DIFFICULTY, Criterion, Row
from softprior.calibration.space import SpaceError, load_space
from softprior.preregistration import CalibrationMissing, calibration_key
from softprior.store.record_clock import check_calibrated, save_record
from softprior.calibration.register import make_record
from softprior.calibration.search import promising
from softprior.config import make_run_config
from softprior.executors.sweep import execute
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


def test_one_declaration_of_each_claim_is_what_the_map_decides():
    """The robustness map reads the paper's own claims (``softprior.claims``): its rows are the ones
    those claims read, and it decides a claim on a candidate's seeds as the verdicts do."""
    from softprior.calibration.robustness import candidate_tables, claim_rows, prediction_rows
    from softprior.calibration.search import Candidate
    from softprior.claims import CLAIMS, claims_for_task, verdicts
    assert not hasattr(__import__("softprior.calibration.criteria", fromlist=["x"]), "CLAIMS")
    assert [r.key for r in prediction_rows("assoc_recall")] == ["fade600", "hard_switch1050", "posthoc", "linear0.5->0"]
    assert {r.key for r in claim_rows("markov")} >= {"fade600 p=0.2", "forced_zero p=0.8"}
    assert {c.name for c in claims_for_task("linear_icl")} == {"linear ICL boundary"}
    assert all(c in CLAIMS for c in claims_for_task("assoc_recall"))
    space = load_space("tiny")
    cand = Candidate(0, {}, {"n_pairs": 6}, {}, "fails")
    vals = {"fade600|zero": [0.95, 0.97, 0.96], "unforced|zero": [0.10, 0.12, 0.11],
            "unforced|normal": [1.0, 1.0, 1.0], "forced_zero|zero": [0.10, 0.11, 0.09],
            "hard_switch1050|zero": [0.30, 0.32, 0.34], "posthoc|zero": [0.1, 0.5, 0.9]}
    v = {cl.name: vv for cl, vv, _ in verdicts(candidate_tables(space, cand, vals))}
    assert v["fade keeps (base)"] == "reproduced"  # [.935, .985] above .77 x 1.0
    assert v["hard switch 1050"] == "reproduced"
    assert v["posthoc fails"].startswith("inconclusive")  # mean .5 but an interval [-.49, 1.49]
    assert v["linear anneal"] == "not measured"


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
    from softprior.preregistration import shipped_records
    from softprior.executors.sweep import run
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
    from softprior.preregistration import shipped_records
    from softprior.cells import Cell
    from softprior.reports.experiment import provenance_note
    from softprior.executors.sweep import run
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
    from softprior.reports.calibration_doc import register
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
    with pytest.raises(CalibrationMissing, match="trained before its calibration record"):
        register(space, store, [other], steps=4)
    with pytest.raises(CalibrationMissing, match="no measured candidate"):  # one line at the command line
        register(space, store, [], steps=4)


def test_formation_by_axis_names_the_axis_that_moves_formation():
    from softprior.reports.calibration import formation_by_axis
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


# ------------------------------------------------------------------ records that prove themselves (issue 28)
def _write(path: Path, rec: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, sort_keys=True))
    return path


def _rehash(rec: dict) -> str:
    """A record's hash recomputed by its scheme (v2: everything but the hash), worked out here."""
    import hashlib
    body = {k: v for k, v in rec.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _one_line_refusal(err, file):
    """A refused record: ``RecordRefused`` (a ``CalibrationMissing``), one line naming the file."""
    from softprior import preregistration
    assert type(err).__name__ == "RecordRefused" and isinstance(err, preregistration.RecordRefused)
    assert str(file) in str(err) and len(str(err).splitlines()) == 1


def test_shipped_records_verify_under_their_own_hash_scheme():
    from softprior.preregistration import all_shipped_records, record_hash
    recs = all_shipped_records()
    assert len(recs) == 13
    old = [r for r in recs if "hash_scheme" not in r]
    assert len(old) == 6  # written before v2: hash v1 (content and keys, not the time), their hashes unchanged
    assert all(record_hash(r) == r["hash"] for r in recs)
    assert {r["hash"] for r in old} >= {"31adace4006c89a3", "aa70d8db9a375838", "1266da7864a115c7"}
    v2 = {r["hash"]: r for r in recs if r.get("hash_scheme") == 2}  # the task-family records: their time is hashed
    assert set(v2) == {"8b3dafff745b0ccc", "5a07d4335cbcf438", "9669860e78b2d6c1",
                       "68b0d67b9dec5dca",  # the identified set of assoc_recall_identify
                       "019209dafaa98e79",  # and of the blocked regime (assoc_recall_blocked)
                       "cb0600fbd64b0168",  # the large identification (assoc_recall_large_identify)
                       "e8ad890e79b2c665"}  # Markov's (markov_identify, shipped as identified-markov)
    for new in v2.values():
        assert record_hash({**new, "registered_at": "2020-01-01T00:00:00Z"}) != new["hash"]
        assert new["claims"] and all(c["conditions"] for c in new["claims"])  # the predicates, registered
    # v1 leaves the time out of the hash; v2 (what make_record writes) covers content, keys and time
    v1 = dict(old[0], registered_at="1999-01-01T00:00:00Z")
    assert record_hash(v1) == old[0]["hash"]
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, ["k"], {"x": 0.5}, True)
    assert rec["hash_scheme"] == 2 and record_hash(rec) == rec["hash"] and len(rec["hash"]) == 16
    for field, value in (("registered_at", "1999-01-01T00:00:00Z"), ("keys", ["k", "other"]), ("measured", {"x": 0.6})):
        assert record_hash({**rec, field: value}) != rec["hash"], field


def test_a_forged_record_is_refused_naming_the_file(tmp_path, capsys):
    store = RunStore(tmp_path / "s")
    cfg = _fade_cfg()
    # a record that names the configuration, with a hash that is not its content's
    real = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    forged = _write(store.root / "calibration" / f"assoc_recall-{'0' * 16}.json", {**real, "hash": "0" * 16})
    with pytest.raises(CalibrationMissing) as e:
        execute([cfg], store, progress=False)
    _one_line_refusal(e.value, forged)
    assert "forged or edited" in str(e.value) and store.status(cfg.run_id) is None
    from softprior.cli import main
    rc = main(["train", "--task", "assoc_recall", "--path", "fade600", "--task-opt", "n_pairs=4", "--steps", "6",
               "--store", str(store.root), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and str(forged) in err and len(err.strip().splitlines()) == 1


def test_an_edited_record_is_refused_naming_the_file(tmp_path, monkeypatch):
    from softprior import preregistration as R
    store = RunStore(tmp_path / "s")
    cfg = _fade_cfg()
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {"x": 0.5}, True)
    p = save_record(store.root, rec)
    assert check_calibrated([cfg], store.root) == {cfg.run_id: rec["hash"]}
    for field, value in (("measured", {"x": 0.9}), ("registered_at", "2020-01-01T00:00:00Z")):
        _write(p, {**rec, field: value})  # edited in place, the hash kept
        with pytest.raises(CalibrationMissing) as e:
            check_calibrated([cfg], store.root)
        _one_line_refusal(e.value, p)
    # a shipped record edited after it was written: the package default is refused where it is read
    ship = tmp_path / "registered"
    for f in R.shipped_files():
        (ship / Path(str(f)).name).parent.mkdir(exist_ok=True)
        (ship / Path(str(f)).name).write_text(f.read_text())
    shipped = json.loads((ship / "assoc_recall.json").read_text())
    _write(ship / "assoc_recall.json", {**shipped, "task_options": {**shipped["task_options"], "n_pairs": 8}})
    import softprior.preregistration
    monkeypatch.setattr(softprior.preregistration, "_shipped_files", lambda: sorted(ship.glob("*.json")))
    with pytest.raises(CalibrationMissing) as e:
        make_run_config("assoc_recall", "fade600")
    _one_line_refusal(e.value, ship / "assoc_recall.json")


def test_a_back_dated_record_added_after_its_rows_is_refused(tmp_path):
    from softprior.store.record_clock import covering_records
    store = RunStore(tmp_path / "s")
    cfg = _fade_cfg()
    execute([cfg], store, progress=False, require_calibration=False)  # exploratory: trained under no record
    # then a record of that configuration, back-dated to before the row and hashed correctly, is put in the store
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    rec["registered_at"] = "2020-01-01T00:00:00Z"
    rec["hash"] = _rehash(rec)
    late = _write(store.root / "calibration" / f"assoc_recall-{rec['hash']}.json", rec)
    other_seed = cfg.model_copy(update={"seed": 1})
    for call in (lambda: check_calibrated([other_seed], store.root), lambda: covering_records([cfg], store.root),
                 lambda: save_record(store.root, rec)):
        with pytest.raises(CalibrationMissing) as e:
            call()
        _one_line_refusal(e.value, late)
        assert cfg.run_id in str(e.value) and "after the fact" in str(e.value)
    assert store.index.record_sightings().get(rec["hash"]) is None  # never taken into the store's clock
    assert [r["record"] for r in store.rows()] == [""]  # the row keeps the (no) record it ran under


def test_a_row_is_covered_only_by_a_record_the_store_saw_before_it_started(tmp_path):
    from softprior.store.record_clock import covering_records
    store = RunStore(tmp_path / "s")
    cfg = _fade_cfg()
    assert store.claim(cfg)  # the row starts (a sweep claims it) ...
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    save_record(store.root, rec)  # ... and only then is its record written
    later = cfg.model_copy(update={"seed": 1})
    assert covering_records([cfg, later], store.root) == {cfg.run_id: None, later.run_id: rec["hash"]}
    assert store.index.record_sightings()[rec["hash"]] > store.index.started([cfg.run_id])[cfg.run_id]
    # a row trained after the record stores the hash it ran under
    assert not execute([later], store, progress=False).failed
    row = next(r for r in store.rows() if r["run_id"] == later.run_id)
    assert row["record"] == rec["hash"] == store.summary(later.run_id)["calibration"]


def test_record_sightings_are_append_only(tmp_path):
    import sqlite3
    store = RunStore(tmp_path / "s")
    seen = store.index.see_records({"a" * 16: "x.json"})
    assert store.index.see_records({"a" * 16: "y.json"}) == seen  # the first sighting stays
    with sqlite3.connect(store.root / "index.sqlite") as db:
        for sql in ("UPDATE record_sightings SET first_seen = 0", "DELETE FROM record_sightings"):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                db.execute(sql)


# ------------------------------------------------------------------ git, the clock of the shipped records
REPO = Path(__file__).resolve().parents[2]


def test_shipped_records_precede_the_tables_computed_under_them():
    from softprior.preregistration import git_clock_problems
    problems = git_clock_problems(REPO)
    if problems is None:
        pytest.skip("git or the repository's history is not available here")
    assert problems == []


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _history(tmp_path, steps):
    """A repository with the project's layout, one commit per (message, {path: text}) step."""
    import shutil
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    for msg, files in steps:
        for rel, text in files.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", msg)
    return repo


def test_git_clock_refuses_a_record_added_or_edited_after_its_tables(tmp_path):
    from softprior.preregistration import git_clock_problems, record_hash
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, ["k"], {}, True)
    reg = "src/softprior/calibration/registered/assoc_recall.json"
    table = "docs/results/paths/table.md"
    text = json.dumps(rec, indent=1, sort_keys=True)
    md = f"| a | b |\n\n_Provenance of these 3 runs: code x (3); calibration record {rec['hash']} (3)._\n"
    ok = _history(tmp_path / "ok", [("record", {reg: text}), ("table", {table: md})])
    assert git_clock_problems(ok) == []
    # the table first, then its record, back-dated
    late = dict(rec, registered_at="2020-01-01T00:00:00Z")
    late["hash"] = record_hash(late)
    md_late = md.replace(rec["hash"], late["hash"])
    repo = _history(tmp_path / "late", [("table", {table: md_late}), ("record", {reg: json.dumps(late)})])
    (line,) = git_clock_problems(repo)
    assert line.startswith(reg + ":") and late["hash"] in line
    # a v1 record whose time was edited after its table (its hash leaves the time out)
    v1 = {k: v for k, v in rec.items() if k not in ("hash_scheme", "hash")}
    v1["hash"] = record_hash(v1)
    md_v1 = md.replace(rec["hash"], v1["hash"])
    repo = _history(tmp_path / "v1", [("record", {reg: json.dumps(v1)}), ("table", {table: md_v1}),
                                      ("back-date", {reg: json.dumps(dict(v1, registered_at="2020-01-01T00:00:00Z"))})])
    (line,) = git_clock_problems(repo)
    assert line.startswith(reg + ":")
    # a table naming a record the package does not ship
    repo = _history(tmp_path / "none", [("table", {table: md})])
    (line,) = git_clock_problems(repo)
    assert line.startswith(table + ":") and rec["hash"] in line
    assert git_clock_problems(tmp_path) is None  # not a repository


def test_a_report_verifies_the_records_its_runs_name(tmp_path):
    from softprior.preregistration import shipped_records
    from softprior.store.record_clock import verify_named
    store = RunStore(tmp_path / "s")
    h = shipped_records()["assoc_recall"]["hash"]
    assert set(verify_named(store.root, [h, None, ""])) == {h}
    with pytest.raises(CalibrationMissing, match="f" * 16):
        verify_named(store.root, ["f" * 16])  # a hash no record holds
    cfg = _fade_cfg()
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    p = save_record(store.root, rec)
    assert verify_named(store.root, [rec["hash"]]) == {rec["hash"]: rec}
    _write(p, {**rec, "passes": False})  # edited after it was written
    with pytest.raises(CalibrationMissing) as e:
        verify_named(store.root, [h])
    _one_line_refusal(e.value, p)


def test_a_table_refuses_runs_whose_record_no_one_holds(tmp_path):
    """``reports.experiment.provenance_note`` (every table's provenance line) verifies the records its runs name."""
    from softprior.preregistration import shipped_records
    from softprior.cells import Cell
    from softprior.reports.experiment import provenance_note

    class Source:  # a report's source (a store or a bundle) holding one finished prediction run
        root = tmp_path
        named = "f" * 16

        def is_done(self, run_id):
            return True

        def summary(self, run_id):
            return {"calibration": self.named, "softprior_version": "0", "git_commit": "abc", "path": "fade600"}

        def calibration_records(self):
            return []

    src, cells = Source(), [Cell(_fade_cfg(), row="fade600")]
    with pytest.raises(CalibrationMissing, match="f" * 16):
        provenance_note(src, cells)
    src.named = shipped_records()["assoc_recall"]["hash"]  # a record the package ships and verifies
    assert src.named in provenance_note(src, cells)


def test_a_registered_default_trains_the_configurations_the_search_measured(tmp_path):
    """A candidate inherits what its space does not vary from the package default (``candidate_configs``);
    the record keeps those inherited options, so the new default (plain config + the record's options)
    builds the very configurations the search measured, run id for run id."""
    from softprior.reports.calibration_doc import register
    from softprior.calibration.search import Candidate, candidate_configs
    from softprior.config import make_run_config
    from softprior.preregistration import default_options
    space = load_space("tiny")  # varies n_pairs and prior_scale only
    cand = Candidate(0, {"task.n_pairs": "4", "model.prior_scale": "2.0"}, {"n_pairs": 4}, {"prior_scale": 2.0},
                     "passes", 0.1, 2, {}, {}, {}, [])
    rec = register(space, RunStore(tmp_path / "s"), [cand], steps=4)
    t_def, m_def = default_options("assoc_recall")
    assert m_def and all(rec["model_options"][k] == (list(v) if isinstance(v, tuple) else v)
                         for k, v in m_def.items() if k != "prior_scale")
    m = {k: tuple(v) if k == "prior_layers" else v for k, v in rec["model_options"].items()}
    for row, seed, cfg in candidate_configs(space, cand.task_options, cand.model_options, [0, 1], steps=4):
        again = make_run_config("assoc_recall", row.path, seed, steps=4, calibrated=False,
                                task_options={**rec["task_options"], **row.task}, model_options=m)
        assert again.run_id == cfg.run_id


def test_an_infeasible_candidate_says_why_in_one_line(tmp_path):
    """The reason shown for an infeasible candidate names the problem in one line, without pydantic's
    "Value error, " prefix or its documentation link (``config.validation_message``), and is re-derived
    from the candidate's options: a study holding the multi-line text an older search stored shows the
    reason, not the text, and the table prints it whole (not cut mid-word at 60 characters)."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from pydantic import ValidationError

    from softprior.reports.calibration import candidates_table
    from softprior.calibration.search import _study, candidate_configs, load_candidates, refused_reason
    from softprior.config import validation_message
    space = load_space("linear_icl_formats")
    why = "task.n_points=31 does not fit in the context of 32 tokens (at most 15 in the interleaved format)"
    with pytest.raises(ValidationError) as e:
        candidate_configs(space, {"format": "interleaved", "d": 4, "n_points": 31}, {}, [0])
    assert validation_message(e.value) == why
    with pytest.raises(ValidationError) as e:
        make_run_config("markov", "unforced", seed=0, task_options={"p": 7.0})
    assert validation_message(e.value) == "p: Input should be less than or equal to 1 (got 7.0)"
    assert validation_message(ValueError("a\n  b")) == "a b"
    assert refused_reason(space, {"format": "paired", "d": 4, "n_points": 31}, {}) is None

    store = RunStore(tmp_path / "s")
    study = _study(space, store)
    params = {k: json.dumps(v[0]) for k, v in space.axes.items()}
    params.update({"task.format": json.dumps("interleaved"), "task.d": json.dumps(4), "task.n_points": json.dumps(31)})
    dists = {k: CategoricalDistribution(space.labels(k)) for k in space.axes}
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dists, state=optuna.trial.TrialState.FAIL,
        user_attrs={"infeasible": "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"}))
    [c] = load_candidates(space, store)
    assert (c.status, c.error) == ("infeasible", why)
    assert f"infeasible ({why})" in candidates_table(space, [c])


def test_no_rows_is_no_configs_and_linear_icl_registers_over_its_own_difficulty_rows():
    """``candidate_configs(rows=[])`` is no runs (not the difficulty rows): linear ICL's claims read only
    difficulty rows, so it has no prediction row, and registering a candidate whose difficulty rows
    the search trained is not refused as if a prediction row had run first."""
    from softprior.calibration.robustness import prediction_rows
    from softprior.calibration.search import candidate_configs
    space = load_space("linear_icl_formats")
    assert candidate_configs(space, {}, {}, [0], rows=[]) == []
    assert [r.path for r, _, _ in candidate_configs(space, {}, {}, [0])] == ["forced_zero", "unforced"]
    assert prediction_rows("linear_icl") == []


def test_the_map_block_names_its_rows_or_says_it_has_none():
    """The robustness block's header names the prediction rows it trains, and says so when a task's
    mapped claims read only difficulty rows (linear ICL) instead of printing an empty list."""
    from softprior.reports.calibration_doc import _mapped_rows
    from softprior.calibration.robustness import prediction_rows
    assert _mapped_rows(prediction_rows("assoc_recall")) == "rows fade600, hard_switch1050, posthoc, linear0.5->0"
    assert _mapped_rows(prediction_rows("linear_icl")) == "no prediction rows (the claims read the difficulty rows)"


def test_candidates_whose_trajectory_runs_cannot_differ_are_one_effect():
    """The fade, forced_zero and the hard switch force every gate: the gate logit's initial value and
    granularity are never read, and a cap on a prior that has none is not part of the model, so
    candidates differing only there train the same trajectory runs (one effect, not several)."""
    from types import SimpleNamespace

    from softprior.reports.calibration_doc import trajectory_key
    base = {"prior_init": "locality", "prior_scale": 2.0, "content_rank": 0, "gate_logit_init": 0.0,
            "gate_granularity": "shared", "prior_cap": 8.0}

    def key(**m):
        return trajectory_key(SimpleNamespace(task_options={"placement": "spread"}, model_options={**base, **m}))
    assert key() == key(gate_logit_init=-3.0, gate_granularity="head") == key(prior_cap=32.0)
    assert key() != key(content_rank=8) and key() != key(prior_scale=0.5)
    assert key(prior_init="bounded") != key(prior_init="bounded", prior_cap=32.0)  # a bounded prior's cap is read
