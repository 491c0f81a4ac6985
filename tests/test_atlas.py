"""``softprior atlas`` (src/softprior/study.py: ``run_atlas``; reports/atlas.py; cli/atlas.py): a tiny atlas
(two priors, one task, a few steps) end to end, its resume, and ATLAS.md rewritten from its files alone."""

import json
import shutil
from pathlib import Path

import pytest

from softprior.cli import main

ROOT = Path(__file__).resolve().parents[1]
PRIORS, TASKS = ["soft", "alibi"], ["assoc_recall"]
TINY = ["--quick", "--steps", "4", "--seeds", "1", "--budget", "1"]


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    """The tiny atlas, trained once for the module (the library's path, with a small mechanism trace)."""
    from softprior.reports.atlas import atlas_dir, note_atlas, write_atlas
    from softprior.store import RunStore
    from softprior.study import atlas_plans, run_atlas, study_claims
    tmp = tmp_path_factory.mktemp("atlas")
    store, doc = RunStore(tmp / "runs"), tmp / "docs" / "ATLAS.md"
    plans = atlas_plans(PRIORS, TASKS, quick=True, steps=4, seeds=1, budget=1, out=str(tmp / "atlas"), group_size=8,
                        trace_examples=32)
    note_atlas(doc, PRIORS, TASKS, [c.name for c in study_claims("acc", 0.0, 1.0)],
               {"steps": 4, "seeds": 1, "budget": 1, "quick": True, "command": "softprior atlas " + " ".join(TINY)})
    logs = []
    run_atlas(plans, store, atlas_dir(doc) / "cells", on_cell=lambda: write_atlas(doc), log=logs.append)
    return tmp, store, doc, plans, logs


def plan_context(plan) -> int:
    """The context length of the cell's task at its record's options (what its validation batch reads)."""
    from softprior.config import make_run_config
    return make_run_config(plan.task, "unforced", 0, model_options={"prior_family": plan.prior}).model.n_ctx


def _cli(tmp, *extra):
    return main(["atlas", "--priors", ",".join(PRIORS), "--tasks", ",".join(TASKS), *TINY, "--store", str(tmp / "runs"),
                 "--out", str(tmp / "atlas"), "--doc", str(tmp / "docs" / "ATLAS.md"), "--group", "8", *extra])


def test_a_tiny_atlas_runs_every_cell_and_writes_the_document(atlas):
    tmp, store, doc, plans, logs = atlas
    assert [m for m in logs if m.startswith("cell ") and m.endswith("...")] == [
        "cell 1/2: soft x assoc_recall (4 steps, 1 seed(s), budget 1) ...",
        "cell 2/2: alibi x assoc_recall (4 steps, 1 seed(s), budget 1) ..."]
    records = {r["hash"] for r in store.calibration_records()}
    for plan in plans:
        v = json.loads((plan.dir / "verdicts.json").read_text())
        assert (plan.dir / "REPORT.md").exists() and v["record"] in records and v["prior"] == plan.prior
        assert len(v["claims"]) == 8 and v["registered_at"] and v["preregistered_at"]
        assert v["first_prediction_row_at"] >= v["preregistered_at"]  # the claims were written before any path trained
        cell = json.loads((doc.parent / "atlas" / "cells" / f"assoc_recall-{plan.prior}.json").read_text())
        assert cell == v
        # the traits: the fade's window scaled to the 4 steps, one unforced model per seed profiled
        tr = v["traits"]
        assert v["format"] == 2 and 0 <= tr["fade_window"][0] < tr["fade_window"][1] <= 4
        (one,) = tr["seeds"]
        T = plan_context(plan)
        assert one["seed"] == 0 and one["uniform"] == pytest.approx(sum(2 / (i + 1) for i in range(1, T)) / (T - 1), abs=1e-6)
        assert 0 <= one["locality"] <= 1 and one["strength"] >= 0
    text = doc.read_text()
    assert "2 of 2 cell(s) run" in text and "| soft | assoc_recall |" in text and "| alibi | assoc_recall |" in text
    assert "| prior | task | ceiling | record | fade zero-gate | prior helps | unforced relies | fade keeps |" in text
    assert (doc.parent / "atlas" / "atlas.png").stat().st_size > 0
    assert "## What distinguishes the cells" in text and "| locality (no prior) | strength |" in text


def test_a_cell_an_older_version_wrote_is_rewritten_without_training(atlas, capsys):
    tmp, store, doc, plans, _ = atlas
    plan = plans[0]
    old = json.loads((plan.dir / "verdicts.json").read_text())
    legacy = {k: v for k, v in old.items() if k not in ("format", "traits", "candidate_label")}
    for f in (plan.dir / "verdicts.json", doc.parent / "atlas" / "cells" / f"assoc_recall-{plan.prior}.json"):
        f.write_text(json.dumps(legacy))
    before = len(store.rows())
    capsys.readouterr()
    assert _cli(tmp) == 0
    out = capsys.readouterr().out
    assert "cell 1/2: soft x assoc_recall: finished before; its verdicts rewritten" in out
    assert "cell 2/2: alibi x assoc_recall: finished before (" in out and len(store.rows()) == before
    cell = json.loads((doc.parent / "atlas" / "cells" / f"assoc_recall-{plan.prior}.json").read_text())
    assert cell["traits"] == old["traits"] and cell["claims"] == old["claims"]
    # read against a store that does not hold its record, an older cell is kept as it is: nothing trains
    for f in (plan.dir / "verdicts.json", doc.parent / "atlas" / "cells" / f"assoc_recall-{plan.prior}.json"):
        f.write_text(json.dumps(legacy))
    capsys.readouterr()
    assert _cli(tmp, "--store", str(tmp / "other-runs")) == 0
    out = capsys.readouterr().out
    assert "cell 1/2: soft x assoc_recall: finished before (" in out and "rewritten" not in out
    assert "traits" not in json.loads((plan.dir / "verdicts.json").read_text())
    assert not (tmp / "other-runs" / "runs").exists() or not any((tmp / "other-runs" / "runs").iterdir())
    assert _cli(tmp) == 0  # and rewritten again where its store is
    assert json.loads((plan.dir / "verdicts.json").read_text())["traits"] == old["traits"]


def test_running_it_again_trains_nothing(atlas, capsys):
    tmp, store, doc, plans, _ = atlas
    before = len(store.rows())
    capsys.readouterr()
    assert _cli(tmp) == 0
    out = capsys.readouterr().out
    assert "cell 1/2: soft x assoc_recall: finished before" in out and "cell 2/2: alibi x assoc_recall: finished before" in out
    assert "not rerun" in out and len(store.rows()) == before


def test_the_document_regenerates_from_its_files_alone(atlas, tmp_path):
    tmp, _, doc, _, _ = atlas
    _cli(tmp)  # the document as the command writes it
    copy = tmp_path / "docs"
    shutil.copytree(doc.parent, copy)
    (copy / "ATLAS.md").unlink()
    (copy / "atlas" / "atlas.png").unlink()
    assert main(["atlas", "--report-only", "--doc", str(copy / "ATLAS.md"), "--store", str(tmp_path / "no-store")]) == 0
    assert not (tmp_path / "no-store").exists()
    assert (copy / "ATLAS.md").read_text() == doc.read_text()
    assert (copy / "atlas" / "atlas.png").read_bytes() == (doc.parent / "atlas" / "atlas.png").read_bytes()
    # the notes written by hand beside the cells enter the document
    (copy / "atlas" / "NOTES.md").write_text("No family keeps its circuit along the fade.\n")
    assert main(["atlas", "--report-only", "--doc", str(copy / "ATLAS.md")]) == 0
    assert "## Notes\n\nNo family keeps its circuit along the fade.\n" in (copy / "ATLAS.md").read_text()
    # a prior the atlas names but no cell of: "not run"
    settings = json.loads((copy / "atlas" / "atlas.json").read_text())
    (copy / "atlas" / "atlas.json").write_text(json.dumps({**settings, "priors": settings["priors"] + ["t5"]}))
    assert main(["atlas", "--report-only", "--doc", str(copy / "ATLAS.md")]) == 0
    text = (copy / "ATLAS.md").read_text()
    assert "2 of 3 cell(s) run" in text and "| t5 | assoc_recall | not run |" in text


def test_bad_names_are_refused_naming_the_allowed_ones(tmp_path, capsys):
    base = ["atlas", "--store", str(tmp_path / "runs"), "--doc", str(tmp_path / "ATLAS.md")]
    assert main(base + ["--priors", "soft,nope"]) == 2
    assert main(base + ["--tasks", "markov,sorting"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "unknown prior 'nope'" in err[0] and "allowed: soft, alibi, t5" in err[0]
    assert "unknown task 'sorting'" in err[1] and "allowed: assoc_recall, markov" in err[1]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ATLAS.md").exists()


def test_the_committed_atlas_regenerates_from_its_files(tmp_path):
    """docs/ATLAS.md, as committed, is what `softprior atlas --report-only` writes from docs/atlas/ alone."""
    doc = ROOT / "docs" / "ATLAS.md"
    if not doc.is_file():
        pytest.skip("no atlas committed")
    copy = tmp_path / "docs"
    shutil.copytree(ROOT / "docs" / "atlas", copy / "atlas")
    (copy / "atlas" / "atlas.png").unlink(missing_ok=True)
    assert main(["atlas", "--report-only", "--doc", str(copy / "ATLAS.md")]) == 0
    assert (copy / "ATLAS.md").read_text() == doc.read_text()
    assert (copy / "atlas" / "atlas.png").stat().st_size > 0
