"""Figures that show the seeds (issue 30, item 3): a point per seed over every bar, the statistic and
n in the legend, a chance line, titles that fit, one seed as a point without a whisker, a smoke-run
mark on --quick output, and curves that say what "normal" means for each path."""

from __future__ import annotations

import pandas as pd
import pytest

import softprior.experiments as experiments
from softprior.executors.sweep import execute
from softprior.cells import Cell
from softprior.experiments import Experiment
from softprior.reports.experiment import aggregate, copy_floor, describe, markdown_table, plot_bars, write_report
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
    assert "mean ± SD" in words and "3-5 seeds" in words and "one seed" in words and "chance = 0.100" in words
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
    assert any("sigmoid(initial logit) on fixed and scheduled" in t and "never trained" in t and "0.5 by default" in t
               for t in labels)
    panels = {ax.get_title().split(" (n=")[0]: " ".join(t.get_text() for t in ax.texts) for ax in curves.axes
              if ax.get_title()}
    assert "untrained logit" in panels["fade600"] and "not the path's gate" in panels["forced_zero"]
    assert "learned" in panels["unforced"] and "untrained" not in panels["unforced"]
    # a full-budget run is not marked
    monkeypatch.setattr(experiments, "QUICK_STEPS", 180)
    assert "Smoke run" not in write_report(store, exp, cells, tmp_path / "out2")


def test_the_floor_is_copying_any_context_token():
    """``copy_floor`` against the floor worked out by hand. Distinct keys, 10 pairs (the config
    defaults): 20 distinct tokens in every context, the answer among them: exactly 1/20. The registered
    task (one pool, 6 pairs, keys drawn with replacement from 10): 6 values + D distinct keys, D the
    occupancy count of 6 draws from 10, so E[1/(6 + D)] with P(D = k) = C(10, k) S(6, k) k! / 10^6
    (S: Stirling numbers of the second kind)."""
    import math

    from softprior.tasks.registry import task_config
    assert copy_floor(task_config("assoc_recall"), 32) == pytest.approx(1 / 20, abs=1e-12)

    def stirling2(n, k):
        return sum((-1) ** j * math.comb(k, j) * (k - j) ** n for j in range(k + 1)) // math.factorial(k)
    exact = sum(math.comb(10, k) * stirling2(6, k) * math.factorial(k) / 10 ** 6 / (6 + k) for k in range(1, 7))
    registered = task_config("assoc_recall", n_pairs=6, n_keys=10, layout="pool", placement="spread",
                             keys="replacement")
    assert copy_floor(registered, 32) == pytest.approx(exact, abs=0.002)  # Monte Carlo: 20,000 sequences
    assert 0.09 < exact < 1 / 6  # below chance (copying a random value, 1/6): the .09 models sit here
    assert math.isnan(copy_floor(task_config("linear_icl"), 32))


def test_bars_define_chance_draw_the_floor_and_the_papers_values(tmp_path, figures):
    """The bar figure says what chance is (copying a random value, 1/n_pairs), draws the floor below it
    and puts the paper's value beside each bar that has one."""
    cells = [Cell(tiny_config(path=p), row=p) for p in ("unforced", "forced_zero")]
    store = RunStore(tmp_path / "s")
    assert execute([c.cfg for c in cells], store, progress=False, require_calibration=False).ok
    exp = Experiment("demo", "two paths", lambda o: cells, paper={("unforced", "zero"): ".100±.006",
                                                                  ("forced_zero", "normal"): ".092±.006"})
    write_report(store, exp, cells, tmp_path / "out", exploratory=True)  # (this checkout may be dirty)
    ax = figures[0].axes[0]
    words = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "chance: copy a random value\nof the context (1/10) = 0.100" in words  # the defaults' 10 pairs
    assert "floor: copy any token" in words and "= 0.050" in words and "the paper's value" in words
    assert any(list(line.get_ydata()) == [0.05, 0.05] for line in ax.get_lines())  # the floor's line
    triangles = sorted(float(y) for c in ax.collections if type(c).__name__ == "PathCollection"
                       for _, y in c.get_offsets() if len(c.get_offsets()) == 1 and c.get_facecolor()[0][:3].sum() == 0)
    assert triangles == [0.092, 0.1]


def test_curves_keep_the_gate_on_a_panel_of_its_own(tmp_path, figures):
    """The gates are drawn in a panel below each path's accuracy, not on a second axis over it."""
    cells = [Cell(tiny_config(path=p), row=p) for p in ("unforced", "fade600")]
    store = RunStore(tmp_path / "s")
    assert execute([c.cfg for c in cells], store, progress=False, require_calibration=False).ok
    write_report(store, Experiment("demo", "two paths", lambda o: cells, curves=True), cells, tmp_path / "out",
                 exploratory=True)
    curves = figures[1]
    panels = [ax for ax in curves.axes if ax.get_title()]
    gates = [ax for ax in curves.axes if ax.get_ylabel() == "gate"]
    assert len(panels) == len(gates) == 2
    for acc, gate in zip(panels, gates):
        a, g = acc.get_position(), gate.get_position()
        assert g.y1 <= a.y0 and g.x0 == pytest.approx(a.x0)  # below it, in the same column, not over it
        assert acc.get_ylabel() == "acc" and "black" not in {line.get_color() for line in acc.get_lines()}
        assert "black" in {line.get_color() for line in gate.get_lines()}  # the path's gate, in its panel
