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

import torch

from .experiments import Cell, Eval, Experiment
from .store import RunStore

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
    val = task.sample(cfg.n_val, length, torch.Generator().manual_seed(cfg.val_seed))
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

    from .provenance import code_version
    ids = list(dict.fromkeys(c.cfg.run_id for c in cells))
    done = [store.summary(r) for r in ids if store.is_done(r)]
    if not done:
        return ""
    def count(key):
        return collections.Counter(s.get(key) or "unrecorded" for s in done)
    codes = collections.Counter(code_version(s) if "softprior_version" in s else "unrecorded" for s in done)
    fmt = lambda c: ", ".join(f"{k} ({v})" for k, v in c.most_common())  # noqa: E731
    line = (f"\n_Provenance of these {len(done)} runs: code {fmt(codes)}; torch {fmt(count('torch_version'))}; "
            f"CPU {fmt(count('cpu'))}; calibration record {fmt(count('calibration'))}._\n")
    if len(codes) > 1:
        warn = f"**Warning: this table mixes {len(codes)} code versions** ({', '.join(codes)})."
        print(f"softprior: warning: {warn.strip('*')}", file=sys.stderr)
        line += "\n" + warn + "\n"
    return line


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
    if not agg.empty:
        plot_bars(agg, f"{exp.name}: {exp.description}", out / "figure.png")
        if exp.curves:
            plot_curves(store, cells, exp.name, out / "curves.png")
    if exp.analysis is not None:
        md += "\n" + exp.analysis(store, cells, out)
    (out / "table.md").write_text(md)
    return md


def mechanism_report(store: RunStore, cells: list[Cell], out: Path, mass_threshold: float = 0.25,
                     ablation_threshold: float = 0.03) -> str:
    """Per seed: trace successor-value mass and zero-gate ablation importance from stored snapshots,
    summarise, and draw heatmaps (step x layer.head) with the fade window marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .analysis import summarise_trace, trace, trace_matrix
    from .schedules import Fade
    done = [c for c in cells if store.is_done(c.cfg.run_id)]
    if not done:
        return ""
    lines = ["| seed | top successor head (final mass) | first step mass ≥ %.2f | top ablation head (final drop) "
             "| first step ablation ≥ %.2f |"
             % (mass_threshold, ablation_threshold), "|---|---|---|---|---|"]
    fig, axes = plt.subplots(len(done), 2, figsize=(9, 2.6 * len(done)), squeeze=False)
    for i, c in enumerate(done):
        snaps = store.load_snapshots(c.cfg.run_id)
        df = trace(snaps, c.cfg)
        df.to_csv(out / f"trace_seed{c.cfg.seed}.csv", index=False, float_format="%.6g")
        s = summarise_trace(df, mass_threshold, ablation_threshold)
        def head(h):
            return f"L{h[0]}H{h[1]}" if h is not None else "–"

        def step(v):
            return "never" if v is None else str(v)
        lines.append(f"| {c.cfg.seed} | {head(s['top_successor_head'])} ({s['top_successor_mass']:.2f}) | "
                     f"{step(s['successor_first_step'])} | {head(s['top_ablation_head'])} "
                     f"({s['top_ablation_importance']:.3f}) | {step(s['ablation_first_step'])} |")
        sched = c.cfg.path.pos.schedule
        for j, col in enumerate(("successor_mass", "ablation_importance")):
            mat = trace_matrix(df, col)
            ax = axes[i, j]
            im = ax.imshow(mat.T.values, aspect="auto", cmap="viridis", origin="lower",
                           extent=(mat.index.min(), mat.index.max(), -0.5, mat.shape[1] - 0.5))
            ax.set_yticks(range(mat.shape[1]), list(mat.columns), fontsize=6)
            if isinstance(sched, Fade):
                for x in (sched.start_step, sched.end_step):
                    ax.axvline(x, color="white", ls="--", lw=1)
            ax.set_title(f"seed {c.cfg.seed}: {col}", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.04)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "heatmaps.png", dpi=100)
    plt.close(fig)
    return "\n".join(lines) + "\n\nHeatmaps: heatmaps.png (dashed lines: fade window).\n"


# ------------------------------------------------------------------------------------ continuation trace
def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0
        i = j + 1
    return r


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (Pearson's r of the average ranks; Spearman 1904). NaN for < 3
    points or a constant series."""
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3:
        return float("nan")
    rx, ry = _ranks([p[0] for p in pairs]), _ranks([p[1] for p in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def _mean_std(vals) -> tuple[float, float]:
    v = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    return m, (math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0)


def _ms(vals, digits=3) -> str:
    m, s = _mean_std(vals)
    return "–" if not math.isfinite(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def continuation_report(store: RunStore, cells: list[Cell], out: Path, n_examples: int = 256, max_iter: int = 30,
                        damping: float = 1e-3, method: str = "minres", threshold: float = 0.03,
                        threads: int | None = 1) -> str:
    """The paper's continuation quantities (``softprior.analysis.continuation``) over every stored
    snapshot of each finished run, a summary table, a verdict paragraph and a figure.

    The circuit C of a (task, model, seed) is the heads of ``circuit_heads`` (zero-gate ablation
    importance >= ``threshold``) at the final weights of the fade600->0 run of that task, model and
    seed (the path that forms a zero-gate circuit in the paper), or of the run itself when there is no
    such run; every path of that seed is measured on the same C (the same seed: the same
    initialisation). Writes ``continuation_<task>_<path>_seed<s>.csv`` per run and
    ``continuation.png`` (per task and path, means over seeds: recovery share, its two controls,
    tracking and solution cosines against the step, the gate on a second axis).

    ``threads``: torch threads for the measurements (restored after; None leaves them). One, like a
    sweep's workers: on the shared 2-core machine (load ~5) a tangent snapshot took 2.85 s at 1
    thread and 40.7 s at 2 (docs/PERFORMANCE.md)."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _continuation_report(store, cells, out, n_examples, max_iter, damping, method, threshold)
    finally:
        torch.set_num_threads(old_threads)


def _continuation_report(store, cells, out, n_examples, max_iter, damping, method, threshold) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from .analysis.continuation import circuit_heads, continuation_trace, removal_step
    from .tasks import make_task

    done = [c for c in cells if store.is_done(c.cfg.run_id)]
    if not done:
        return ""

    def key(c):
        return (c.cfg.task.name, c.cfg.model.d_model, c.cfg.seed)
    circuits: dict[tuple, tuple[list, str]] = {}
    for c in done:
        if key(c) in circuits:
            continue
        refs = [r for r in done if key(r) == key(c) and r.cfg.path.name.startswith("fade600")]
        ref = refs[0] if refs else c
        _, model = store.load_model(ref.cfg.run_id)
        task = make_task(ref.cfg.task)
        batch = task.sample(n_examples, ref.cfg.model.n_ctx, torch.Generator().manual_seed(ref.cfg.val_seed))
        circuits[key(c)] = (circuit_heads(model, task, batch, threshold), ref.row)

    frames = []
    for c in done:
        heads, _ = circuits[key(c)]
        parent = c.cfg.parent()
        offset = parent.total_steps if parent is not None else 0
        df = continuation_trace(store.load_snapshots(c.cfg.run_id), c.cfg, heads, n_examples=n_examples,
                                damping=damping, max_iter=max_iter, method=method, step_offset=offset)
        if df.empty:
            continue
        df.to_csv(out / f"continuation_{c.col or c.cfg.task.name}_{c.row}_seed{c.cfg.seed}.csv".replace("/", "_"),
                  index=False, float_format="%.6g")
        summary = store.summary(c.cfg.run_id)
        df = df.assign(task=c.cfg.task.name, col=c.col or c.cfg.task.name, row=c.row, seed=c.cfg.seed,
                       model=c.cfg.model.d_model, removal=offset + removal_step(c.cfg.path, c.cfg.total_steps),
                       zero_metric=summary[f"zero_{summary['metric']}"], metric=summary["metric"])
        frames.append(df)
    if not frames:
        return ""
    all_ = pd.concat(frames, ignore_index=True)

    # ---- per (task column, path): the values at removal, over seeds
    rows = []
    for (col, row), g in all_.groupby(["col", "row"], sort=False):
        at, track, res, tsec = [], [], [], []
        for _, run in g.groupby("seed"):
            run = run.sort_values("step")
            before = run[run["step"] <= run["removal"].iloc[0]]
            at.append((before if len(before) else run).iloc[-1])
            moving = run[run["tracking_cos"].notna()]
            track.append(float(moving["tracking_cos"].mean()) if len(moving) else float("nan"))
            res += list(moving["rel_residual"])
            tsec += list(moving["seconds"])
        rows.append({"col": col, "row": row, "n": len(at), "metric": g["metric"].iloc[0],
                     "removal_step": int(at[0]["step"]),
                     "share": [float(r["share"]) for r in at], "control": [float(r["control_share"]) for r in at],
                     "other": [float(r["other_heads_share"]) for r in at],
                     "solution_cos": [float(r["solution_cos"]) for r in at], "tracking": track,
                     "rel_residual": res, "seconds": tsec,
                     "zero": [float(v) for v in g.groupby("seed")["zero_metric"].first()]})
    lines = ["Continuation quantities (paper Section 3.3; `softprior.analysis.continuation`), at the last snapshot "
             "before the path removes the prior (fade S: S; hard switch at s: before s; forced_zero: init; posthoc: "
             "the unforced end; unforced: its end), mean ± std over seeds. share = ‖P_C ∇L(θ, 0)‖ / ‖∇L(θ, 0)‖ "
             "on the circuit's Q/K/V/O; controls: random coordinates of the same dimension, and as many heads "
             "outside the circuit. solution cos = cos(−∇L(θ, 0), θ_final − θ). tracking cos = cos(tangent × Δg, Δθ) "
             "between snapshots, averaged over the intervals where the gate changes (– where it never does).", "",
             "| task | path | removal step | share | random control | other heads | solution cos | tracking cos "
             "| MINRES rel. residual (median) | final zero-gate metric |", "|" + "---|" * 10]
    for r in rows:
        med = sorted(x for x in r["rel_residual"] if math.isfinite(x))
        cells_ = [r["col"], r["row"], str(r["removal_step"]), _ms(r["share"]), _ms(r["control"]), _ms(r["other"]),
                  _ms(r["solution_cos"]), _ms(r["tracking"]), f"{med[len(med) // 2]:.2f}" if med else "–",
                  _ms(r["zero"])]
        lines.append("| " + " | ".join(cells_) + " |")
    circ = sorted({(k[0], k[1], k[2], ", ".join(f"L{l}H{h}" for l, h in v[0]), v[1]) for k, v in circuits.items()})
    lines += ["", "Circuit heads C (zero-gate mean-ablation importance ≥ %.2f at the final weights of the run named):"
              % threshold, ""]
    lines += [f"- {t} (d_model {d}), seed {s}: {h} (from {src})" for t, d, s, h, src in circ]
    secs = [x for r in rows for x in r["seconds"]]
    if secs:
        lines += ["", f"Cost: {sum(secs) / len(secs):.2f} s per snapshot with a tangent ({len(secs)} snapshots; "
                  f"{n_examples} examples, ≤ {max_iter} H-vector products), "
                  f"{float(all_[all_['tracking_cos'].isna()]['seconds'].mean()):.2f} s without."]
    lines += ["", _continuation_verdict(rows)]
    _plot_continuation(all_, out / "continuation.png", plt)
    lines += ["", "Figure: continuation.png (per task and path, means over seeds; gate g_pos dashed, right axis)."]
    return "\n".join(lines) + "\n"


def _continuation_verdict(rows: list[dict]) -> str:
    """The two questions of the issue, answered from the table's numbers (generated, not written)."""
    def mean(v):
        return _mean_std(v)[0]
    out = ["**Verdict (generated from the table above).**"]
    acc_cols = list(dict.fromkeys(r["col"] for r in rows if r["metric"] == "acc"))
    for col in acc_cols:
        rs = [r for r in rows if r["col"] == col]
        sh, z = [mean(r["share"]) for r in rs], [mean(r["zero"]) for r in rs]
        rho = spearman(sh, z)
        if not math.isfinite(rho):
            out.append(f"{col}: too few paths with a recovery share to compare ({len(rs)}).")
            continue
        order = sorted(rs, key=lambda r: -mean(r["share"]))
        ans = "yes" if rho >= 0.5 else ("no, the opposite" if rho <= -0.5 else "not clearly")
        above = sum(mean(r["share"]) > mean(r["control"]) for r in rs)
        out.append(f"{col}: is the recovery signal at removal larger on the paths whose zero-gate circuit later forms? "
                   f"**{ans}** (Spearman ρ = {rho:.2f} between the circuit share at removal and the final zero-gate "
                   f"accuracy over {len(rs)} paths; by share: "
                   + ", ".join(f"{r['row']} {mean(r['share']):.3f} (zero acc {mean(r['zero']):.3f})" for r in order)
                   + f"). The circuit's share exceeds the random-coordinate control on {above} of {len(rs)} paths.")
        tr = {r["row"]: mean(r["tracking"]) for r in rs if math.isfinite(mean(r["tracking"]))}
        fade = [v for k, v in tr.items() if k.startswith("fade")]
        hard = [v for k, v in tr.items() if k.startswith("hard_switch")]
        if fade and hard:
            out.append(f"Tracking: mean cosine between the optimum's tangent and the actual change over the gate's "
                       f"move: fade {fade[0]:.3f}, hard switch {hard[0]:.3f} (a fade tracks the optimum more closely: "
                       f"**{'yes' if fade[0] > hard[0] else 'no'}**).")
    fz = {r["col"]: r for r in rows if r["row"] == "forced_zero"}
    lin = [r for c, r in fz.items() if r["metric"] == "mse"]
    ref = [r for c, r in fz.items() if r["metric"] == "acc"]
    if lin:
        x = mean(lin[0]["solution_cos"])
        msg = (f"{lin[0]['col']}: forced_zero's zero-gate gradient at initialisation has cosine {x:.3f} with the "
               f"displacement to its final solution (share on its circuit {mean(lin[0]['share']):.3f}, control "
               f"{mean(lin[0]['control']):.3f})")
        if ref:
            y = mean(ref[0]["solution_cos"])
            msg += (f"; in {ref[0]['col']} it is {y:.3f}. Already better aligned with its solution than in discrete "
                    f"retrieval: **{'yes' if x > y else 'no'}**.")
        out.append(msg + ("" if ref else "."))
    return " ".join(out) if len(out) > 1 else ""


def _plot_continuation(df, path: Path, plt) -> None:
    panels = list(dict.fromkeys(zip(df["col"], df["row"])))
    cols = list(dict.fromkeys(df["col"]))
    ncols = max(sum(1 for c, _ in panels if c == col) for col in cols)
    fig, axes = plt.subplots(len(cols), ncols, figsize=(3.6 * ncols, 2.9 * len(cols)), squeeze=False)
    used = set()
    for i, col in enumerate(cols):
        for j, (_, row) in enumerate(p for p in panels if p[0] == col):
            ax = axes[i, j]
            used.add((i, j))
            g = df[(df["col"] == col) & (df["row"] == row)]
            m = g.groupby("step").mean(numeric_only=True).sort_index()
            x = m.index.values
            ax.plot(x, m["share"], color="tab:blue", marker=".", label="circuit share")
            ax.plot(x, m["control_share"], color="tab:blue", ls=":", label="random coordinates")
            if m["other_heads_share"].notna().any():
                ax.plot(x, m["other_heads_share"], color="tab:cyan", ls="-.", label="other heads")
            ax.plot(x, m["solution_cos"], color="tab:green", ls="--", label="solution cos")
            tc = m["tracking_cos"]
            if tc.notna().any():
                ax.plot(x[tc.notna().values], tc.dropna(), color="tab:red", marker="o", ls="-", label="tracking cos")
            ax.axhline(0, color="gray", lw=0.5)
            ax.set_ylim(-1.02, 1.02)
            ax2 = ax.twinx()
            ax2.plot(x, m["g_pos"], color="black", ls="--", lw=1)
            ax2.set_ylim(-0.02, 1.02)
            ax2.set_ylabel("gate", fontsize=7)
            ax.set_title(f"{col}: {row} (n={g['seed'].nunique()})", fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.tick_params(labelsize=7)
            ax2.tick_params(labelsize=7)
    for i in range(len(cols)):
        for j in range(ncols):
            if (i, j) not in used:
                axes[i, j].axis("off")
    legend = [("circuit share", dict(color="tab:blue", marker=".")), ("random coordinates", dict(color="tab:blue", ls=":")),
              ("other heads", dict(color="tab:cyan", ls="-.")), ("solution cos", dict(color="tab:green", ls="--")),
              ("tracking cos", dict(color="tab:red", marker="o")), ("g_pos (right axis)", dict(color="black", ls="--"))]
    fig.legend([plt.Line2D([], [], **kw) for _, kw in legend], [n for n, _ in legend], loc="lower center", ncol=6,
               fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.subplots_adjust(wspace=0.5)
    fig.savefig(path, dpi=100)
    plt.close(fig)
