"""Tables and figures from the run store (``softprior report`` and the end of ``reproduce``).

Nothing here trains: "normal"/"zero" numbers come from each run's stored summary; other evaluations
(gate overrides, other lengths) are computed from the stored weights on the run's validation seed.
Every function reads a *source*: a run store, or a results bundle that answers the same questions
from files (``softprior.bundle``: the evaluations that need weights are asked through ``bundle.ask``,
so a bundle answers them with the values recorded when the report was written from the store).
A run trained from a dirty tree (its summary's code version ends in ``+dirty``) enters only a table
marked exploratory (``write_report(exploratory=True)``); otherwise ``DirtyRunsRefused`` names it.
Outputs in OUT_DIR: table.md (mean ± std over seeds, the paper's value beside ours where the paper
gives one), table.csv (mean, std, n per cell), figure.png (grouped bars: mean, SD whiskers and every
seed as a point, the statistic and n in the legend, the chance line said in words, the floor below
it (``copy_floor``), the paper's value beside each bar; one seed is a point alone) and curves.png
(accuracy over training, normal and zero gates; under it, in a panel of its own, the path's gate and
the gate of the "normal" evaluation; fade window shaded). A --quick run's figures and table are
marked as a smoke run.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path


from ..bundle import BundleError, ask
from ..cells import HALF, Cell, evaluate_cell, formation_step
from ..experiments import Experiment
from ..store import RunStore
from ..store.errors import StoreError

__all__ = ["collect", "aggregate", "write_report", "splice_into_doc", "dirty_runs", "check_clean",
           "DirtyRunsRefused"]


class DirtyRunsRefused(ValueError):
    """Runs trained from a dirty tree (uncommitted changes) asked to enter a table not marked exploratory."""


def splice_into_doc(doc: str | Path, name: str, md: str) -> None:
    """Replace the text between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in ``doc`` with
    ``md`` (appending a new marked section if absent), so documents quote generated tables verbatim."""
    doc = Path(doc)
    text = doc.read_text() if doc.exists() else ""
    start, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    block = f"{start}\n{md.rstrip()}\n{end}"
    if start in text and end in text:
        a, rest = text.split(start, 1)
        _, b = rest.split(end, 1)
        text = a + block + b
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def collect(store: RunStore, cells: list[Cell]):
    """Long table: one row per (cell, evaluation) of every finished run."""
    import pandas as pd
    rows, cache = [], {}
    for cell in cells:
        if not store.is_done(cell.cfg.run_id):
            continue
        metric = store.summary(cell.cfg.run_id)["metric"]
        ceiling = _ceiling(store, cell.cfg.task)
        for ev in cell.evals:
            try:
                value = evaluate_cell(store, cell, ev, cache)
            except BundleError:
                if not ev.optional:
                    raise
                continue  # a reading added after this bundle was written: not measured there
            rows.append({"row": cell.row, "col": cell.col, "eval": ev.name, "seed": cell.cfg.seed, "metric": metric,
                         "value": value, "run_id": cell.cfg.run_id, "ceiling": ceiling})
    return pd.DataFrame(rows, columns=["row", "col", "eval", "seed", "metric", "value", "run_id", "ceiling"])


def _ceiling(source, task_cfg) -> float:
    """``task_ceiling`` asked of the source (a bundle gives back the ceiling it recorded)."""
    return float(ask(source, "ceiling", {"task": task_cfg.model_dump(mode="json")}, lambda: task_ceiling(task_cfg)))


def task_ceiling(task_cfg) -> float:
    """The Bayes ceiling of a task config (``Task.bayes_accuracy``, which computes a Monte Carlo
    ceiling once per configuration; nan for linear ICL, whose metric is an MSE)."""
    import math

    from ..tasks.generators import make_task
    task = make_task(task_cfg)
    return float(task.bayes_accuracy()[0]) if hasattr(task, "bayes_accuracy") else math.nan


def column_label(col: str, ev: str) -> str:
    """A table's column: the cell's column and the evaluation's name ("base zero", or "zero")."""
    return f"{col} {ev}".strip()


def aggregate(long):
    """(row, column label) -> mean, std (sample std, 0 for one seed), n; rows and columns in build order."""
    import pandas as pd
    cols = ["row", "column", "metric", "mean", "std", "n", "values", "ceiling"]
    if long.empty:
        return pd.DataFrame(columns=cols)
    long = long.assign(column=[column_label(c, e) for c, e in zip(long["col"], long["eval"])])
    if "ceiling" not in long:
        long = long.assign(ceiling=float("nan"))
    g = long.groupby(["row", "column"], sort=False)
    agg = g["value"].agg(["mean", "std", "count"]).reset_index().rename(columns={"count": "n"})
    agg["std"] = agg["std"].fillna(0.0)
    agg.insert(2, "metric", g["metric"].first().values)
    # the per-seed values in seed order (the verdicts' intervals are computed from them, paper.py)
    agg["values"] = [";".join(f"{v:.6g}" for v in grp.sort_values("seed")["value"]) for _, grp in g]
    agg["ceiling"] = g["ceiling"].first().values
    return agg[cols]


def _fmt(mean: float, std: float, metric: str, n: int = 2) -> str:
    """'mean ± SD'; one seed's value alone (its spread is unknown, not 0)."""
    if metric == "acc":
        return f"{mean:.3f}" + (f" ± {std:.3f}" if n > 1 else "")
    return f"{mean:.4g}" + (f" ± {std:.2g}" if n > 1 else "")


def markdown_table(agg, paper: dict | None = None) -> str:
    if agg.empty:
        return "_no finished runs_\n"
    rows = list(dict.fromkeys(agg["row"]))
    cols = list(dict.fromkeys(agg["column"]))
    paper = paper or {}
    header = ["path / scheme"]
    for c in cols:
        header.append(c or "value")
        if any((r, c) in paper for r in rows):
            header.append(f"paper {c}".strip())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    idx = {(r, c): (m, s, n, met) for r, c, met, m, s, n in agg[["row", "column", "metric", "mean", "std", "n"]]
           .itertuples(index=False)}
    for r in rows:
        cells = [r]
        for c in cols:
            v = idx.get((r, c))
            cells.append(_fmt(v[0], v[1], v[3], v[2]) + (f" (n={v[2]})" if v[2] != _mode_n(agg) else "") if v else "–")
            if any((rr, c) in paper for rr in rows):
                cells.append(paper.get((r, c), "–"))
        lines.append("| " + " | ".join(cells) + " |")
    n = _mode_n(agg)
    return "\n".join(lines) + f"\n\nmean ± std over {n} seeds unless marked (n=...)." + _ceiling_note(agg) + "\n"


def _ceiling_note(agg) -> str:
    """The Bayes ceiling of the tables' tasks (the best any model can score; ``Task.bayes_accuracy``)."""
    import math
    if "ceiling" not in agg or agg.empty:
        return ""
    acc = agg[agg["metric"] == "acc"]
    vals = sorted({round(float(c), 4) for c in acc["ceiling"] if not math.isnan(float(c))})
    if not vals:
        return ""
    return " Bayes ceiling of the task: " + ", ".join(f"{v:.3f}" for v in vals) + "."


def _mode_n(agg) -> int:
    return int(agg["n"].max()) if not agg.empty else 0


def _per_seed(long) -> dict[tuple[str, str], list[float]]:
    """(row, column label) -> every seed's value, in seed order, from ``collect``'s long table."""
    if long is None or long.empty:
        return {}
    out: dict[tuple[str, str], list[float]] = {}
    for r, c, e, v in long.sort_values("seed", kind="stable")[["row", "col", "eval", "value"]].itertuples(index=False):
        out.setdefault((r, column_label(c, e)), []).append(float(v))
    return out


def chance_levels(store: RunStore, cells: list[Cell]) -> dict[tuple[str, str], float]:
    """(row, column label) -> the task's chance level for that evaluation (its length's, for an
    evaluation at another length): what the figures draw as the chance line."""
    from ..tasks.generators import make_task
    out, tasks = {}, {}
    for cell in cells:
        if not store.is_done(cell.cfg.run_id):
            continue
        chance = store.summary(cell.cfg.run_id).get("chance")
        for ev in cell.evals:
            level = chance
            if ev.length is not None:
                def chance_at(cfg=cell.cfg.task, length=ev.length):
                    key = cfg.model_dump_json()
                    if key not in tasks:
                        tasks[key] = make_task(cfg)
                    return float(tasks[key].chance_at(length))
                level = ask(store, "chance", {"task": cell.cfg.task.model_dump(mode="json"), "length": ev.length},
                            chance_at)
            if level is not None:
                out.setdefault((cell.row, column_label(cell.col, ev.name)), float(level))
    return out


def copy_floor(task_cfg, length: int, n: int = 20000, seed: int = 0) -> float:
    """The accuracy of copying a token of the context chosen uniformly among its distinct tokens
    (every token before the final position but PAD), key or value alike: E[1{target in context} / #distinct],
    by Monte Carlo on the task's own generator (``n`` sequences, ``seed``; standard error below .001).
    On associative recall with one pool of tokens a model without position (zero gate, NoPE) cannot
    tell a key from a value, so this is where a model that copies but does not retrieve sits: .094 on
    the registered task, below chance (copying a random *value*, 1/n_pairs). nan for a task without
    tokens (linear ICL)."""
    return _copy_floor(task_cfg.model_dump_json(), length, n, seed)


@functools.lru_cache(maxsize=64)
def _copy_floor(task_json: str, length: int, n: int, seed: int) -> float:
    import torch
    import torch.nn.functional as F

    from ..tasks.registry import task_config
    from ..tasks.generators import make_task
    opts = json.loads(task_json)
    task = make_task(task_config(opts.pop("name"), **opts))
    if getattr(task, "input_kind", None) != "tokens" or task.metric != "acc":
        return math.nan
    b = task.sample(n, length, torch.Generator().manual_seed(seed))
    seen = F.one_hot(b.inputs[:, :-1], task.vocab).sum(1) > 0  # [n, V]: the distinct tokens of the context
    seen[:, 0] = False  # PAD
    targets = b.targets if b.targets.dim() == 1 else b.targets[:, -1]
    hit = seen.gather(1, targets[:, None])[:, 0].double()
    return float((hit / seen.sum(1).clamp(min=1).double()).mean())


def floor_levels(store: RunStore, cells: list[Cell]) -> dict[tuple[str, str], float]:
    """(row, column label) -> ``copy_floor`` of the cell's task at its evaluation's length, where it lies
    below the cell's chance level (``chance_levels``): the figures draw it as the floor."""
    chance, out = chance_levels(store, cells), {}
    for cell in cells:
        if not store.is_done(cell.cfg.run_id):
            continue
        for ev in cell.evals:
            key = (cell.row, column_label(cell.col, ev.name))
            level = copy_floor(cell.cfg.task, ev.length or cell.cfg.model.n_ctx)
            if key in chance and math.isfinite(level) and level < chance[key] - 0.005:
                out.setdefault(key, level)
    return out


def chance_text(cells: list[Cell]) -> str | None:
    """What the chance line of ``cells``' tasks is, in words, as their generator says it
    (``Task.chance_text``; None: several kinds of task, or a task that does not say)."""
    from ..tasks.registry import task_spec
    tasks = {c.cfg.task for c in cells}
    names = {t.name for t in tasks}
    if len(names) != 1:
        return None
    return task_spec(next(iter(names))).task_class().chance_text(tasks)


def paper_values(paper: dict | None) -> dict[tuple[str, str], float]:
    """(row, column label) -> the paper's value as a number, from an experiment's ``paper`` strings
    ('.734±.028' -> 0.734); cells the paper gives no number for are left out."""
    import re
    out = {}
    for key, text in (paper or {}).items():
        m = re.match(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))", str(text))
        if m:
            out[key] = float(m.group(1))
    return out


def smoke_note(cells: list[Cell]) -> str | None:
    """'smoke run (--quick: 180 steps, 1 seed)' when every run of ``cells`` is on the --quick budget
    (``experiments.QUICK_STEPS``): its numbers check that everything runs, they are not results."""
    from ..experiments import QUICK_STEPS
    if not cells or any(c.cfg.steps != QUICK_STEPS for c in cells):
        return None
    seeds = len({c.cfg.seed for c in cells})
    return f"smoke run (--quick: {QUICK_STEPS} steps, {seeds} seed{'s' if seeds > 1 else ''})"


def _seeds_text(ns: list[int]) -> str:
    if not ns:
        return "no finished runs"
    lo, hi = min(ns), max(ns)
    count = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"{count} seed{'s' if hi > 1 else ''} per cell"


def describe(exp: Experiment, agg) -> str:
    """The experiment's description, with a seed count in parentheses ('(3 seeds)', '(fade 5 seeds,
    others 3)') replaced by the table's own where it does not hold (a --quick run has one seed each)."""
    import re
    ns = sorted({int(n) for n in agg["n"]}) if not agg.empty else []

    def fix(m):
        said = {int(v) for v in re.findall(r"\d+", m.group(1))}
        if not said or (ns and set(ns) <= said):
            return m.group(0)
        return f" ({_seeds_text(ns)})"
    return re.sub(r"\s*\(([^()]*\bseeds?\b[^()]*)\)", fix, exp.description)


def _wrap(text: str, width_in: float, fontsize: float = 10) -> str:
    """``text`` wrapped to a figure ``width_in`` inches wide (about 0.55 em per character)."""
    import textwrap
    return textwrap.fill(text, width=max(30, int(width_in * 72 / (0.55 * fontsize))), break_long_words=False)


def _smoke_mark(fig, smoke: str | None) -> None:
    """A --quick run's figure: 'SMOKE RUN' across it (its title says which budget)."""
    if smoke:
        fig.text(0.5, 0.5, "SMOKE RUN", transform=fig.transFigure, fontsize=56, color="tab:red", alpha=0.12,
                 rotation=20, ha="center", va="center", fontweight="bold", zorder=0)


def _titled(title: str, smoke: str | None) -> str:
    return f"[{smoke}: not results] {title}" if smoke else title


def _chance_label(metric: str) -> str:
    return "chance" if metric == "acc" else "zero predictor"


def _bar_legend(ax, agg, cols, colors, ns, levels, floors, paper, ceiling, chance_label: str) -> None:
    """``plot_bars``'s legend, right of the axes: one entry per column, the whisker and the single seed,
    the chance and floor lines, the paper's value, the Bayes ceiling; titled by the statistic shown."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    if ns == [1]:  # points only
        handles = [Line2D([], [], color=colors(j % 10), marker="o", markeredgecolor="black", ls="", markersize=6,
                          label=c or "value") for j, c in enumerate(cols)]
    else:
        handles = [Patch(color=colors(j % 10), alpha=0.85, label=c or "value") for j, c in enumerate(cols)]
        handles += [Line2D([], [], color="black", marker="_", markersize=10, ls="-", lw=1, label="± SD over seeds"),
                    Line2D([], [], color="white", marker="o", markeredgecolor="black", ls="", markersize=5,
                           label="one seed")]
    if levels:
        shown = f" = {next(iter(levels)):.3f}" if len(levels) == 1 else " (per task)"
        handles.append(Line2D([], [], color="dimgray", ls="--", lw=1,
                              label=chance_label + shown))
    if floors:
        shown = f" = {next(iter(floors)):.3f}" if len(floors) == 1 else " (per task)"
        handles.append(Line2D([], [], color="tab:purple", ls="-.", lw=1, label="floor: copy any token of the\n"
                              "context, key or value" + shown))
    if any(k in paper for k in zip(agg["row"], agg["column"])):
        handles.append(Line2D([], [], color="black", marker="<", ls="", markersize=6, label="the paper's value"))
    if ceiling is not None:
        handles.append(Line2D([], [], color="tab:green", ls=":", lw=1.2, label=f"Bayes ceiling ({ceiling:.3g})"))
    if ns == [1]:
        stat = "n = 1 seed per cell:\nthe seed's value (no mean, no SD)"
    else:
        stat = f"bars: mean ± SD over seeds,\n{_seeds_text(ns).replace(' per cell', '')} per bar" + \
               ("\n(n = 1: the point alone)" if ns[0] == 1 else "")
    ax.legend(handles=handles, title=stat, title_fontsize=8, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0, alignment="left")


def plot_bars(agg, title: str, out: Path, long=None, chance: dict | None = None, smoke: str | None = None,
              floor: dict | None = None, paper: dict | None = None, chance_label: str | None = None) -> None:
    """Grouped bars, one colour per column: the mean over seeds of each cell with its SD as a whisker,
    and every seed as a point over its bar (``long``: ``collect``'s table); the statistic and n in the
    legend. A cell of one seed is its point alone: no bar, no whisker (its spread is unknown, not 0).
    ``chance``: (row, column label) -> chance level (``chance_levels``), a dashed line, said in words by
    ``chance_label`` (``chance_text``); ``floor``: (row, column label) -> the floor below it
    (``floor_levels``: copying any token of the context), a dash-dot line; ``paper``: (row, column
    label) -> the paper's value (``paper_values``), a black triangle beside the bar. ``smoke``: a
    --quick run's mark (``smoke_note``). The title is wrapped to the figure's width."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = list(dict.fromkeys(agg["row"]))
    cols = list(dict.fromkeys(agg["column"]))
    seeds, chance, floor, paper = _per_seed(long), chance or {}, floor or {}, paper or {}
    metric = agg["metric"].iloc[0]
    ns = sorted({int(n) for n in agg["n"]})
    plot_w = max(5.0, 0.9 * len(rows) * max(1, len(cols)) ** 0.5 + 1.5)
    width_in = plot_w + 2.6  # the legend's column on the right
    title = _wrap(_titled(title, smoke), plot_w - 0.6)
    fig, ax = plt.subplots(figsize=(width_in, 4.2 + 0.17 * title.count("\n")))
    width = 0.8 / max(1, len(cols))
    x = np.arange(len(rows))
    colors = plt.get_cmap("tab10")
    levels = {v for v in chance.values()}
    floors = {round(v, 3) for v in floor.values()}
    for j, c in enumerate(cols):
        sub = agg[agg["column"] == c].set_index("row").reindex(rows)
        xs = x + (j - (len(cols) - 1) / 2) * width
        mean, sd, n = sub["mean"].to_numpy(float), sub["std"].to_numpy(float), sub["n"].fillna(0).to_numpy(int)
        many = n > 1
        ax.bar(xs[many], mean[many], width, color=colors(j % 10), alpha=0.85)
        ax.errorbar(xs[many], mean[many], yerr=sd[many], fmt="none", ecolor="black", elinewidth=1, capsize=3, zorder=3)
        for i, r in enumerate(rows):
            if n[i] == 0:
                continue
            vals = seeds.get((r, c)) or [mean[i]]
            off = np.linspace(-0.28, 0.28, len(vals)) * width if len(vals) > 1 else np.zeros(1)
            single = n[i] == 1
            ax.scatter(xs[i] + off, vals, s=42 if single else 14, color=colors(j % 10) if single else "white",
                       edgecolors="black", linewidths=0.8, zorder=4)
            if len(ns) > 1:  # unequal seed counts: each bar says its own
                ax.annotate(f"n={n[i]}", (xs[i], 0), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=6)
            if len(levels) > 1 and (r, c) in chance:  # chance differs between cells (other tasks or lengths)
                ax.hlines(chance[(r, c)], xs[i] - width / 2, xs[i] + width / 2, colors="dimgray", linestyles="--", lw=1,
                          zorder=5)
            if len(floors) > 1 and (r, c) in floor:
                ax.hlines(floor[(r, c)], xs[i] - width / 2, xs[i] + width / 2, colors="tab:purple", linestyles="-.",
                          lw=1, zorder=5)
            if (r, c) in paper:  # the paper's value, beside the bar
                ax.scatter([xs[i] + width / 2], [paper[(r, c)]], marker="<", s=36, color="black", zorder=6)
    if len(levels) == 1:
        ax.axhline(next(iter(levels)), color="dimgray", ls="--", lw=1, zorder=5)
    if len(floors) == 1:
        ax.axhline(next(iter(floors)), color="tab:purple", ls="-.", lw=1, zorder=5)
    # the Bayes ceiling of the task, where it is below 1 (no model can score above it)
    ceilings = {round(float(v), 4) for v in agg.get("ceiling", []) if np.isfinite(float(v))} if metric == "acc" else set()
    ceiling = next(iter(ceilings)) if len(ceilings) == 1 and next(iter(ceilings)) < 1 else None
    if ceiling is not None:
        ax.axhline(ceiling, color="tab:green", ls=":", lw=1.2, zorder=5)
    ax.set_ylabel("accuracy" if metric == "acc" else "query MSE / d")
    ax.set_xticks(x, rows, rotation=30, ha="right")
    ax.set_title(title, fontsize=10)
    if metric == "acc":
        ax.set_ylim(0, 1.05)
    ax.grid(axis="y", alpha=0.3)
    _bar_legend(ax, agg, cols, colors, ns, levels, floors, paper, ceiling, chance_label or _chance_label(metric))
    fig.tight_layout()
    _smoke_mark(fig, smoke)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _gate_of_normal(path, g_pos: float | None, g_content: float | None) -> str:
    """What "normal" evaluates a run of ``path`` at: its own gates, sigmoid(logit) (the final
    ``model_g_*`` of its summary): trained where the gate is learned, else never trained on this path."""
    if g_pos is None or g_content is None:
        return "normal at the model's own gates"
    if path.pos.mode == "learned" and path.content.mode == "learned":
        return (f"normal at its learned g = {g_pos:.2f}" if f"{g_pos:.2f}" == f"{g_content:.2f}" else
                f"normal at its learned g_pos = {g_pos:.2f}, g_content = {g_content:.2f}")

    def why(kind: str) -> str:  # a derived run (posthoc) starts from its parent's trained logit
        parent = path.parent
        return "its parent's learned logit" if parent is not None and getattr(parent, kind).mode == "learned" \
            else "untrained logit"
    if path.pos.mode != "learned" and path.content.mode != "learned" and f"{g_pos:.2f}" == f"{g_content:.2f}" \
            and why("pos") == why("content"):
        return f"normal at g = {g_pos:.2f} ({why('pos')}),\nnot the path's gate"

    def one(kind: str, v: float) -> str:
        return f"{v:.2f} ({'learned' if getattr(path, kind).mode == 'learned' else why(kind)})"
    return f"normal at g_pos = {one('pos', g_pos)},\ng_content = {one('content', g_content)}"


def _curves_legend(fig, windows: set, chance_drawn, groups: dict, ncols: int):
    """``plot_curves``'s legend under the panels: the two evaluations, the gates of the gate panel, the fade
    window or switch, chance, the shading over seeds."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = [Line2D([], [], color="tab:blue", label="normal: the model's own gates, sigmoid(logit):\nlearned, "
                      "or sigmoid(initial logit) on fixed and scheduled\npaths (their logit is never trained; 0.5 by "
                      "default);\neach panel says at which g"),
               Line2D([], [], color="tab:red", label="zero: both gates forced to 0 (the prior removed)"),
               Line2D([], [], color="black", ls="--", lw=1, label="gate the path applies in training\n(g_pos, the gate panel)"),
               Line2D([], [], color="tab:blue", ls=":", lw=1.2, label="gate of the normal evaluation\n(the gate panel)")]
    if "fade" in windows:
        handles.append(Patch(color="gray", alpha=0.15, label="fade window"))
    if "switch" in windows:
        handles.append(Line2D([], [], color="gray", ls=":", label="switch"))
    if chance_drawn is not None:
        said = chance_text([c for cs in groups.values() for c in cs]) or _chance_label(chance_drawn[0])
        handles.append(Line2D([], [], color="dimgray", ls=":", lw=1, label=said.replace("\n", " ")))
    if any(len(cs) > 1 for cs in groups.values()):
        handles.append(Patch(color="tab:blue", alpha=0.15, label="shading: min to max over seeds"))
    legend = fig.legend(handles=handles, loc="lower center", ncol=min(2, ncols), fontsize=7.5)
    return legend


def plot_curves(store: RunStore, cells: list[Cell], title: str, out: Path, smoke: str | None = None) -> bool:
    """Per row (path): the mean normal and zero-gate metric over training (the band spans the seeds),
    the chance level, and in a panel of its own under it, on its own axis, the gate the path applies in
    training (black, dashed) and the gate the "normal" evaluation uses (blue, dotted). "normal" is the
    model's own gates, sigmoid(logit): for a fixed or scheduled gate that logit is never trained, so a faded model is
    evaluated at sigmoid(initial logit) (0.5 by default), its prior switched back on, whatever the path's
    gate; each panel says at which g, and the legend says so. ``smoke``: a --quick run's mark."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..schedules import Fade, HardSwitch
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        if store.is_done(c.cfg.run_id):
            groups.setdefault(f"{c.row} {c.col}".strip(), []).append(c)
    if not groups:
        return False
    n = len(groups)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    # each path: its metric above, its gates in a short panel of their own below (the legend under all)
    fig, grid = plt.subplots(2 * nrows, ncols, figsize=(4.4 * ncols, 3.9 * nrows + (1.3 if ncols > 1 else 2.4)),
                             squeeze=False, gridspec_kw={"height_ratios": [3, 1] * nrows})
    axes, gate_axes = grid[0::2], grid[1::2]
    windows = set()
    chance_drawn = None
    for ax, ax2, (name, cs) in zip(axes.flat, gate_axes.flat, groups.items()):
        series = [store.metrics(c.cfg.run_id) for c in cs]
        summaries = [store.summary(c.cfg.run_id) for c in cs]
        metric = summaries[0]["metric"]
        steps = np.array([r["step"] for r in series[0]])
        for kind, color in (("normal", "tab:blue"), ("zero", "tab:red")):
            ys = np.array([[r[f"{kind}_{metric}"] for r in s[:len(steps)]] for s in series if len(s) >= len(steps)])
            ax.plot(steps, ys.mean(0), color=color)
            if len(ys) > 1:
                ax.fill_between(steps, ys.min(0), ys.max(0), color=color, alpha=0.15)
        if summaries[0].get("chance") is not None:
            chance_drawn = (metric, summaries[0]["chance"])
            ax.axhline(summaries[0]["chance"], color="dimgray", ls=":", lw=1)
        sched = cs[0].cfg.path.pos.schedule
        for a in (ax, ax2):  # the window in both panels
            if isinstance(sched, Fade) and sched.start_step < steps.max():
                a.axvspan(sched.start_step, min(sched.end_step, steps.max()), color="gray", alpha=0.15)
                windows.add("fade")
            elif isinstance(sched, HardSwitch) and sched.at < steps.max():
                a.axvline(sched.at, color="gray", ls=":")
                windows.add("switch")
        ax.set_xlim(0, steps.max())
        ax2.set_xlim(0, steps.max())
        ax2.plot(steps, np.mean([[r["g_pos"] for r in s[:len(steps)]] for s in series], 0), color="black",
                 ls="--", lw=1)
        if all("model_g_pos" in r for s in series for r in s[:len(steps)]):
            ax2.plot(steps, np.mean([[r["model_g_pos"] for r in s[:len(steps)]] for s in series], 0),
                     color="tab:blue", ls=":", lw=1.2)
        ax2.set_ylim(-0.05, 1.05)
        ax2.set_ylabel("gate", fontsize=8)
        ax2.set_xlabel("step", fontsize=8)
        ax2.tick_params(labelsize=7)
        g = [np.mean([s[k] for s in summaries]) if all(k in s for s in summaries) else None
             for k in ("model_g_pos", "model_g_content")]
        ax.text(0.02, 0.97, _gate_of_normal(cs[0].cfg.path, *g), transform=ax.transAxes, fontsize=7,
                color="tab:blue", va="top", ha="left", bbox=dict(facecolor="white", edgecolor="none", alpha=0.7, pad=1))
        ax.set_title(_wrap(f"{name} (n={len(cs)})", 4.0, 9), fontsize=9)
        ax.tick_params(labelbottom=False)
        ax.set_ylabel(metric, fontsize=8)
        if metric == "acc":
            ax.set_ylim(0, 1.02)
    for ax in [*list(axes.flat)[n:], *list(gate_axes.flat)[n:]]:
        ax.axis("off")
    legend = _curves_legend(fig, windows, chance_drawn, groups, ncols)
    fig.suptitle(_wrap(_titled(title, smoke), 4.4 * ncols), fontsize=10)
    bottom = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.bbox.height
    fig.tight_layout(rect=(0, bottom + 0.01, 1, 1))
    fig.subplots_adjust(wspace=0.3)
    _smoke_mark(fig, smoke)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def provenance_note(store: RunStore, cells: list[Cell]) -> str:
    """One line naming the code, torch, CPU and calibration record(s) behind a table, and a warning
    when the table mixes code versions (runs recorded before provenance count as 'unrecorded').
    Every record the runs name is verified first (``store.record_clock.verify_named``): a forged or edited
    record is refused (``RecordRefused``), and a hash no valid record holds is ``CalibrationMissing``."""
    import collections
    import sys

    from ..preregistration import DIFFICULTY_PATHS
    from ..provenance import code_version
    from ..store.record_clock import verify_named
    ids = list(dict.fromkeys(c.cfg.run_id for c in cells))
    done = [store.summary(r) for r in ids if store.is_done(r)]
    if not done:
        return ""
    verify_named(store, (s.get("calibration") for s in done))
    def count(key):
        return collections.Counter(s.get(key) or "unrecorded" for s in done)

    def calibration(s):  # a difficulty row needs no record; the search trains them before registering one
        return s.get("calibration") or ("difficulty row before registration" if s.get("path") in DIFFICULTY_PATHS
                                        and "softprior_version" in s else "unrecorded")
    codes = collections.Counter(code_version(s) if "softprior_version" in s else "unrecorded" for s in done)
    fmt = lambda c: ", ".join(f"{k} ({v})" for k, v in c.most_common())  # noqa: E731
    line = (f"\n_Provenance of these {len(done)} runs: code {fmt(codes)}; torch {fmt(count('torch_version'))}; "
            f"CPU {fmt(count('cpu'))}; calibration record {fmt(collections.Counter(map(calibration, done)))}._\n")
    if len(codes) > 1:
        warn = f"**Warning: this table mixes {len(codes)} code versions** ({', '.join(codes)})."
        print(f"softprior: warning: {warn.strip('*')}", file=sys.stderr)
        line += "\n" + warn + "\n"
    return line


def formation_table(store: RunStore, cells: list[Cell]):
    """Per finished accuracy run: row, column, seed and its ``formation_step`` (None: never)."""
    import pandas as pd
    rows = []
    for c in cells:
        if not store.is_done(c.cfg.run_id):
            continue
        sm = store.summary(c.cfg.run_id)
        if sm.get("metric") != "acc":
            continue
        try:
            metrics = store.metrics(c.cfg.run_id)
        except StoreError:  # a damaged run (`softprior store verify`) drops out of this diagnostic only
            continue
        rows.append({"row": c.row, "column": c.col, "seed": c.cfg.seed, "formation_step": formation_step(metrics)})
    df = pd.DataFrame(rows, columns=["row", "column", "seed", "formation_step"]).drop_duplicates()
    return df.astype({"formation_step": "Int64"})


def dirty_runs(store: RunStore, cells: list[Cell]) -> list[tuple[Cell, str]]:
    """(cell, code version) of every finished run of ``cells`` trained from a dirty tree: its summary's
    code version (``provenance.code_version``) ends in ``+dirty`` (uncommitted changes to tracked files)."""
    from ..provenance import code_version
    out, seen = [], set()
    for c in cells:
        if c.cfg.run_id in seen or not store.is_done(c.cfg.run_id):
            continue
        seen.add(c.cfg.run_id)
        s = store.summary(c.cfg.run_id)
        if "softprior_version" in s and code_version(s).endswith("+dirty"):
            out.append((c, code_version(s)))
    return out


def _runs_text(dirty: list[tuple[Cell, str]], tables: list[list[str]] | None = None, at_most: int = 10) -> str:
    """The first ``at_most`` runs by id, cell, seed and code version (and the ``tables`` each enters)."""
    shown = [f"{c.cfg.run_id} ({' '.join(x for x in (c.row, c.col) if x)}, seed {c.cfg.seed}, code {v}"
             + (f"; table {', '.join(tables[k])}" if tables else "") + ")" for k, (c, v) in enumerate(dirty[:at_most])]
    return ", ".join(shown) + (f" and {len(dirty) - at_most} more" if len(dirty) > at_most else "")


def check_clean(store: RunStore, tables: list[tuple[Experiment, list[Cell]]], exploratory: bool = False) -> None:
    """``DirtyRunsRefused`` naming the runs trained from a dirty tree (``dirty_runs``) that would enter
    one of ``tables`` ((experiment, cells) each), unless the tables are ``exploratory``."""
    if exploratory:
        return
    found: dict[str, tuple[Cell, str, list[str]]] = {}
    for exp, cells in tables:
        for c, v in dirty_runs(store, cells):
            found.setdefault(c.cfg.run_id, (c, v, []))[2].append(exp.name)
    if found:
        n = len(found)
        raise DirtyRunsRefused(
            f"{n} run{'s' if n > 1 else ''} trained from a dirty tree (uncommitted changes) cannot enter a table "
            "that is not marked exploratory: " + _runs_text([(c, v) for c, v, _ in found.values()],
                                                            [names for _, _, names in found.values()])
            + ". Retrain them from a clean checkout (a new commit), or pass --exploratory to mark the tables "
            "exploratory")


def _exploratory_note(dirty: list[tuple[Cell, str]]) -> str:
    return (f"**Exploratory table**: {len(dirty)} of its runs were trained from a dirty tree (uncommitted "
            f"changes), so no commit reproduces them: {_runs_text(dirty)}.\n\n")


def reading_note(cells: list[Cell], long) -> str:
    """Where a table's "normal" on a masked-gate path is read at sigmoid(initial logit), not .5: that gate
    value, and the g = .5 column beside it (``cells.readings``); empty where the two readings coincide."""
    inits = sorted({c.cfg.model.gate_logit_init for c in cells if HALF in c.evals})
    if not inits:
        return ""
    at = ", ".join(f"{1 / (1 + math.exp(-x)):.3f} (initial logit {x:g})" for x in inits)
    half = (not long.empty and (long["eval"] == HALF.name).any())
    return (f"\n_\"normal\" on the paths that force a gate reads the model's own gates, sigmoid(initial logit) = {at}, "
            "since a forced gate's logit is never trained; " + (
                "the column \"g=.5\" reads both gates at .5 (the constant gate's training value) beside it._\n" if half
                else "this table's source predates the reading at g = .5 beside it (not measured here)._\n"))


def write_report(store: RunStore, exp: Experiment, cells: list[Cell], out_dir: str | Path, *,
                 exploratory: bool = False) -> str:
    """Write table.md, table.csv, figure.png (and curves.png) for ``exp``; return the markdown.
    ``store``: a run store or any source (``softprior.bundle``). A run trained from a dirty tree is
    refused (``check_clean``) unless ``exploratory``, which marks the table exploratory instead."""
    check_clean(store, [(exp, cells)], exploratory)
    dirty = dirty_runs(store, cells)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    long = collect(store, cells)
    agg = aggregate(long)
    missing = sum(not store.is_done(c.cfg.run_id) for c in cells)
    description, smoke = describe(exp, agg), smoke_note(cells)
    md = (f"### {exp.name}\n\n" + (_exploratory_note(dirty) if dirty else "") + f"{description}\n\n"
          + markdown_table(agg, exp.paper))
    if smoke:
        md += f"\n**{smoke[0].upper() + smoke[1:]}**: a check that everything runs, not results.\n"
    if missing:
        md += f"\n**{missing} of {len(cells)} runs are missing or failed** (see `softprior reproduce {exp.name}`).\n"
    md += provenance_note(store, cells) + reading_note(cells, long)
    agg.to_csv(out / "table.csv", index=False, float_format="%.6g")
    formation_table(store, cells).to_csv(out / "formation.csv", index=False)
    if not agg.empty:
        plot_bars(agg, f"{exp.name}: {description}", out / "figure.png", long=long,
                  chance=chance_levels(store, cells), smoke=smoke, floor=floor_levels(store, cells),
                  paper=paper_values(exp.paper), chance_label=chance_text(cells))
        if exp.curves:
            plot_curves(store, cells, exp.name, out / "curves.png", smoke=smoke)
    if exp.analysis is not None:
        md += "\n" + exp.analysis(store, cells, out)
    (out / "table.md").write_text(md)
    return md
