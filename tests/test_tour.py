"""The notebook tour (docs/tour.ipynb) runs in CI on a small budget, and its cells show what the prose
says they show (issue 30, item 8; issue 17): no cell errors and none is silent, the contrast table has
a row per path with every number in [0, 1] and its per-seed values agreeing with its means, the chance
level is the task's, the report's table and figures, the attention and trace figures are PNGs, the
TransformerLens export agrees with the model. The notebook is executed once (``executed``); each test
reads the outputs of the cell tagged for it (``tags=[...]`` in docs/tour.py)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("unforced", "forced_zero", "fade600")
STEPS, SEEDS = 24, 2
NUM = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
TAGS = ("setup", "train", "contrast-table", "report-figure", "curves", "gates", "attention", "transformer-lens",
        "trace", "dataframe")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The tour run as the README says, headless: `softprior tour` in a checkout's root (here a fresh
    directory standing for one), which keeps the executed notebook in results/tour/tour.ipynb and
    trains into the root's store ./runs. The tracked twins are read, never written."""
    import hashlib

    import nbformat

    from softprior.cli import main
    tmp = tmp_path_factory.mktemp("tour")
    twins = [ROOT / "docs" / "tour.py", ROOT / "docs" / "tour.ipynb"]
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in twins]
    env = {"SOFTPRIOR_TOUR_STEPS": str(STEPS), "SOFTPRIOR_TOUR_SEEDS": str(SEEDS), "SOFTPRIOR_TOUR_WORKERS": "1"}
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits this process's environment
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("SOFTPRIOR_TOUR_STORE", raising=False)
        mp.chdir(tmp)
        assert main(["tour", "--notebook", str(ROOT / "docs" / "tour.py")]) == 0
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in twins] == before  # the tracked files unchanged
    nb = nbformat.read(tmp / "results" / "tour" / "tour.ipynb", as_version=4)  # the outputs, kept
    nb.metadata["tmp"] = str(tmp)
    return nb


def _cell(nb, tag: str):
    cells = [c for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"one code cell tagged {tag!r} expected, found {len(cells)}"
    return cells[0]


def _stdout(nb, tag: str) -> str:
    return "".join(o.get("text", "") for o in _cell(nb, tag).outputs
                   if o.output_type == "stream" and o.name == "stdout")


def _data(nb, tag: str, mime: str) -> list:
    return [o["data"][mime] for o in _cell(nb, tag).outputs
            if o.output_type in ("display_data", "execute_result") and mime in o.get("data", {})]


def _pngs(nb, tag: str) -> list[bytes]:
    pngs = [base64.b64decode(d) for d in _data(nb, tag, "image/png")]
    assert pngs, f"cell {tag!r} shows no image/png"
    for png in pngs:
        assert png.startswith(b"\x89PNG") and len(png) > 2000, f"cell {tag!r}: not a figure"
    return pngs


def _numbers(line: str) -> list[float]:
    return [float(x) for x in NUM.findall(line)]


def test_no_cell_errors_or_is_silent(executed):
    """Every code cell shows something (printed text, a table, a figure): a warning on stderr alone
    does not count, so a cell that silently stops producing its output fails here."""
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert [t for c in code for t in c.metadata.get("tags", [])] == list(TAGS)
    for c in code:
        assert not [o for o in c.outputs if o.output_type == "error"], c.metadata["tags"]
        shown = [o for o in c.outputs if (o.output_type == "stream" and o.name == "stdout" and o.text.strip())
                 or o.output_type in ("display_data", "execute_result")]
        assert shown, f"cell {c.metadata['tags']} produced no output"


def test_setup_and_training(executed):
    tmp = Path(executed.metadata["tmp"])
    assert f"budget: {STEPS} steps x {SEEDS} seeds per path" in _stdout(executed, "setup")
    assert _stdout(executed, "setup").rstrip().endswith(f"store {tmp / 'runs'}")  # the root's ./runs
    assert (tmp / "runs").is_dir() and (tmp / "results" / "tour" / "figure.png").is_file()
    n = len(PATHS) * SEEDS + 1  # and the fade600 run that keeps snapshots
    assert f"{n} runs: 0 already done, {n} trained, 0 failed" in _stdout(executed, "train")


def test_contrast_table(executed):
    from softprior import make_run_config
    from softprior.tasks.generators import make_task
    lines = _stdout(executed, "contrast-table").splitlines()
    for p in PATHS:
        rows = [ln for ln in lines if ln.split() and ln.split()[0] == p]
        assert len(rows) == 1, f"no table row for {p}"
        nums = _numbers(rows[0].split(None, 1)[1])
        assert len(nums) == 4 + SEEDS, rows[0]  # zero mean ± SD, normal mean ± SD, every seed's zero value
        assert all(0.0 <= x <= 1.0 for x in nums), rows[0]
        assert abs(sum(nums[4:]) / SEEDS - nums[0]) < 1e-3, f"{p}: the seeds' values do not give the mean"
    chance = [ln for ln in lines if ln.startswith("chance:")]
    assert len(chance) == 1
    cfg = make_run_config("assoc_recall")
    assert abs(_numbers(chance[0])[0] - make_task(cfg.task).chance_at(cfg.model.n_ctx)) < 1e-3
    assert f"seeds per path: {SEEDS}" in chance[0]


def test_report_table_and_figures(executed):
    (md,) = _data(executed, "report-figure", "text/markdown")
    for p in PATHS:
        row = [ln for ln in md.splitlines() if ln.startswith(f"| {p} |")]
        assert len(row) == 1, f"the report's table has no row for {p}"
        ours = [float(x) for x in re.findall(r"\b\d\.\d{3}\b", row[0])]
        assert ours and all(0.0 <= x <= 1.0 for x in ours)
    _pngs(executed, "report-figure")
    _pngs(executed, "curves")
    _pngs(executed, "attention")
    _pngs(executed, "trace")


def test_gates_and_trace_printed(executed):
    gates = _stdout(executed, "gates").splitlines()
    for p in PATHS:
        for name in ("normal", "zero", "pos only off"):
            row = [ln for ln in gates if ln.startswith(p) and f" {name} " in ln]
            assert len(row) == 1 and 0.0 <= _numbers(row[0].rsplit("acc", 1)[1])[0] <= 1.0, (p, name)
    trace = _stdout(executed, "trace")
    steps = {int(s): float(a) for s, a in re.findall(r"(\d+): (-?\d+\.?\d*)", trace)}
    assert sorted(steps) == list(range(0, STEPS + 1, STEPS // 12))
    assert all(0.0 <= a <= 1.0 for a in steps.values())


def test_transformer_lens_agrees(executed):
    out = _stdout(executed, "transformer-lens")
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        assert "TransformerLens is not installed" in out
        return
    m = re.search(r"max \|TL - softprior\| logits: (\S+)", out)
    assert m and float(m.group(1)) < 1e-3, out


def test_dataframe_lists_every_run(executed):
    rows = [ln for ln in _stdout(executed, "dataframe").splitlines()[1:] if ln.strip()]
    assert len(rows) == len(PATHS) * SEEDS + 1


def test_tour_twins_agree():
    """tour.py (jupytext) and tour.ipynb hold the same code cells and tags."""
    import jupytext
    py = jupytext.read(ROOT / "docs" / "tour.py")
    nb = jupytext.read(ROOT / "docs" / "tour.ipynb")
    cells = lambda n: [(c.source, c.metadata.get("tags")) for c in n.cells if c.cell_type == "code"]  # noqa: E731
    assert cells(py) == cells(nb)


def test_tour_is_documented():
    """The README says how to install, open and run it; the extra it names exists."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tour"]
    assert {"jupytext", "jupyterlab"} <= {re.split(r"[<>=\[; ]", d)[0] for d in extra}
    readme = (ROOT / "README.md").read_text()
    for said in ('pip install -e ".[tour]"', "jupytext --to notebook docs/tour.py", "jupyter lab docs/tour.ipynb",
                 "softprior tour", "results/tour/tour.ipynb"):
        assert said in readme, said
    assert {"nbclient", "ipykernel"} <= {re.split(r"[<>=\[; ]", d)[0] for d in extra}  # what `softprior tour` runs on


def test_tour_reuses_the_main_jobs_runs():
    """At the paper's budget the tour's nine runs are the main job's (`reproduce removability`), so in the
    store ./runs they are not trained again."""
    import jupytext
    setup, train = (c.source for c in jupytext.read(ROOT / "docs" / "tour.py").cells
                    if c.cell_type == "code" and {"setup", "train"} & set(c.metadata.get("tags", [])))
    from softprior import get_path, make_run_config
    from softprior.experiments import Options, get_experiment
    tour_cell = {"STEPS": 3600, "make_run_config": make_run_config, "get_path": get_path}  # the setup cell's names
    exec(train.split("cells = [")[0], tour_cell)  # the tour's own `config`, at the paper's budget
    main_job = {c.cfg.run_id for c in get_experiment("removability").build(Options())}
    tour = {tour_cell["config"](p, seed).run_id for p in PATHS for seed in range(3)}
    assert tour == main_job
    assert 'ROOT / "runs"' in setup


def test_tour_text_matches_the_ceiling():
    """What the tour says unforced reaches is the registered task's Bayes ceiling, not 1."""
    import jupytext

    from softprior import make_run_config
    from softprior.tasks.generators import make_task
    text = " ".join(c.source for c in jupytext.read(ROOT / "docs" / "tour.py").cells if c.cell_type == "markdown")
    text = " ".join(text.replace("#", " ").split())
    ceiling = make_task(make_run_config("assoc_recall").task).bayes_accuracy()[0]
    assert f"normal accuracy near the task's Bayes ceiling, .{round(ceiling * 1000)}" in text
    assert "near 1" not in text
