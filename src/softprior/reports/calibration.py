"""Tables and the figure of a calibration search, and the generated ``docs/CALIBRATION.md`` blocks."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..calibration.criteria import criteria_for

__all__ = ["candidates_table", "write_outputs", "choose", "formation_by_axis"]


def _fmt(x, nd=3):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _cell(text: str, limit: int = 160) -> str:
    """``text`` fit for one table cell: one line, a "|" escaped, cut at a word near ``limit`` with "..."."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def choose(cands):
    """The pre-registered choice: the passing candidate nearest to the difficulty rows (smallest
    distance); if none passes, None (and the nearest candidates are reported instead)."""
    passing = sorted([c for c in cands if c.status == "passes"], key=lambda c: c.distance)
    return passing[0] if passing else None


def candidates_table(space, cands, fade: dict | None = None) -> str:
    """Markdown: one line per candidate, the difficulty rows' per-seed values, distance and status."""
    rows = space.rows()
    cols = [(r, g) for r in rows for g in ("normal", "zero")]
    ref = "references (LS / Bayes / 1 GD step)" if _metric(space) == "mse" else "Bayes ceiling"
    head = (["id", "candidate (axes)", "status", "distance", ref] + [f"{r.key} {g}" for r, g in cols]
            + ["circuit forms at (unforced)"])
    if fade is not None:
        head.append("fade600 zero (seed 0)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted(cands, key=lambda c: (c.status in ("infeasible", "interrupted"), c.distance if not math.isnan(c.distance) else 9e9, c.cid)):
        cells = [c.cid, c.label, c.status + (f" ({_cell(c.error)})" if c.error else ""), _fmt(c.distance),
                 candidate_reference(space, c)]
        for r, g in cols:
            v = c.values.get(f"{r.key}|{g}")
            cells.append(" / ".join(f"{x:.2f}" for x in v) if v else "-")
        cells.append(", ".join("never" if s is None else str(s) for s in c.formation) or "-")
        if fade is not None:
            cells.append(_fmt(fade.get(c.cid)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def candidate_reference(space, c) -> str:
    """A candidate's ceiling: the Bayes accuracy of its task (Markov: at p = .2 / .5 / .8, Monte Carlo),
    or for linear ICL the query MSE / E[y^2] of least squares, the Bayes posterior mean and one step
    of gradient descent (on 2,048 sequences, seed 0); "-" where the task options are infeasible."""
    import torch

    from ..tasks.registry import task_spec
    from ..tasks.generators import make_task
    from ..calibration.search import candidate_configs, ceiling
    try:
        if _metric(space) == "mse" and hasattr(task_spec(space.task).task_class(), "reference_mse"):
            cfg = candidate_configs(space, c.task_options, c.model_options, [0])[0][2]
            task = make_task(cfg.task)
            r = task.reference_mse(task.sample(2048, cfg.model.n_ctx, torch.Generator().manual_seed(0)))
            return " / ".join(f"{v:.3f}" for v in r.values())
        vals = [ceiling(space, c.task_options, c.model_options, r)[0] for r in space.rows()
                if r.path == "unforced"]
        return " / ".join(f"{v:.3f}" for v in dict.fromkeys(vals))
    except ValueError:
        return "-"


def _metric(space) -> str:
    """The metric of the space's task ("acc" or "mse"), from its generator (the task registry)."""
    from ..tasks.registry import task_spec
    return task_spec(space.task).task_class().metric


def _sort_key(v):
    """Numbers in numeric order, then everything else by its text."""
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, json.dumps(v))


def formation_by_axis(cands) -> str:
    """Which axis moves the step at which the unforced circuit forms (a diagnostic, never a target).

    Over every measured seed of every candidate (its ``formation``: first step with normal accuracy
    > .5, or None), per axis value: the share of seeds in which the circuit forms and the median step
    where it does. The axis named first is the one whose values differ most in that share (ties: in
    the median step)."""
    import statistics
    by: dict[str, dict[str, list]] = {}
    for c in cands:
        if not c.formation:
            continue
        for k, v in c.params.items():
            by.setdefault(k.split(".", 1)[1], {}).setdefault(v, []).extend(c.formation)
    if not by:
        return ""

    def stats(xs):
        formed = [x for x in xs if x is not None]
        return len(formed) / len(xs), (statistics.median(formed) if formed else None), len(xs)
    spread = {}
    for axis, vals in by.items():
        st = [stats(xs) for xs in vals.values()]
        meds = [m for _, m, _ in st if m is not None]
        spread[axis] = (max(f for f, _, _ in st) - min(f for f, _, _ in st), (max(meds) - min(meds)) if meds else 0)
    order = sorted(by, key=lambda a: spread[a], reverse=True)
    lines = ["| axis | value: forms in (share of seeds), median step where it forms |", "|---|---|"]
    for axis in order:
        cells = []
        for v, xs in sorted(by[axis].items(), key=lambda kv: _sort_key(json.loads(kv[0]))):
            f, med, n = stats(xs)
            cells.append(f"{json.loads(v)}: {f:.0%} of {n}" + (f", step {med:.0f}" if med is not None else ""))
        lines.append(f"| {axis} | {'; '.join(cells)} |")
    top = order[0]
    if spread[top] == (0, 0):
        return "\n".join(lines + ["", "No axis moves circuit formation: every value forms it equally often, at the same median step."])
    lines += ["", f"The axis that moves circuit formation most: **{top}** (its values differ by "
              f"{spread[top][0]:.0%} in the share of seeds that form the circuit"
              + (f" and by {spread[top][1]:.0f} steps in the median step" if spread[top][1] else "") + "). "
              "A marginal comparison over the searched candidates, not a factorial design: the other axes vary "
              "with it and can confound it."]
    return "\n".join(lines)


def figure(space, cands, fade: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    styles = (("passes", dict(c="tab:green", marker="o", s=50, label="passes")),
              ("fails", dict(c="tab:orange", marker="s", s=25, label="fails (3 seeds)")),
              ("pruned", dict(c="tab:gray", marker="x", s=20, label="pruned after 1 seed")))
    floor = -0.06  # candidates without a fade600 run sit on a strip below the axis, so every one is drawn
    for status, style in styles:
        measured = [c for c in cands if c.status == status and not math.isnan(c.distance)]
        pts = [(c.distance, fade[c.cid]) for c in measured if c.cid in fade]
        if pts:
            ax.scatter(*zip(*pts), **style)
        missing = [c.distance for c in measured if c.cid not in fade]
        if missing:  # labelled here when no candidate of this status has a fade600 point
            ax.scatter(missing, [floor] * len(missing), **{**style, "alpha": 0.35, "label": None if pts else style["label"]})
    if any(c.cid not in fade for c in cands):
        ax.axhline(floor / 2, color="0.8", lw=0.8)
        ax.text(ax.get_xlim()[1], floor / 2, "below: no fade600 run ", ha="right", va="bottom", fontsize=7, color="0.4")
    ax.set_ylim(floor - 0.04, max([1.05, *(v + 0.05 for v in fade.values() if math.isfinite(v))]))
    ax.set_xlabel("difficulty distance (sum of criterion gaps; 0 = on the paper's rows)\n"
                  "1 seed if pruned, 3 seeds otherwise: not comparable across the two", fontsize=9)
    ax.set_ylabel(f"fade600->0 zero-gate {'query MSE/d' if _metric(space) == 'mse' else 'accuracy'} (seed 0)")
    ax.set_title(f"calibration candidates: {space.name} ({len(cands)})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(space, cands, out: Path, fade: dict | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    table = candidates_table(space, cands, fade)
    (out / "candidates.md").write_text(table + "\n")
    rows = []
    for c in cands:
        rows.append({"id": c.cid, "trial": c.number, "status": c.status, "distance": c.distance, "n_seeds": c.n_seeds,
                     "task_options": c.task_options, "model_options": {k: list(v) if isinstance(v, tuple) else v
                                                                        for k, v in c.model_options.items()},
                     "means": c.means, "values": c.values, "formation": c.formation, "error": c.error})
    (out / "candidates.json").write_text(json.dumps(rows, indent=1, sort_keys=True))
    files = {"table": out / "candidates.md", "json": out / "candidates.json"}
    if any(not math.isnan(c.distance) for c in cands):  # before any fade600 run, every point sits on the strip
        figure(space, cands, fade or {}, out / "candidates.png")
        files["figure"] = out / "candidates.png"
    return files


def criteria_text(space) -> str:
    """The space's criteria, one line each (an identification space: the hard per-seed constraints and
    the identification rows)."""
    crit = space.criteria() if hasattr(space, "criteria") else criteria_for(space)
    return "\n".join(f"- {c.name}: {c.describe()}" for c in crit)
