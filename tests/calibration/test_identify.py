"""Identification (src/softprior/tiers.py, calibration/identify.py): the paper's rows in two tiers, the
distance of a candidate from each identification row in units of its scale, the identified set, and
its pre-registration end to end (a tiny search: 20 steps)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from softprior.calibration.criteria import Criterion, Row
from softprior.calibration.identify import hard_ok, identified, matched_rows
from softprior.calibration.space import MIN_SET, load_space
from softprior.preregistration import RecordRefused, calibration_key, verify_record
from softprior.store.record_clock import check_calibrated
from softprior.calibration.register import make_record
from softprior.calibration.search import Candidate
from softprior.config import make_run_config
from softprior.tiers import IDENTIFICATION, ROWS, SE_FLOOR, TRAJECTORY, PaperRow, tiers_spec


# ------------------------------------------------------------------ rows and distances, by hand
def test_scale_is_the_papers_spread_floored_at_one_standard_error_or_the_stated_tolerance():
    tight = PaperRow("r", "identification", "assoc_recall", "base", "forced_const0.5", "normal", 0.164, spread=0.003)
    assert tight.scale == SE_FLOOR == 0.02  # .003 is below what 512 validation examples resolve
    assert tight.z(0.204) == pytest.approx(2.0) and tight.matched(0.2039)
    assert not tight.matched(0.2041) and not tight.matched(0.1239)
    wide = PaperRow("w", "identification", "assoc_recall", "base", "fade600", "zero", 0.734, spread=0.028)
    assert wide.scale == 0.028 and wide.z(0.678) == pytest.approx(2.0)
    tol = PaperRow("t", "identification", "assoc_recall", "base", "unforced", "T=120", 0.263, tol=0.05)
    assert tol.scale == 0.05 and tol.matched(0.363) and not tol.matched(0.364)


def test_an_identification_criterion_measures_its_gap_in_units_of_scale():
    c = Criterion(name="const", row=Row(path="forced_const0.5"), gates="zero", target=0.114, tol=0.04, scale=0.02)
    r = c.check([0.134, 0.174])  # mean .154: two units above .114, on the boundary
    assert r.ok and r.gap == pytest.approx(2.0)
    r = c.check([0.16])
    assert not r.ok and r.gap == pytest.approx(2.3)


def test_tiers_hold_every_static_row_of_the_paper_once():
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names))
    ident = {(r.model, r.source, r.read): r.paper for r in IDENTIFICATION if r.task == "assoc_recall"}
    # Table 1 both sizes, the constant gate included; Sec. 4.2's interventions; Sec. 4.5's length test
    assert ident[("base", "forced_const0.5", "normal")] == 0.164 and ident[("base", "forced_const0.5", "zero")] == 0.114
    assert ident[("large", "forced_const0.5", "normal")] == 0.212 and ident[("large", "unforced", "normal")] == 0.797
    assert ident[("base", "unforced", "pos=0")] == 0.073 and ident[("base", "unforced", "content=0")] == 0.791
    assert ident[("base", "unforced", "T=120")] == 0.263 and ident[("base", "soft_content_only", "normal")] == 0.067
    assert {"base", "large"} == {r.model for r in IDENTIFICATION if r.read == "params"}
    # every trajectory row changes or removes the prior during training: none is a calibration target
    assert all(r.tier == "trajectory" for r in TRAJECTORY) and all(r.reason for r in ROWS)
    assert {r.source for r in TRAJECTORY} >= {"fade600", "linear0.5->0", "hard_switch1050", "hard_switch600",
                                              "posthoc", "prior_dropout", "dual_loss"}
    assert not {r.source for r in IDENTIFICATION} & {"fade600", "hard_switch1050", "posthoc", "linear0.5->0"}


def test_a_records_hash_covers_the_tier_assignment():
    space = load_space("assoc_recall_identify")
    rec = make_record(space, {}, {}, ["k"], {}, True)
    assert rec["tiers"] == json.loads(json.dumps(tiers_spec()))
    verify_record(rec, "r.json")
    moved = json.loads(json.dumps(rec))
    row = next(r for r in moved["tiers"] if r["name"] == "hard switch 1050")
    row["tier"] = "identification"  # a trajectory row moved into the targets after the results were seen
    with pytest.raises(RecordRefused, match="not the hash of its content"):
        verify_record(moved, "r.json")


# ------------------------------------------------------------------ the identified set
def _cand(space, cid: int, values: dict[str, float], hard: bool, distance: float) -> Candidate:
    crit = space.criteria()
    vals = {f"{c.row.key}|{c.gates}": [values.get(c.name, c.target if c.target is not None else 0.5)]
            for c in crit}
    checks = {c.name: (hard if c.scale is None else True) for c in crit}
    return Candidate(cid, {"model.id": json.dumps(cid)}, {}, {}, "fails", distance, 3, {}, vals, checks)


def test_the_identified_set_ranks_hard_constraints_then_matched_rows_then_distance():
    space = load_space("assoc_recall_identify")
    off = {"forced_const0.5 base normal": 0.78}  # the constant gate learns: one row unmatched
    a = _cand(space, 1, {}, True, 5.0)  # every row at the paper's value
    b = _cand(space, 2, off, True, 1.0)
    c = _cand(space, 3, {}, False, 0.5)  # matches every row but a seed broke a hard constraint
    d = _cand(space, 4, off, True, 0.8)
    assert all(matched_rows(space, a).values()) and not matched_rows(space, b)["forced_const0.5 base normal"]
    assert hard_ok(space, a) and not hard_ok(space, c)
    got = identified(space, [c, b, a, d], k=3)
    assert [x.number for x in got] == [1, 4, 2]  # fewer than k pass: the k best
    many = [_cand(space, i, {}, True, float(i)) for i in range(MIN_SET + 2)]
    assert len(identified(space, many)) == MIN_SET + 2  # every passing candidate, when at least k pass
    pruned = _cand(space, 99, {}, True, 0.1)
    pruned.n_seeds = 1
    assert pruned not in identified(space, many + [pruned])  # a distance on one seed is not comparable


def test_a_regime_declares_its_own_hard_constraints_and_set_size():
    """The blocked regime: its hard constraints replace the task's per-seed ones (unforced zero up to
    .25, the constant gate at most .30), the paper's rows stay targets, and its set holds five."""
    space = load_space("assoc_recall_blocked")
    hard = {c.name: c.bounds() for c in space.criteria() if c.scale is None}
    assert hard["unforced zero per seed"] == (-math.inf, 0.25) and hard["unforced normal per seed"] == (0.73, math.inf)
    assert hard["forced_const0.5 at g=.5 (blocked)"] == (-math.inf, 0.30)
    # the constant gate read at the gate it trained with, not at sigmoid(initial logit)
    assert {c.name: c.gates for c in space.criteria()}["forced_const0.5 base normal"] == "g=.5"
    assert {c.name: c.gates for c in load_space("assoc_recall_identify").criteria()}["forced_const0.5 base normal"] == "normal"
    assert "unforced base zero" in {c.name for c in space.criteria() if c.scale is not None}  # reported, missed
    blocked = {"forced_const0.5 base normal": 0.164, "unforced base zero": 0.20}
    a = _cand(space, 1, blocked, True, 3.0)
    assert a.values["forced_const0.5|g=.5"] == [0.164]
    a = _cand(space, 1, blocked, True, 3.0)
    a.values["unforced|zero"] = [0.20]  # .20 breaks the task's .16 but not the regime's .25
    a.checks = {c.name: c.check(a.values[f"{c.row.key}|{c.gates}"]).ok if c.scale is None else True
                for c in space.criteria()}
    assert hard_ok(space, a) and not matched_rows(space, a)["unforced base zero"]
    assert space.min_set == 5 and len(identified(space, [_cand(space, i, {}, True, float(i)) for i in range(7)])) == 7
    assert len(identified(space, [_cand(space, i, blocked, True, float(i)) for i in range(7)])) == 5
    with pytest.raises(ValueError, match="hard"):
        load_space("assoc_recall_blocked").model_validate({**space.model_dump(), "identify": False})


def test_a_search_at_the_large_size_scores_table_1s_large_rows_only():
    rows = {c.name: c.target for c in load_space("assoc_recall_large_identify").criteria() if c.scale is not None}
    assert rows == {"unforced large normal": 0.797, "unforced large zero": 0.102, "forced_zero large zero": 0.102,
                    "forced_const0.5 large zero": 0.160, "forced_const0.5 large normal": 0.212,
                    "parameters large (K)": 265.0}
    base = {c.name for c in load_space("assoc_recall_identify").criteria() if c.scale is not None}
    assert not any("large" in n for n in base) and "forced_const0.5 base normal" in base


def test_markov_identification_scores_the_papers_accuracy_at_each_p():
    space = load_space("markov_identify")
    rows = {(c.row.task["p"], c.target) for c in space.criteria() if c.scale is not None}
    assert rows == {(0.2, 0.83), (0.5, 0.92), (0.8, 0.97)}
    hard = [c for c in space.criteria() if c.scale is None]
    assert all(c.vs_chance and c.stat == "each" for c in hard)
    assert {c.row.task["p"] for c in hard if c.row.path == "forced_zero"} == {0.2, 0.5, 0.8}



def test_the_rows_a_search_measures_are_not_predictions_its_record_must_come_before():
    """Markov's identification measures forced_zero at every p (the paper's static evidence: it stays
    low), which its claims also read beside the fade; those runs exist before registration, so they are
    not prediction rows. The fade at every p is, and nothing the search measured is."""
    from softprior.calibration.robustness import prediction_rows
    space = load_space("markov_identify")
    searched = space.rows()
    every = prediction_rows("markov", True, wide=True)
    pred = prediction_rows("markov", True, wide=True, searched=searched)
    assert {(r.path, r.task["p"]) for r in every if r not in pred} == {("forced_zero", p) for p in (0.2, 0.5, 0.8)}
    assert {(r.path, r.task["p"]) for r in pred} == {("fade600", p) for p in (0.2, 0.5, 0.8)}
    assert not [r for r in pred if r in searched]
    # one reading for the record and the map: a search space's own prediction rows
    from softprior.calibration.robustness import space_prediction_rows
    assert space_prediction_rows(space, wide=True) == pred
    effect = load_space("assoc_recall_effect")  # an exploratory search measures the fade: its map counts it
    assert any(r.path == "fade600" for r in space_prediction_rows(effect))

# ------------------------------------------------------------------ end to end (20 steps)
_SPACE = """
name = "tiny_identify"
task = "assoc_recall"
sampler = "grid"
seeds = 2
first_seeds = 1
identify = true
[base.task]
keys = "replacement"
layout = "pool"
n_keys = 10
n_pairs = 6
[axes]
"model.content_rank" = [0]
"model.gate_logit_init" = [0.0, -2.0]
"""


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "softprior.cli", "calibrate", "assoc_recall", "--space",
                           str(tmp_path / "space.toml"), "--steps", "20", "--no-progress", "--group", "1",
                           "--store", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)


def test_identification_search_registers_its_set_on_five_seeds_and_covers_only_it(tmp_path):
    (tmp_path / "space.toml").write_text(_SPACE)
    r = _cli(tmp_path, "--budget", "2", "--doc", str(tmp_path / "doc.md"))
    assert r.returncode == 0, r.stderr
    searched = (tmp_path / "doc.md").read_text()  # not registered yet: no map of trajectory rows
    assert "<!-- table:calibration-tiny_identify -->" in searched and "robustness-tiny_identify" not in searched
    r = _cli(tmp_path, "--register", "--doc", str(tmp_path / "doc.md"))
    assert r.returncode == 0, r.stderr
    assert "<!-- table:robustness-tiny_identify -->" in (tmp_path / "doc.md").read_text()
    after = (tmp_path / "out" / "identified.md").read_text()
    assert after.startswith("## The identified set of `tiny_identify`") and "### The trajectory claims" in after
    rec = next(json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("*.json")
               if '"identified"' in p.read_text())
    assert len(rec["identified"]) == 2 and rec["tiers"] == json.loads(json.dumps(tiers_spec()))
    for m in rec["identified"]:  # every member measured on five seeds, every row kept with its z
        row = m["rows"]["forced_const0.5 base zero"]
        assert len(row["values"]) == 5 and row["z"] == pytest.approx(abs(row["mean"] - 0.114) / 0.02)
        assert m["rows"]["parameters base (K)"]["mean"] == pytest.approx(35.460)  # 34,816 + B^pos + LN + gates
    doc = (tmp_path / "doc.md").read_text()
    assert "<!-- table:identification-tiny_identify -->" in doc and "forced_const0.5 base normal" in doc
    # a trajectory row of a member is covered by the record; of a configuration outside the set, not
    member = make_run_config("assoc_recall", "fade600", 0, steps=20, task_options=rec["task_options"],
                             model_options={**rec["model_options"], "content_rank": 0, "gate_logit_init": -2.0})
    outside = make_run_config("assoc_recall", "fade600", 0, steps=20, task_options=rec["task_options"],
                              model_options={**rec["model_options"], "content_rank": 1})
    assert calibration_key(member) in rec["keys"] and calibration_key(outside) not in rec["keys"]
    assert check_calibrated([member], tmp_path / "runs") == {member.run_id: rec["hash"]}
    assert math.isfinite(rec["measured"]["distance"])
    lr = rec["length_reading"]  # the length test read three ways over the set, the nearest chosen
    assert lr["members"] == 2 and set(lr["means"]) == {"clip", "no bias beyond", "pairs fill"}
    assert lr["chosen"] == min(lr["means"], key=lambda n: abs(lr["means"][n] - 0.263))
    _recorded_into_a_bundle_and_regenerated_from_it(tmp_path)


def _recorded_into_a_bundle_and_regenerated_from_it(tmp_path):
    """``calibrate --bundle``: the search recorded into a results bundle written from another store;
    from the bundle alone, with the store gone, its blocks and its RESULTS.md section come back byte
    for byte, and the bundle's manifest lists the space."""
    import shutil

    from softprior.bundle import BundleSource, BundleWriter
    from softprior.calibration.space import load_space
    from softprior.reports.calibration_doc import write_calibration
    from softprior.paper import search_sections
    w = BundleWriter(tmp_path / "results" / "bundle")  # a paper's bundle, of no experiment
    w.finish({"records": {}, "options": {"seeds": None, "quick": True, "tasks": None}, "experiments": [],
              "spaces": [], "exploratory": False, "docs": {}})
    (tmp_path / "cal.md").write_text("# calibration\n")
    r = subprocess.run([sys.executable, "-m", "softprior.cli", "calibrate", "assoc_recall", "--space",
                        str(tmp_path / "space.toml"), "--steps", "20", "--no-progress", "--store", str(tmp_path / "runs"),
                        "--doc", str(tmp_path / "cal.md"), "--bundle", str(tmp_path / "results")],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    src = BundleSource(tmp_path / "results")
    assert {"name": "tiny_identify"} in src.manifest["spaces"]
    out = tmp_path / "results" / "calibration" / "tiny_identify"
    section = (out / "identified.md").read_text()
    assert "Best identified configuration" in section and "| forced_const0.5 base normal | 0.164 ± 0.003 |" in section
    assert search_sections(tmp_path / "results", ["tiny_identify"])[0] == section.strip()
    assert search_sections(tmp_path / "results", []) == []  # a search not written with the report: not shown
    written = {p: p.read_text() for p in [tmp_path / "cal.md", out / "identified.md", out / "candidates.md"]}
    shutil.rmtree(tmp_path / "runs")
    for p in written:
        p.unlink()
    (tmp_path / "cal.md").write_text("# calibration\n")
    assert write_calibration(tmp_path / "cal.md", src, load_space(str(tmp_path / "space.toml")), out, steps=20)
    assert {p: p.read_text() for p in written} == written


def test_identify_and_space_together_are_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "softprior.cli", "calibrate", "assoc_recall", "--identify", "--space",
                        "tiny"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "--identify" in r.stderr


def test_length_variants_read_one_run_three_ways(tmp_path):
    from softprior.calibration.identify import length_variants
    from softprior.executors.sweep import execute
    from softprior.store import RunStore
    store = RunStore(tmp_path / "s")
    cfg = make_run_config("assoc_recall", "unforced", 0, steps=4, eval_every=2, n_val=64,
                          task_options={"keys": "replacement", "layout": "pool", "n_keys": 10, "n_pairs": 6})
    assert not execute([cfg], store, progress=False).failed
    got = length_variants(store, cfg)
    assert set(got) == {"clip", "no bias beyond", "pairs fill"}
    # 6 pairs at length 32 fill to min(6 x 120 // 32, 31 - 10 keys) = 21 pairs: ceiling (1 - .9^21) 10 / 21
    assert got["pairs fill"][1] == pytest.approx((1 - 0.9 ** 21) * 10 / 21)
    assert got["clip"][1] == got["no bias beyond"][1] == pytest.approx((1 - 0.9 ** 6) * 10 / 6)
    assert all(0.0 <= acc <= 1.0 for acc, _ in got.values())


def test_the_length_reading_is_the_one_whose_mean_over_the_set_is_nearest_the_paper(monkeypatch):
    from softprior.calibration import identify
    space = load_space("assoc_recall_identify")
    per = {1: {"clip": (0.78, 0.47), "no bias beyond": (0.30, 0.47), "pairs fill": (0.40, 0.42)},
           2: {"clip": (0.80, 0.47), "no bias beyond": (0.10, 0.47), "pairs fill": (0.44, 0.42)},
           3: None}  # nothing stored: not counted
    monkeypatch.setattr(identify, "length_means", lambda space, store, c, seeds=3, steps=None: per[c])
    got = identify.length_reading(space, None, [1, 2, 3])
    # means .79, .20, .42: |.20 - .263| = .063 is the least
    assert got["means"] == {"clip": 0.79, "no bias beyond": 0.2, "pairs fill": 0.42}
    assert got["chosen"] == "no bias beyond" and got["members"] == 2 and got["paper"] == 0.263
    per[2] = {"clip": (0.80, 0.47), "no bias beyond": (0.02, 0.47), "pairs fill": (0.20, 0.42)}  # means .16, .30
    assert identify.length_reading(space, None, [1, 2])["chosen"] == "pairs fill"
    assert identify.length_reading(space.model_copy(update={"task": "markov"}), None, [1]) == {}


def test_rows_that_no_candidate_matches_together_are_named_as_a_conflict():
    from softprior.calibration.identify import conflicts, identification_block
    space = load_space("assoc_recall_identify")
    learns = _cand(space, 1, {"forced_const0.5 base normal": 0.78}, True, 1.0)  # the constant gate learns too
    blocked = _cand(space, 2, {"unforced base normal": 0.16}, True, 1.0)  # the learned gate is blocked too
    got = {(a, b): (na, nb, both) for a, b, na, nb, both in conflicts(space, [learns, blocked])}
    assert got[("unforced base normal", "forced_const0.5 base normal")] == (1, 1, 0)
    assert got[("unforced base zero", "forced_zero base zero")] == (2, 2, 2)
    block = identification_block(space, [learns, blocked])
    assert "- unforced base normal (1 candidates) and forced_const0.5 base normal (1)" in block


def test_an_identification_candidate_goes_on_to_all_seeds_when_its_hard_constraints_hold():
    from softprior.calibration.search import promote
    space = load_space("assoc_recall_identify")
    crit = space.criteria()
    far = {c.name: (c.target + 10 * c.scale if c.scale else None) for c in crit}  # every row far off
    res = [c.check([far[c.name]]) if c.scale else c.check([0.78 if "normal" in c.name else 0.1]) for c in crit]
    assert all(r.ok for c, r in zip(crit, res) if c.scale is None) and not any(r.ok for c, r in zip(crit, res) if c.scale)
    assert promote(space, crit, res, {})  # the rows may conflict: only the constraints decide
    broken = [c.check([0.5]) if c.scale is None and "unforced normal" in c.name else r for c, r in zip(crit, res)]
    assert not promote(space, crit, broken, {})


def test_robustness_trains_the_fades_other_starts_and_shapes_on_the_wide_best_only(monkeypatch, tmp_path):
    import softprior.executors.sweep
    from softprior.calibration import robustness as R
    space = load_space("assoc_recall_identify")
    cands = [_cand(space, i, {}, True, float(i)) for i in range(4)]
    monkeypatch.setattr(R, "store_records", lambda root: [{"space_digest": space.digest}])
    monkeypatch.setattr(R, "mapped", lambda space, cands: cands)
    trained = []
    monkeypatch.setattr(softprior.executors.sweep, "execute", lambda cfgs, store, **kw: trained.append(len(cfgs)))
    store = type("Store", (), {"root": tmp_path})()
    for wide in (0, 1, 3):
        R.run_robustness(space, store, cands, wide=wide, all_fade=False)
    base = len(R.prediction_rows("assoc_recall", True)) * space.seeds
    more = len(R.prediction_rows("assoc_recall", True, wide=True)) * space.seeds
    assert more > base and trained == [4 * base, 3 * base + more, base + 3 * more]


# the same tiny space as an effect search (never a calibration)
_EFFECT = _SPACE.replace('name = "tiny_identify"', 'name = "tiny_effect"').replace("identify = true", "effect = true")


def test_an_effect_search_measures_the_trajectory_effect_in_its_own_store_and_shows_its_largest(tmp_path):
    """The exploratory effect search (no record: its trajectory rows are trained anyway, and never enter a
    verdict table): per candidate fade600, forced_zero and hard_switch600 at the zero gate, the effect
    their means give, and its section for RESULTS.md."""
    from softprior.calibration.space import load_space
    from softprior.calibration.criteria import trajectory_effect
    from softprior.reports.calibration_doc import effect_section
    from softprior.calibration.search import load_candidates
    from softprior.store import RunStore
    (tmp_path / "space.toml").write_text(_EFFECT)
    r = _cli(tmp_path, "--budget", "2", "--doc", str(tmp_path / "doc.md"))
    assert r.returncode == 0, r.stderr
    space = load_space(str(tmp_path / "space.toml"))
    cands = load_candidates(space, RunStore(tmp_path / "runs"))
    assert len(cands) == 2 and all(f"{p}|zero" in c.means for c in cands for p in ("fade600", "forced_zero",
                                                                                      "hard_switch600"))
    effects = sorted((trajectory_effect(c.means) for c in cands), reverse=True)
    section = (tmp_path / "out" / "effect.md").read_text()
    assert section == effect_section(space, cands).rstrip() + "\n" and "exploratory" in section
    assert f"| {effects[0]:+.3f} |" in section.split("| candidate |")[1].splitlines()[2]
    assert not list((tmp_path / "runs").glob("calibration/*.json"))  # nothing registered
    doc = (tmp_path / "doc.md").read_text()  # its candidates, and no claim's verdict read from its runs
    assert "<!-- table:calibration-tiny_effect -->" in doc and "robustness-tiny_effect" not in doc


def test_completion_measures_on_five_seeds_only_candidates_whose_hard_constraints_hold_so_far(monkeypatch, tmp_path):
    """A candidate already broken on one seed cannot hold on five: completion never measures it (the
    search's non-learners match many rows and would rank first among the broken). One that breaks on a
    further seed drops out and nothing else is left: completion stops."""
    import softprior.executors.sweep
    from softprior.calibration import identify, search
    space = load_space("assoc_recall_identify")
    good = [_cand(space, i, {}, True, float(i)) for i in range(3)]
    broken = [_cand(space, 10 + i, {"unforced base normal": 0.2}, False, 0.0) for i in range(3)]  # never learns
    for c in good + broken:
        c.n_seeds = 1
    measured = []

    def keep(space, store, f, todo, seeds, steps):
        for c in todo:
            c.n_seeds = len(seeds)
            measured.append(c.cid)
            if c is good[0]:  # a rare failure on a further seed
                c.checks = {n: False for n in c.checks}
    monkeypatch.setattr(softprior.executors.sweep, "execute", lambda cfgs, store, **kw: None)
    monkeypatch.setattr(search, "keep_measurements", keep)
    monkeypatch.setattr(identify, "with_completed", lambda space, store, cands: cands)
    monkeypatch.setattr(identify, "completed_file", lambda space, store: tmp_path / "completed.json")
    identify.complete(space, None, good + broken, k=3, log=lambda m: None)
    assert sorted(measured) == sorted(c.cid for c in good)
    assert [c.cid for c in identify.identified_at(space, good + broken, k=3)] == [good[1].cid, good[2].cid, good[0].cid]
    # fewer than k can hold: the least broken fill the set (held on its one seed, though broken on another
    # constraint's aggregate, before those broken on every seed)
    near = _cand(space, 20, {}, False, 9.0)  # its one seed within every per-seed bound
    near.n_seeds = 1
    assert identify.seeds_held(space, near) == 1.0 and identify.seeds_held(space, broken[0]) == 0.0
    measured.clear()
    identify.complete(space, None, good + broken + [near], k=5, log=lambda m: None)
    assert measured[0] == near.cid and len(measured) == 2 and measured[1] in {c.cid for c in broken}


def test_an_identified_sets_tables_hold_every_claim_it_maps_the_constant_gate_and_the_fade_window_too():
    """The map of an identified set decides every claim whose cells are base rows (``map_claims``), not only
    the difficulty search's: their cells must be filled from the candidate's values, else they read as
    not measured."""
    from softprior.calibration.robustness import candidate_tables, claim_rows
    space = load_space("assoc_recall_identify")
    c = _cand(space, 1, {}, True, 1.0)
    vals = {f"{r.key}|{g}": [0.1, 0.2, 0.3] for r in claim_rows("assoc_recall", True, wide=True) for g in ("normal", "zero")}
    t = candidate_tables(space, c, vals)
    assert t["paths"][("forced_const0.5", "base normal")] == pytest.approx(0.2)
    assert t["fade_window"][("fade400", "zero", "n")] == 3.0


def test_a_set_searched_but_not_registered_is_titled_so_and_shows_no_trajectory_rows(monkeypatch):
    """``results_section`` of an identification search whose set was never measured on five seeds (a
    further search beside the registered one): its own title, the rows, no trajectory section."""
    from softprior.calibration import identify
    space = load_space("assoc_recall_identify")
    cand = SimpleNamespace(cid="abc123", label="a candidate", status="fails")
    monkeypatch.setattr(identify, "identified_set", lambda sp, cands: [cand])
    monkeypatch.setattr(identify, "member_table", lambda sp, c: "| row | table |")
    monkeypatch.setattr(identify, "length_means", lambda *a, **k: {})
    for five in (False, True):
        monkeypatch.setattr(identify, "identified_at", lambda sp, cands, five=five: [cand] if five else [])
        text = identify.results_section(space, None, [cand], "ROBUSTNESS", "SENSITIVITY")
        if five:
            assert text.startswith("## The identified model") and "ROBUSTNESS" in text and "SENSITIVITY" in text
        else:
            assert text.startswith("## A further identification search, `assoc_recall_identify` (not registered)")
            assert "ROBUSTNESS" not in text and "### The trajectory claims" not in text and "| row | table |" in text



def test_a_task_without_the_papers_length_test_has_no_length_reading():
    """The length test (soft_bias at T = 120) is associative recall's row: a Markov record reads none,
    and nothing is loaded for it (no store is needed)."""
    from softprior.calibration.identify import length_reading
    assert length_reading(load_space("markov_identify"), None, [object()]) == {}
