"""Figures that show the seeds (issue 30, item 3): a point per seed over every bar, the statistic and
n in the legend, a chance line, titles that fit, one seed as a point without a whisker, a smoke-run
mark on --quick output, and curves that say what "normal" means for each path."""

from __future__ import annotations

import pandas as pd
import pytest

import softprior.experiments as experiments
from softprior.executors import execute
from softprior.experiments import Cell, Experiment
from softprior.report import aggregate, describe, markdown_table, plot_bars, write_report
from softprior.store import RunStore

from conftest import tiny_config

LONG_TITLE = ("paths: Table 1: five training paths on associative recall, base and large, with a description "
              "long enough to run off the figure")


@pytest.fixture
def figures(monkeypatch):
    """Every figure saved while the test runs, kept open for inspection."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    saved = []
    orig = Figure.savefig

    def keep(self, *a, **kw):
        out = orig(self, *a, **kw)
        self.renderer = self.canvas.get_renderer()  # (before the figure is closed)
        saved.append(self)
        return out
    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _long(counts: dict[str, int]) -> pd.DataFrame:
    rows = [{"row": r, "col": "", "eval": e, "seed": s, "metric": "acc", "value": 0.1 + 0.2 * s + (e == "normal") * 0.05,
             "run_id": f"{r}{s}"} for r, n in counts.items() for e in ("zero", "normal") for s in range(n)]
    return pd.DataFrame(rows)


def _inside(fig, artist) -> bool:
    box = artist.get_window_extent(fig.renderer)
    return box.x0 >= 0 and box.x1 <= fig.bbox.width


def test_bars_show_every_seed_the_statistic_and_the_chance_line(tmp_path, figures):
    long = _long({"fade600": 5, "unforced": 3})
    agg = aggregate(long)
    plot_bars(agg, LONG_TITLE, tmp_path / "f.png", long=long, chance={k: 0.1 for k in zip(agg["row"], agg["column"])})
    (fig,) = figures
    ax = fig.axes[0]
    points = sorted(float(y) for coll in ax.collections if type(coll).__name__ == "PathCollection"
                    for _, y in coll.get_offsets())
    assert points == sorted(long["value"].tolist())  # every seed, over its bar
    legend = ax.get_legend()
    words = " ".join([legend.get_title().get_text()] + [t.get_text() for t in legend.get_texts()])
    assert "mean ± SD" in words and "3-5 seeds" in words and "one seed" in words and "chance (0.1)" in words
    assert any(list(line.get_ydata()) == [0.1, 0.1] for line in ax.get_lines())  # the chance line
    assert _inside(fig, ax.title) and "\n" in ax.title.get_text()  # wrapped, not cut
    assert {t.get_text() for t in ax.texts} == {"n=5", "n=3"}  # unequal seed counts: each bar says its own


def test_one_seed_is_a_point_without_a_whisker(tmp_path, figures):
    long = _long({"fade600": 3, "forced_zero": 1})
    agg = aggregate(long)
    plot_bars(agg, "title", tmp_path / "f.png", long=long)
    ax = figures[0].axes[0]
    assert len(ax.patches) == 2  # bars for the two 3-seed cells only
    whiskers = [seg for c in ax.collections if type(c).__name__ == "LineCollection" for seg in c.get_segments()]
    assert len(whiskers) == 2  # and whiskers for them only
    md = markdown_table(aggregate(_long({"a": 1, "b": 1})))
    assert "±" not in md.split("\n\n")[0]  # no '± 0.000' for one seed
    assert "0.100" in md


def test_describe_replaces_a_seed_count_that_does_not_hold():
    exp = Experiment("paths", "Table 1: five paths (fade 5 seeds, others 3)", lambda o: [])
    assert describe(exp, aggregate(_long({"fade600": 5, "unforced": 3}))) == exp.description
    assert describe(exp, aggregate(_long({"fade600": 1, "unforced": 1}))) == "Table 1: five paths (1 seed per cell)"
    exp = Experiment("x", "the baselines (mean ± std over seeds)", lambda o: [])
    assert describe(exp, aggregate(_long({"a": 1}))) == exp.description  # no count claimed


def test_quick_output_is_marked_and_curves_say_what_normal_means(tmp_path, figures, monkeypatch):
    monkeypatch.setattr(experiments, "QUICK_STEPS", 20)  # these tiny runs stand in for a --quick sweep
    cells = [Cell(tiny_config(path=p), row=p) for p in ("unforced", "fade600", "forced_zero")]
    store = RunStore(tmp_path / "s")
    assert execute([c.cfg for c in cells], store, progress=False, require_calibration=False).ok
    exp = Experiment("demo", "three paths (fade 5 seeds, others 3)", lambda o: cells)
    md = write_report(store, exp, cells, tmp_path / "out")
    assert "(fade 5 seeds, others 3)" not in md and "three paths (1 seed per cell)" in md
    assert "Smoke run (--quick: 20 steps, 1 seed)" in md
    bars, curves = figures
    for fig in (bars, curves):
        texts = [t.get_text() for t in fig.texts] + [fig.axes[0].get_title(), fig._suptitle.get_text() if fig._suptitle else ""]
        assert "SMOKE RUN" in texts and any("smoke run (--quick: 20 steps, 1 seed)" in t for t in texts)
    labels = [t.get_text() for t in curves.legends[0].get_texts()]
    assert any("0.5 on fixed and scheduled paths" in t and "never trained" in t for t in labels)
    panels = {ax.get_title().split(" (n=")[0]: " ".join(t.get_text() for t in ax.texts) for ax in curves.axes
              if ax.get_title()}
    assert "untrained logit" in panels["fade600"] and "not the path's gate" in panels["forced_zero"]
    assert "learned" in panels["unforced"] and "untrained" not in panels["unforced"]
    # a full-budget run is not marked
    monkeypatch.setattr(experiments, "QUICK_STEPS", 180)
    assert "Smoke run" not in write_report(store, exp, cells, tmp_path / "out2")
