"""Tables and figures from the run store (``softprior report`` and the end of ``reproduce``).

Nothing here trains: "normal"/"zero" numbers come from each run's stored summary; other evaluations
(gate overrides, other lengths) are computed from the stored weights on the run's validation seed.
Outputs in OUT_DIR: table.md (mean ± std over seeds, the paper's value beside ours where the paper
gives one), table.csv (mean, std, n per cell), figure.png (grouped bars with std error bars) and
curves.png (accuracy over training, normal and zero gates, gate value on a second axis, fade
window shaded).
"""

from __future__ import annotations

import math
from pathlib import Path


from .experiments import Cell, Eval, Experiment
from .store import RunStore, StoreError

__all__ = ["collect", "aggregate", "write_report", "evaluate_cell", "splice_into_doc"]


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


def evaluate_cell(store: RunStore, cell: Cell, ev: Eval, _cache: dict | None = None) -> float:
    from .tasks import make_task
    from .train import evaluate
    cfg = cell.cfg
    summary = store.summary(cfg.run_id)
    m = summary["metric"]
    if ev.from_summary:
        return float(summary[("zero_" if ev.gates == (0.0, 0.0) else "normal_") + m])
    key = cfg.run_id
    if _cache is not None and key in _cache:
        model = _cache[key]
    else:
        _, model = store.load_model(cfg.run_id)
        if _cache is not None:
            _cache[key] = model
    task = make_task(cfg.task)
    length = ev.length or cfg.model.n_ctx
    val = cfg.validation_batch(task, length=length)
    gp, gc = ev.gates if ev.gates is not None else (None, None)
    return float(evaluate(model, task, val.inputs, val.targets, gp, gc)[m])


def collect(store: RunStore, cells: list[Cell]):
    """Long table: one row per (cell, evaluation) of every finished run."""
    import pandas as pd
    rows, cache = [], {}
    for cell in cells:
        if not store.is_done(cell.cfg.run_id):
            continue
        metric = store.summary(cell.cfg.run_id)["metric"]
        for ev in cell.evals:
            rows.append({"row": cell.row, "col": cell.col, "eval": ev.name, "seed": cell.cfg.seed, "metric": metric,
                         "value": evaluate_cell(store, cell, ev, cache), "run_id": cell.cfg.run_id})
    return pd.DataFrame(rows, columns=["row", "col", "eval", "seed", "metric", "value", "run_id"])


def _label(col: str, ev: str) -> str:
    return f"{col} {ev}".strip()


def aggregate(long):
    """(row, column label) -> mean, std (sample std, 0 for one seed), n; rows and columns in build order."""
    import pandas as pd
    if long.empty:
        return pd.DataFrame(columns=["row", "column", "metric", "mean", "std", "n"])
    long = long.assign(column=[_label(c, e) for c, e in zip(long["col"], long["eval"])])
    g = long.groupby(["row", "column"], sort=False)
    agg = g["value"].agg(["mean", "std", "count"]).reset_index().rename(columns={"count": "n"})
    agg["std"] = agg["std"].fillna(0.0)
    agg.insert(2, "metric", g["metric"].first().values)
    return agg


def _fmt(mean: float, std: float, metric: str) -> str:
    if metric == "acc":
        return f"{mean:.3f} ± {std:.3f}"
    return f"{mean:.4g} ± {std:.2g}"


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
            cells.append(_fmt(v[0], v[1], v[3]) + (f" (n={v[2]})" if v[2] != _mode_n(agg) else "") if v else "–")
            if any((rr, c) in paper for rr in rows):
                cells.append(paper.get((r, c), "–"))
        lines.append("| " + " | ".join(cells) + " |")
    n = _mode_n(agg)
    return "\n".join(lines) + f"\n\nmean ± std over {n} seeds unless marked (n=...).\n"


def _mode_n(agg) -> int:
    return int(agg["n"].max()) if not agg.empty else 0


def plot_bars(agg, title: str, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = list(dict.fromkeys(agg["row"]))
    cols = list(dict.fromkeys(agg["column"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) * max(1, len(cols)) ** 0.5 + 2), 4))
    width = 0.8 / max(1, len(cols))
    x = np.arange(len(rows))
    colors = plt.get_cmap("tab10")
    for j, c in enumerate(cols):
        sub = agg[agg["column"] == c].set_index("row").reindex(rows)
        ax.bar(x + (j - (len(cols) - 1) / 2) * width, sub["mean"], width, yerr=sub["std"], capsize=2,
               label=c or "value", color=colors(j % 10), alpha=0.9)
    metric = agg["metric"].iloc[0]
    ax.set_ylabel("accuracy" if metric == "acc" else "query MSE / d")
    ax.set_xticks(x, rows, rotation=30, ha="right")
    ax.set_title(title, fontsize=10)
    if metric == "acc":
        ax.set_ylim(0, 1.05)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_curves(store: RunStore, cells: list[Cell], title: str, out: Path) -> bool:
    """Per row (path): mean normal and zero-gate metric over training, gate value on a twin axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .schedules import Fade, HardSwitch
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        if store.is_done(c.cfg.run_id):
            groups.setdefault(f"{c.row} {c.col}".strip(), []).append(c)
    if not groups:
        return False
    n = len(groups)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    for ax, (name, cs) in zip(axes.flat, groups.items()):
        series = [store.metrics(c.cfg.run_id) for c in cs]
        metric = store.summary(cs[0].cfg.run_id)["metric"]
        steps = np.array([r["step"] for r in series[0]])
        for kind, color in (("normal", "tab:blue"), ("zero", "tab:red")):
            ys = np.array([[r[f"{kind}_{metric}"] for r in s[:len(steps)]] for s in series if len(s) >= len(steps)])
            ax.plot(steps, ys.mean(0), color=color, label=f"{kind} gates")
            if len(ys) > 1:
                ax.fill_between(steps, ys.min(0), ys.max(0), color=color, alpha=0.15)
        sched = cs[0].cfg.path.pos.schedule
        if isinstance(sched, Fade) and sched.start_step < steps.max():
            ax.axvspan(sched.start_step, min(sched.end_step, steps.max()), color="gray", alpha=0.15,
                       label="fade window")
        elif isinstance(sched, HardSwitch) and sched.at < steps.max():
            ax.axvline(sched.at, color="gray", ls=":", label="switch")
        ax.set_xlim(0, steps.max())
        ax2 = ax.twinx()
        ax2.plot(steps, np.mean([[r["g_pos"] for r in s[:len(steps)]] for s in series], 0), color="black",
                 ls="--", lw=1, label="g_pos")
        ax2.set_ylim(-0.02, 1.02)
        ax2.set_ylabel("gate", fontsize=8)
        ax.set_title(f"{name} (n={len(cs)})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        if metric == "acc":
            ax.set_ylim(0, 1.02)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    h1, l1 = axes.flat[0].get_legend_handles_labels()
    fig.legend(h1 + [plt.Line2D([], [], color="black", ls="--")], l1 + ["g_pos (path)"], loc="lower center",
               ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.subplots_adjust(wspace=0.45)  # room for each panel's right-hand gate axis
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def provenance_note(store: RunStore, cells: list[Cell]) -> str:
    """One line naming the code, torch, CPU and calibration record(s) behind a table, and a warning
    when the table mixes code versions (runs recorded before provenance count as 'unrecorded')."""
    import collections
    import sys

    from .calibration.record import DIFFICULTY_PATHS
    from .provenance import code_version
    ids = list(dict.fromkeys(c.cfg.run_id for c in cells))
    done = [store.summary(r) for r in ids if store.is_done(r)]
    if not done:
        return ""
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


def formation_step(metrics: list[dict], metric: str = "acc", level: float = 0.5) -> int | None:
    """The first evaluated step at which normal accuracy exceeds ``level``: when the circuit forms
    (a diagnostic, never a calibration target)."""
    for r in metrics:
        if r.get(f"normal_{metric}", 0.0) > level:
            return int(r["step"])
    return None


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


def write_report(store: RunStore, exp: Experiment, cells: list[Cell], out_dir: str | Path) -> str:
    """Write table.md, table.csv, figure.png (and curves.png) for ``exp``; return the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    long = collect(store, cells)
    agg = aggregate(long)
    missing = sum(not store.is_done(c.cfg.run_id) for c in cells)
    md = f"### {exp.name}\n\n{exp.description}\n\n" + markdown_table(agg, exp.paper)
    if missing:
        md += f"\n**{missing} of {len(cells)} runs are missing or failed** (see `softprior reproduce {exp.name}`).\n"
    md += provenance_note(store, cells)
    agg.to_csv(out / "table.csv", index=False, float_format="%.6g")
    formation_table(store, cells).to_csv(out / "formation.csv", index=False)
    if not agg.empty:
        plot_bars(agg, f"{exp.name}: {exp.description}", out / "figure.png")
        if exp.curves:
            plot_curves(store, cells, exp.name, out / "curves.png")
    if exp.analysis is not None:
        md += "\n" + exp.analysis(store, cells, out)
    (out / "table.md").write_text(md)
    return md
