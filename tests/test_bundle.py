"""The results bundle (``softprior.bundle``): the documents regenerate from it, without the store, byte
for byte; a run trained from a dirty tree enters only a table marked exploratory; and the committed
documents equal what the committed bundle regenerates (skipped while docs/results holds no bundle)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from softprior import provenance
from softprior.cli import main

REPO = Path(__file__).resolve().parents[1]

# three experiments over the same three tiny runs (snapshots every 10 steps): a table with evaluations
# that need weights (a gate override, another length) and curves, the mechanism trace, the continuation trace
PLUGIN = """
from softprior.cells import Cell, Eval, NORMAL, ZERO
from softprior.config import make_run_config
from softprior.experiments import Experiment, register_experiment, _continuation_analysis, _mechanism_analysis

def cells(o):
    return [Cell(make_run_config('assoc_recall', path, seed, steps=20, eval_every=10, n_val=32, batch_size=8,
                                 calibrated=False, snapshot_every=10), row=path, evals=EVALS)
            for path, seed in (('fade40', 0), ('fade40', 1), ('forced_zero', 0))]

EVALS = (ZERO, NORMAL, Eval('g=0.25', (0.25, 0.25)), Eval('T=40', None, 40))
register_experiment(Experiment('bundle_table', 'bundle test: a table (2 seeds)', cells,
                               paper={('fade40', 'zero'): '.5'}), overwrite=True)
register_experiment(Experiment('bundle_mechanism', 'bundle test: mechanism trace', cells, curves=False,
                               analysis=_mechanism_analysis), overwrite=True)
register_experiment(Experiment('bundle_continuation', 'bundle test: continuation trace', cells, curves=False,
                               analysis=_continuation_analysis), overwrite=True)
"""
NAMES = ["bundle_table", "bundle_mechanism", "bundle_continuation"]
README = "# readme\n\nprose before\n\n<!-- table:verdicts -->\nold\n<!-- /table:verdicts -->\n\nprose after\n"
CALIBRATION = "# calibration\n\nfixed prose\n"
TEXT = (".md", ".csv", ".json")


def _code(monkeypatch, commit: str) -> None:
    """Runs trained from here on record ``commit`` as the checkout's (``provenance``; '+dirty' or not)."""
    static = dict(provenance._static())
    monkeypatch.setattr(provenance, "_static", lambda: {**static, "git_commit": commit})


def _paper(monkeypatch, tmp_path):
    """The plugin's experiments as the paper (its calibration: the tiny search space)."""
    from softprior import paper
    from softprior.plugins import load_plugin
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    load_plugin(str(plugin))
    monkeypatch.setattr(paper, "PAPER", list(NAMES))
    monkeypatch.setattr(paper, "OURS", [])
    monkeypatch.setattr(paper, "CALIBRATION_SPACES", ("tiny",))
    return plugin


def _train(store, plugin_names=NAMES):
    from softprior.executors.sweep import execute
    from softprior.experiments import Options, get_experiment
    cfgs = list({c.cfg.run_id: c.cfg for n in plugin_names for c in get_experiment(n).build(Options())}.values())
    assert not execute(cfgs, store, progress=False, require_calibration=False).failed
    return cfgs


def _docs(root: Path) -> None:
    """The documents' fixed prose, as in a checkout: the README and CALIBRATION.md around their blocks."""
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(README)
    (root / "CALIBRATION.md").write_text(CALIBRATION)
    (root / "results" / "NOTES.md").write_text("Notes: fixed prose between the verdicts and the tables.\n")


def _texts(results: Path) -> dict[str, str]:
    """Every generated text file under a results directory (the bundle and the fixed NOTES.md aside)."""
    return {p.relative_to(results).as_posix(): p.read_text() for p in sorted(results.rglob("*"))
            if p.is_file() and p.suffix in TEXT and "bundle" not in p.relative_to(results).parts
            and p.name != "NOTES.md"}


def _compare(committed: dict[str, str], regenerated: dict[str, str]) -> list[str]:
    """The files that differ, are missing or are extra: what `git diff --exit-code` would show."""
    return ([f"{k}: differs" for k in committed if k in regenerated and committed[k] != regenerated[k]]
            + [f"{k}: not regenerated" for k in committed if k not in regenerated]
            + [f"{k}: regenerated, not committed" for k in regenerated if k not in committed])


def _regenerate(results: Path, root: Path, into: Path, *extra: str) -> list[str]:
    """``report paper --from-bundle RESULTS`` into a copy of the checkout ``root``: the documents the
    manifest names copied with the generated blocks the bundle covers emptied (RESULTS.md, wholly
    generated, left out; a calibration space's blocks kept when the bundle does not carry that space,
    as the first round's searches in docs/CALIBRATION.md), NOTES.md beside the tables. Returns what
    `git diff --exit-code` would show between the regenerated files and ``root``'s (every document and
    every text file under the results)."""
    import re

    from softprior.bundle import BundleSource
    from softprior.paper import CALIBRATION_SPACES
    manifest = BundleSource(results).manifest
    absent = set(CALIBRATION_SPACES) - {s["name"] for s in manifest.get("spaces", [])}

    carried = {s["name"] for s in manifest.get("spaces", [])}

    def empty(m: re.Match) -> str:  # a space's blocks (of any kind) are kept when the bundle does not carry it
        kind, _, space = m.group(2).partition("-")
        space = space.removeprefix("record-")
        kept = (kind in ("calibration", "robustness") and space in absent) or (
            kind in ("identification", "length", "sensitivity", "robustness", "calibration") and space not in carried
            and space not in CALIBRATION_SPACES)
        return m.group(0) if kept else m.group(1) + "(emptied)" + m.group(3)
    out = into / results.relative_to(root)
    out.mkdir(parents=True)
    docs = [(results / v).resolve() for v in manifest["docs"].values() if v]
    for path in docs:
        dest = into / path.relative_to(root.resolve())
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.name != "RESULTS.md":
            dest.write_text(re.sub(r"(<!-- table:(\S+) -->\n).*?(\n<!-- /table:\2 -->)", empty, path.read_text(),
                                   flags=re.S))
    if (results / "NOTES.md").exists():
        shutil.copyfile(results / "NOTES.md", out / "NOTES.md")
    assert main(["report", "paper", "--from-bundle", str(results), "--out", str(out), *extra]) == 0
    diff = [f"{p.relative_to(root.resolve())}: differs" for p in docs
            if (into / p.relative_to(root.resolve())).read_text() != p.read_text()]
    committed = {k: v for k, v in _texts(results).items()  # an absent space's outputs stay as committed
                 if not any(k.startswith(f"calibration/{space}/") for space in absent)}
    return diff + _compare(committed, _texts(out))


def test_documents_regenerate_from_the_bundle_byte_for_byte_without_the_store(tmp_path, monkeypatch, capsys):
    """A tiny paper written from a store (tables with gate-override and length evaluations, curves,
    mechanism and continuation traces, RESULTS.md, the README table, CALIBRATION.md's blocks of a
    searched and registered space) writes the bundle; with the store deleted, ``report paper
    --from-bundle`` writes every text file again, byte for byte, and every figure (PNG bytes may
    differ: matplotlib's, not ours)."""
    from softprior.calibration.space import load_space
    from softprior.reports.calibration_doc import register
    from softprior.calibration.search import run_search
    from softprior.store import RunStore
    _code(monkeypatch, "0123456789ab")
    plugin = _paper(monkeypatch, tmp_path)
    store = RunStore(tmp_path / "store")
    _train(store)
    space = load_space("tiny")
    cands = run_search(space, store, budget=2, steps=8, progress=False)
    register(space, store, cands, steps=8)

    a = tmp_path / "a"
    _docs(a)
    args = ["report", "paper", "--store", str(store.root), "--out", str(a / "results"), "--doc", str(a / "RESULTS.md"),
            "--readme", str(a / "README.md"), "--calibration-doc", str(a / "CALIBRATION.md"), "--plugin", str(plugin),
            "--workers", "2"]  # the reports (and their recorders) in two worker processes
    assert main(args) == 0, capsys.readouterr().err
    bundle = a / "results" / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["experiments"] == NAMES and not manifest["exploratory"]
    assert manifest["docs"] == {"results": "../RESULTS.md", "readme": "../README.md", "calibration": "../CALIBRATION.md"}
    assert manifest["spaces"] == [{"name": "tiny"}]
    kinds = {a["kind"] for p in (bundle / "parts").glob("*.json") for a in json.loads(p.read_text())["answers"]}
    assert kinds == {"evaluation", "ceiling", "chance", "circuit", "calibration_candidates", "calibration_record"}
    assert {p.parent.name for p in (bundle / "frames").rglob("*.csv")} == {"mechanism_trace", "continuation_trace"}
    assert not list(bundle.rglob("*.safetensors")) and not list(bundle.rglob("*.sqlite3"))
    files = [f"docs/results/bundle/{p.relative_to(bundle).as_posix()}" for p in bundle.rglob("*") if p.is_file()]
    if shutil.which("git") and (REPO / ".git").exists():  # committed as docs/results/bundle: none of it ignored
        import subprocess
        ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=REPO, capture_output=True,
                                 text=True).stdout.split()
        assert ignored == [], f"the repository's .gitignore would leave these out of a commit: {ignored}"
    table = (a / "results" / "bundle_table" / "table.md").read_text()
    assert "g=0.25" in table and "T=40" in table and "Exploratory" not in table
    assert "Pre-registered assoc_recall calibration" in (a / "CALIBRATION.md").read_text()
    assert "<!-- table:robustness-tiny -->" in (a / "CALIBRATION.md").read_text()
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    print(f"bundle: {size} bytes, {sum(1 for p in bundle.rglob('*') if p.is_file())} files")

    # the bundle carries the store's time ledger: `report timings` gives the same figures from either
    def timings(*source):
        capsys.readouterr()
        assert main(["report", "timings", *source, "--json", "--all-versions", "--gemm-rate", "100"]) == 0
        return {k: v for k, v in json.loads(capsys.readouterr().out).items() if k not in ("store", "bundle")}
    from_store = timings("--store", str(store.root))
    assert from_store["jobs"] == len(store.ledger()) - from_store["sweeps"] > 0 and from_store["flop"] > 0
    assert timings("--from-bundle", str(a / "results")) == from_store

    shutil.rmtree(store.root)  # no store from here on
    b = tmp_path / "b"
    diff = _regenerate(a / "results", a, b, "--plugin", str(plugin))  # the CI check's own code
    assert diff == []
    for doc in ("RESULTS.md", "README.md", "CALIBRATION.md"):
        assert (b / doc).read_text() == (a / doc).read_text(), doc
    assert {"bundle_table/table.md", "bundle_table/table.csv", "bundle_mechanism/trace_seed0.csv",
            "bundle_continuation/claims.csv", "calibration/tiny/candidates.md"} <= set(_texts(a / "results"))
    pngs = sorted(p.relative_to(a / "results") for p in (a / "results").rglob("*.png"))
    assert len(pngs) >= 5 and all((b / "results" / p).stat().st_size > 1000 for p in pngs)
    assert not (b / "results" / "bundle").exists()  # a bundle is read, not rewritten

    # one experiment from the bundle, and a question it holds no answer to
    assert main(["report", "bundle_table", "--from-bundle", str(a / "results"), "--out", str(tmp_path / "one"),
                 "--plugin", str(plugin)]) == 0
    assert (tmp_path / "one" / "table.md").read_text() == table
    capsys.readouterr()
    other = tmp_path / "other.py"  # an experiment whose runs the bundle was not written with
    other.write_text(PLUGIN.replace("('fade40', 1)", "('unforced', 1)").replace("'bundle_", "'other_"))
    assert main(["report", "other_table", "--from-bundle", str(a / "results"), "--out", str(tmp_path / "other"),
                 "--plugin", str(other)]) == 2
    err = capsys.readouterr().err
    assert "holds no run" in err and "reproduce paper" in err and len(err.strip().splitlines()) == 1

    # the records a bundle holds prove themselves: one edited after it was written is refused, by name
    (rec,) = (bundle / "records").glob("*.json")
    body = json.loads(rec.read_text())
    rec.write_text(json.dumps({**body, "note": body.get("note", "") + " (edited)"}))
    assert main(["report", "paper", "--from-bundle", str(a / "results"), "--out", str(tmp_path / "edited"),
                 "--plugin", str(plugin)]) == 2
    err = capsys.readouterr().err
    assert rec.name in err and "edited after it was written" in err and len(err.strip().splitlines()) == 1

    (bundle / "ledger.json").unlink()  # a bundle written before bundles carried the ledger
    assert main(["report", "timings", "--from-bundle", str(a / "results")]) == 2
    assert "holds no time ledger" in capsys.readouterr().err


# an experiment whose seed count follows the options (so more seeds can be asked of it)
PLUGIN_SEEDS = """
from softprior.cells import Cell
from softprior.config import make_run_config
from softprior.experiments import Experiment, register_experiment

def cells(o):
    return [Cell(make_run_config('assoc_recall', path, seed, steps=12, eval_every=6, n_val=32, batch_size=8,
                                 calibrated=False), row=path)
            for path in ('unforced', 'forced_zero') for seed in range(o.n_seeds(2))]

register_experiment(Experiment('seeds_table', 'more-seeds test', cells, curves=False), overwrite=True)
"""


def test_undecided_cells_get_more_seeds_and_the_bundle_rebuilds_them(tmp_path, monkeypatch, capsys):
    """``reproduce paper`` at the paper's seed counts: the cells ``paper.more_seeds`` names (forced here;
    the rule itself is tested by hand in test_paper.py), decided on the paper's seeds, are trained on
    seeds up to ``MAX_SEEDS``, and only those; their table counts every seed; the manifest records the
    list, so with the store deleted the bundle rebuilds the same cells and documents, without deciding
    again."""
    from softprior import paper
    from softprior.claims import Cond, PaperClaim
    from softprior.plugins import load_plugin
    from softprior.store import RunStore
    _code(monkeypatch, "0123456789ab")
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN_SEEDS)
    load_plugin(str(plugin))
    monkeypatch.setattr(paper, "PAPER", ["seeds_table"])
    monkeypatch.setattr(paper, "OURS", [])
    monkeypatch.setattr(paper, "CALIBRATION_SPACES", ())
    monkeypatch.setattr(paper, "MAX_SEEDS", 4)
    monkeypatch.setattr(paper, "CLAIMS", [PaperClaim("t", "a claim on the plugin's table", "-", (
        Cond("seeds_table", "forced_zero", "zero", "<=", 0.15),))])  # the tables the rule is given
    asked = []

    def more(tables):
        asked.append(tables["seeds_table"][("forced_zero", "zero", "n")])
        return (("seeds_table", "forced_zero", "zero"),)
    monkeypatch.setattr(paper, "more_seeds", more)
    a = tmp_path / "a"
    _docs(a)
    store = tmp_path / "store"
    assert main(["reproduce", "paper", "--store", str(store), "--out", str(a / "results"), "--doc",
                 str(a / "RESULTS.md"), "--readme", str(a / "README.md"), "--plugin", str(plugin),
                 "--no-progress"]) == 0, capsys.readouterr().err
    assert "1 cell(s) undecided at the paper's seed counts" in capsys.readouterr().err
    assert asked == [2.0]  # decided on the paper's two seeds
    rows = RunStore(store).rows()
    assert sorted((r["path"], r["seed"]) for r in rows) == [("forced_zero", s) for s in range(4)] + \
        [("unforced", 0), ("unforced", 1)]
    table = (a / "results" / "seeds_table" / "table.csv").read_text()
    assert [line.split(",")[5] for line in table.splitlines()[1:]] == ["2", "2", "4", "4"]  # n per cell
    manifest = json.loads((a / "results" / "bundle" / "manifest.json").read_text())
    assert manifest["options"]["extend"] == [["seeds_table", "forced_zero", "zero"]]
    assert manifest["options"]["extend_seeds"] == 4

    monkeypatch.setattr(paper, "more_seeds", lambda tables: pytest.fail("--seeds and --quick choose their own"))
    for flags in (["--seeds", "2"], ["--quick"]):
        assert main(["report", "paper", "--store", str(store), "--out", str(tmp_path / flags[-1]), "--plugin",
                     str(plugin)] + flags) == 0
    shutil.rmtree(store)
    monkeypatch.setattr(paper, "more_seeds", lambda tables: pytest.fail("a bundle does not decide again"))
    diff = _regenerate(a / "results", a, tmp_path / "b", "--plugin", str(plugin))
    assert diff == []


def test_a_dirty_run_enters_only_a_table_marked_exploratory(tmp_path, monkeypatch, capsys):
    """A run whose summary's code version ends in '+dirty' is refused by every table (one line naming
    it, exit 2, nothing written) unless --exploratory, which marks the table and the bundle; the bundle
    then regenerates the marked table; a sweep in a dirty checkout (the paper's, or one experiment's)
    refuses before training."""
    from softprior.experiments import Options, get_experiment
    from softprior.reports.experiment import DirtyRunsRefused, write_report
    from softprior.store import RunStore
    _code(monkeypatch, "0123456789ab+dirty")
    plugin = _paper(monkeypatch, tmp_path)
    monkeypatch.setattr("softprior.paper.PAPER", ["bundle_table"])
    store = RunStore(tmp_path / "store")
    cfgs = _train(store, ["bundle_table"])
    exp = get_experiment("bundle_table")
    cells = exp.build(Options())
    with pytest.raises(DirtyRunsRefused, match=cfgs[0].run_id):
        write_report(store, exp, cells, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "docs" / "results"
    base = ["report", "paper", "--store", str(store.root), "--out", str(out), "--plugin", str(plugin)]
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dirty tree" in err and "--exploratory" in err
    assert all(c.run_id in err for c in cfgs) and "0.1.0@0123456789ab+dirty" in err
    assert not out.exists()

    assert main(base + ["--exploratory"]) == 0
    md = (out / "bundle_table" / "table.md").read_text()
    assert md.startswith("### bundle_table\n\n**Exploratory table**: 3 of its runs were trained from a dirty tree")
    assert all(c.run_id in md for c in cfgs) and "**Exploratory table**" in (out / "RESULTS.md").read_text()
    assert json.loads((out / "bundle" / "manifest.json").read_text())["exploratory"] is True
    first = (out / "RESULTS.md").read_text()
    shutil.rmtree(store.root)
    (out / "RESULTS.md").unlink()
    assert main(["report", "paper", "--from-bundle", str(out), "--plugin", str(plugin)]) == 0  # marked, as written
    assert (out / "RESULTS.md").read_text() == first

    # a paper's sweep from a dirty checkout: refused before anything trains
    capsys.readouterr()
    assert main(["reproduce", "paper", "--store", str(tmp_path / "fresh"), "--out", str(tmp_path / "x"),
                 "--plugin", str(plugin), "--no-progress"]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert not (tmp_path / "fresh" / "runs").exists() or not any((tmp_path / "fresh" / "runs").iterdir())
    # and so is one experiment's (its table would be refused only after the training)
    assert main(["reproduce", "bundle_table", "--store", str(tmp_path / "fresh1"), "--out", str(tmp_path / "y"),
                 "--plugin", str(plugin), "--no-progress"]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert not (tmp_path / "fresh1" / "runs").exists() or not any((tmp_path / "fresh1" / "runs").iterdir())


def test_committed_documents_equal_what_the_committed_bundle_regenerates(tmp_path):
    """CI's check that docs/ regenerate from the repository: ``softprior report paper --from-bundle
    docs/results`` into a copy of the documents' fixed prose equals the committed RESULTS.md,
    CALIBRATION.md, README.md and every table under docs/results (a `git diff --exit-code`), with no
    store (its time is a figure for the notes, not asserted here)."""
    results = REPO / "docs" / "results"
    if not (results / "bundle" / "manifest.json").is_file():
        pytest.skip("docs/results holds no results bundle yet (docs/results/bundle/manifest.json): the next "
                    "full `softprior reproduce paper --out docs/results ...` writes it")
    diff = _regenerate(results, REPO, tmp_path / "clone")
    assert diff == [], "the committed documents are not what the committed bundle regenerates:\n" + "\n".join(diff)
