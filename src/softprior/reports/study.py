"""The report of ``softprior study`` (``study/NAME/REPORT.md``; docs/STUDY.md says what each section
means): the difficulty search, the pre-registration, the numbers, the verdicts on intervals, the
robustness map, the figures and the mechanism trace, all read from the run store."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..claims import NOT_APPLICABLE

__all__ = ["write_report"]

_MARK = {"reproduced": "y", "not reproduced": "n", "not measured": "?", NOT_APPLICABLE: "-"}


def _ms(v: list[float]) -> str:
    if not v:
        return "–"
    m = sum(v) / len(v)
    if len(v) == 1:
        return f"{m:.3f}"
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return f"{m:.3f} ± {sd:.3f}"


def _numbers(plan, store, rows) -> str:
    from ..paths import schedule_text
    lines = ["| path | its gate trajectory (at the study's budget) | normal | zero gate | seeds |", "|---|---|---|---|---|"]
    for label, _ in plan.paths:
        runs = [cfg for lab, _, cfg in rows if lab == label and store.is_done(cfg.run_id)]
        vals = {g: [store.summary(c.run_id)[f"{g}_{store.summary(c.run_id)['metric']}"] for c in runs]
                for g in ("normal", "zero")}
        sched = schedule_text(runs[0].path) if runs else ""
        lines.append(f"| {label} | {sched} | {_ms(vals['normal'])} | {_ms(vals['zero'])} | {len(runs)} |")
    return "\n".join(lines)


def _verdict_table(results) -> str:
    lines = ["| claim | the paper | verdict | evidence (95% interval over seeds) |", "|---|---|---|---|"]
    for cl, v, ev in results:
        lines.append(f"| **{cl.name}**: {cl.statement} | {cl.paper} | **{v}** | {'<br>'.join(ev)} |")
    return "\n".join(lines)


def _map_table(claims, chosen, main, others: dict) -> str:
    per = [(chosen, main)] + [(c, res) for c, res in others]
    head = ["| claim | reproduced on | of measured | per candidate |", "|---|---|---|---|"]
    for i, cl in enumerate(claims):
        vs = [(c, res[i][1]) for c, res in per]
        yes = sum(v == "reproduced" for _, v in vs)
        tot = sum(v not in ("not measured", NOT_APPLICABLE) for _, v in vs)
        marks = ", ".join(f"{c.cid}:{_MARK.get(v, '~' if v.startswith('inconclusive') else 'n')}" for c, v in vs)
        head.append(f"| {cl.name} | {yes} | {tot} | {marks} |")
    return "\n".join(head)


def _figures(plan, store, rows, levels) -> list[str]:
    """curves.png (``reports.experiment.plot_curves``) and zero_gate.png (each path's zero-gate metric, per seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..cells import Cell
    from .experiment import plot_curves
    out = []
    cells = [Cell(cfg, row=label) for label, _, cfg in rows]
    if plot_curves(store, cells, f"study {plan.name}: normal and zero-gate metric over training", plan.dir / "curves.png"):
        out.append("![curves](curves.png)\n\n*curves.png*: per path, the metric over training at the model's own "
                   "gates and at zero gate (band: the seeds), with the gate the path applies.")
    metric, chance, ceiling = levels
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (label, _) in enumerate(plan.paths):
        ys = [store.summary(c.run_id)[f"zero_{metric}"] for lab, _, c in rows if lab == label and store.is_done(c.run_id)]
        ax.scatter([i] * len(ys), ys, color="tab:blue", zorder=3)
        if ys:
            ax.hlines(sum(ys) / len(ys), i - 0.3, i + 0.3, color="black")
    ax.axhline(chance, color="dimgray", ls="--", lw=1, label=f"chance {chance:.3f}")
    ax.axhline(ceiling, color="tab:green", ls=":", lw=1.2, label=f"ceiling {ceiling:.3f}")
    ax.set_xticks(range(len(plan.paths)), [p for p, _ in plan.paths], rotation=30, ha="right")
    ax.set_ylabel(f"zero-gate {metric}")
    ax.legend(fontsize=8)
    ax.set_title(f"{plan.prior} on {plan.task}: what is left once the prior is removed", fontsize=9)
    fig.tight_layout()
    fig.savefig(plan.dir / "zero_gate.png", dpi=110)
    plt.close(fig)
    out.append("![zero gate](zero_gate.png)\n\n*zero_gate.png*: each path's zero-gate metric per seed (dots) and "
               "mean (bar), against chance and the ceiling.")
    return out


def _mechanism(plan, store, rows) -> str:
    """The fade's mechanism trace at zero gate (``analysis.mechanism.trace``: per head, successor-value mass and
    mean-ablation importance over the stored snapshots, on ``plan.trace_examples`` validation examples,
    at most ``_SNAPSHOTS`` snapshots evenly spaced), summarised per seed (``analysis.mechanism.summarise_trace``)
    and drawn as trace.png; trace_seedS.csv holds every number."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..analysis.mechanism import summarise_trace, trace, trace_matrix
    done = [cfg for label, _, cfg in rows if label == "fade600" and cfg.snapshot_every and store.is_done(cfg.run_id)]
    if not done:
        return "No fade run with snapshots is stored yet."
    lines = ["| seed | top successor head (final mass) | first step mass ≥ .25 | top ablation head (final drop) "
             "| first step drop ≥ .03 |", "|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(done), figsize=(4.5 * len(done), 3), squeeze=False)
    for ax, cfg in zip(axes[0], done):
        snaps = store.load_snapshots(cfg.run_id)
        snaps = [snaps[round(i * (len(snaps) - 1) / (_SNAPSHOTS - 1))] for i in range(_SNAPSHOTS)] \
            if len(snaps) > _SNAPSHOTS else snaps
        df = trace(list(dict((s, sd) for s, sd in snaps).items()), cfg, n_examples=plan.trace_examples)
        df.to_csv(plan.dir / f"trace_seed{cfg.seed}.csv", index=False, float_format="%.6g")
        t = summarise_trace(df, n_examples=plan.trace_examples or cfg.n_val)

        def head(h):
            return f"L{h[0]}H{h[1]}" if h is not None else "–"
        lines.append(f"| {cfg.seed} | {head(t['top_successor_head'])} ({t['top_successor_mass']:.2f}) | "
                     f"{t['successor_first_step'] if t['successor_first_step'] is not None else 'never'} | "
                     f"{head(t['top_ablation_head'])} ({t['top_ablation_importance']:.3f}) | "
                     f"{t['ablation_first_step'] if t['ablation_first_step'] is not None else 'never'} |")
        trace_matrix(df, "ablation_importance").plot(ax=ax, lw=1, legend=False)
        sched = cfg.path.pos.schedule
        for x in (getattr(sched, "start_step", None), getattr(sched, "end_step", None)):
            if x is not None:
                ax.axvline(x, color="gray", ls="--", lw=1)
        ax.set_title(f"seed {cfg.seed}: zero-gate ablation drop per head", fontsize=8)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(plan.dir / "trace.png", dpi=100)
    plt.close(fig)
    return ("\n".join(lines) + "\n\n![trace](trace.png)\n\n*trace.png*: per head (one line each), the drop in the "
            "zero-gate metric when the head is mean-ablated, over training (dashed: the fade's window).")


_SNAPSHOTS = 6


def write_report(plan, store, space, cands, rec, chosen, claims, levels, main_rows, others, verdicts_of) -> Path:
    """Write ``plan.dir/REPORT.md`` (and its figures); returns its path."""
    from .calibration import candidates_table
    from ..plugins import ENV
    metric, chance, ceiling = levels
    main = verdicts_of(main_rows)
    mapped = [(c, verdicts_of(r)) for c, r in others.values()]
    prereg = json.loads((plan.dir / "preregistration.json").read_text())
    plugins = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    cmd = (f"softprior study --task {plan.task} --prior {plan.prior}" + "".join(f" --plugin {p}" for p in plugins)
           + (" --quick" if plan.quick else "") + f" --steps {plan.steps} --seeds {plan.seeds} --name {plan.name}")
    md = [f"# Study `{plan.name}`: prior `{plan.prior}` on task `{plan.task}`", "",
          f"`{cmd}`", "",
          f"{plan.steps} steps per run (the paper's paths scaled from 3,600), {plan.seeds} seed(s) per row, "
          f"{metric} (chance {chance:.3f}, ceiling {ceiling:.3f}). "
          + ("**A --quick study: too few steps and seeds for its verdicts to mean much; it shows the method runs.**"
             if plan.quick else ""), "",
          "## Verdicts", "", _verdict_table(main), "",
          "y / reproduced: every condition's 95% interval over the seeds lies on its side of the threshold; "
          "not reproduced: every one on the other side; inconclusive: an interval straddles a threshold "
          "(one seed gives no interval); not applicable (-): the unforced model did not learn the task, so a "
          "claim about what training keeps says nothing. Thresholds are levels of the span from chance to the ceiling "
          "(`softprior.study.study_claims`).", "",
          "## 1. The difficulty search", "",
          "Criteria (the only calibration targets):", "",
          "\n".join(f"- {c.name}: {c.describe()}" for c in space.criteria()), "",
          "Axes: " + ("; ".join(f"`{k}` {v}" for k, v in space.axes.items()) or "none"), "",
          candidates_table(space, cands), "",
          "## 2. Pre-registration", "",
          f"Calibration record `{rec['hash']}` (registered {rec['registered_at']}, "
          f"{'passes every criterion' if rec['passes'] else 'no candidate passes: the nearest'}; {rec['note']}): "
          f"task options `{json.dumps(rec['task_options'], sort_keys=True)}`, model options "
          f"`{json.dumps(rec['model_options'], sort_keys=True)}`. The study's claims were written to "
          f"`preregistration.json` at {prereg['written_at']}, before any path trained.", "",
          "## 3. The paths", "", f"On the chosen candidate `{chosen.cid}` ({chosen.label or 'no axes'}):", "",
          _numbers(plan, store, main_rows), "",
          "## 4. The robustness map", "",
          f"The paths on the {plan.map_limit} nearest other candidate(s) at most (`--map`).", "",
          _map_table(claims, chosen, main, mapped) if mapped else
          "Only the chosen candidate is mapped (" + ("`--map 0`" if plan.map_limit == 0 else
                                                   "no other passing, or completed nearest, candidate") + ").", "",
          "## 5. Figures", "", *_figures(plan, store, main_rows, levels), "",
          "## 6. The mechanism trace (fade, zero gate)", "", _mechanism(plan, store, main_rows), ""]
    f = plan.dir / "REPORT.md"
    f.write_text("\n".join(md))
    return f
