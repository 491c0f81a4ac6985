"""The whole paper in one command, and its claims as data (issue 17).

``PAPER``: every experiment in dependency order (the paper's, then ours, marked as ours).
``CLAIMS``: each claim of the paper declared once: its statement, the table cells it reads
(experiment, row, column), the paper's numbers, and a predicate over the measured means. The verdict
is *reproduced* when every condition holds, *partly* when some do, *not reproduced* when none do,
and *not measured* while a cell is missing. ``write_results_doc`` generates the whole of
``docs/RESULTS.md`` from the experiments' ``table.csv`` / ``table.md`` files: the prose there is
fixed text, every number comes from the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["PAPER", "OURS", "Cond", "PaperClaim", "CLAIMS", "verdicts", "verdict_table", "verdict_summary", "write_results_doc", "formation_summary",
           "paper_cells", "write_reports"]

PAPER = ["removability", "paths", "causal_controls", "fade_window", "fade_shapes", "markov_paths", "linear_paths",
         "extra_controls", "static_baselines", "gate_interventions", "length_generalisation", "mechanism_trace",
         "continuation_trace"]
OURS = ["late_fade", "mechanism_trace_late", "mechanism_trace_large", "continuation_trace_large"]


@dataclass(frozen=True)
class Cond:
    """``experiment``'s cell (row, column) ``op`` a value, or another cell of the same experiment plus
    ``value`` (a margin)."""
    experiment: str
    row: str
    column: str
    op: str  # ">=" or "<="
    value: float = 0.0
    other: tuple[str, str] | None = None  # (row, column)
    stat: str = "mean"  # or "std": the spread over seeds

    def measure(self, tables) -> tuple[bool | None, str]:
        t = tables.get(self.experiment, {})
        x = t.get((self.row, self.column) if self.stat == "mean" else (self.row, self.column, self.stat))
        y = t.get(self.other) if self.other else 0.0
        if x is None or y is None:
            return None, f"{self.row} {self.column}: not measured"
        ref = y + self.value
        ok = x >= ref if self.op == ">=" else x <= ref
        rhs = f"{self.other[0]} {self.other[1]} ({y:.3f}){self.value:+.2f}" if self.other else f"{self.value:g}"
        what = f"{self.row} {self.column}" + (f" {self.stat}" if self.stat != "mean" else "")
        return ok, f"{what} {x:.3f} {self.op} {rhs}"


@dataclass(frozen=True)
class PaperClaim:
    name: str
    statement: str
    paper: str
    conditions: tuple[Cond, ...]


def _c(exp, row, col, op, value=0.0, other=None, stat="mean"):
    return Cond(exp, row, col, op, value, other, stat)


_FADES = [f"fade{s}" for s in (400, 500, 600, 700, 800)]
_SHAPES = ["fade600"] + [f"fade600->0:{s}" for s in ("cosine", "convex", "concave", "two_step")]
CLAIMS: list[PaperClaim] = [
    PaperClaim("difficulty", "Difficulty rows (the calibration targets): unforced is learned with the prior and "
               "collapses without it; forced_zero stays near chance", "unforced .780±.007 / .100, forced_zero .094",
               (_c("removability", "unforced", "normal", ">=", 0.73), _c("removability", "unforced", "normal", "<=", 0.83),
                _c("removability", "unforced", "normal", "<=", 0.05, stat="std"),
                _c("removability", "unforced", "zero", "<=", 0.15), _c("removability", "forced_zero", "zero", "<=", 0.15))),
    PaperClaim("unforced relies", "Unforced models rely on the prior: high normal, chance at zero gate",
               "Table 2: .772 normal / .095 zero", (_c("causal_controls", "unforced", "normal", ">=", 0.5),
                                                   _c("causal_controls", "unforced", "zero", "<=", 0.15))),
    PaperClaim("fade keeps (base)", "A smooth fade to zero (fade600->0) keeps zero-gate accuracy high, base model",
               "zero .734", (_c("removability", "fade600", "zero", ">=", 0.6),)),
    PaperClaim("fade keeps (large)", "The same on the large model", "zero .731",
               (_c("paths", "fade600", "large zero", ">=", 0.6),)),
    PaperClaim("forced_zero fails", "Training at zero gate from scratch does not learn the task",
               "zero .091", (_c("causal_controls", "forced_zero", "zero", "<=", 0.15),)),
    PaperClaim("hard switch 1050", "An abrupt switch when the fade would end keeps much less than the fade",
               ".293 vs .734", (_c("causal_controls", "hard_switch1050", "zero", "<=", -0.2, ("fade600", "zero")),
                                _c("causal_controls", "hard_switch1050", "zero", ">=", 0.15))),
    PaperClaim("hard switch 600", "An abrupt switch when the fade would start keeps nothing", ".097",
               (_c("causal_controls", "hard_switch600", "zero", "<=", 0.15),)),
    PaperClaim("posthoc fails", "Post hoc zero-gate continuation of an unforced model does not recover",
               ".178 zero / .619 normal", (_c("causal_controls", "posthoc", "zero", "<=", 0.3),)),
    PaperClaim("linear anneal", "A linear anneal 0.5->0 keeps much of the circuit, base model",
               ".617 zero / .792 normal", (_c("paths", "linear0.5->0", "base zero", ">=", 0.5),)),
    PaperClaim("constant prior", "A constant prior (0.5) gives a prior-dependent model that is weak even with "
               "the prior", ".114 zero / .164 normal", (_c("paths", "forced_const0.5", "base zero", "<=", 0.2),
                                                         _c("paths", "forced_const0.5", "base normal", "<=", 0.3))),
    PaperClaim("fade window", "The effect holds for fade starts 400-800", "no numbers in SPEC",
               tuple(_c("fade_window", f, "zero", ">=", 0.6) for f in _FADES)),
    PaperClaim("fade shapes", "The effect holds for smooth fade shapes", "no numbers in SPEC",
               tuple(_c("fade_shapes", f, "zero", ">=", 0.6) for f in _SHAPES)),
    PaperClaim("markov", "Markov induction shows the same pattern: the fade keeps a zero-gate circuit that "
               "forced_zero lacks, at every p", "no numbers in SPEC",
               tuple(_c("markov_paths", "fade600", f"p={p} zero", ">=", 0.1, ("forced_zero", f"p={p} zero"))
                     for p in (0.2, 0.5, 0.8))),
    PaperClaim("recovery signal", "Continuation view (Sec. 3.3): the zero-gate gradient's share on the circuit at "
               "the removal of the prior is larger on the paths whose zero-gate circuit later forms (rank correlation "
               "over the five associative-recall paths)", "qualitative",
               (_c("continuation_trace", "all paths", "assoc_recall spearman(share, zero)", ">=", 0.5),)),
    PaperClaim("fade tracks the optimum", "Continuation view: a fade follows the moving optimum more closely than a "
               "hard switch jumps (cosine of dθ*/dg·Δg with the actual change)", "qualitative",
               (_c("continuation_trace", "fade600", "assoc_recall tracking cos", ">=", 0.0,
                   ("hard_switch1050", "assoc_recall tracking cos")),)),
    PaperClaim("linear ICL aligned", "Continuation view: in linear ICL the zero-gate gradient at initialisation is "
               "already better aligned with its solution than in retrieval (forced_zero)", "qualitative",
               (_c("continuation_trace", "forced_zero", "linear_icl solution cos", ">=", 0.0,
                   ("forced_zero", "assoc_recall solution cos")),)),
    PaperClaim("linear ICL boundary", "Linear ICL is a boundary case: forced_zero already learns the task "
               "(query MSE/d well below the zero predictor's 1.0)", "qualitative",
               (_c("linear_paths", "forced_zero", "zero", "<=", 0.2),)),
]


def load_tables(results_dir: str | Path) -> dict[str, dict[tuple[str, str], float]]:
    """experiment -> (row, column) -> mean and (row, column, "std") -> std, from ``results_dir/NAME/table.csv``
    and, where an experiment's analysis writes one, ``claims.csv`` (same columns; e.g. the continuation
    quantities, ``analysis.reports.continuation_claims_table``). Empty cells (NaN) count as not measured."""
    import math

    import pandas as pd
    out = {}
    for p in sorted([*Path(results_dir).glob("*/table.csv"), *Path(results_dir).glob("*/claims.csv")]):
        df = pd.read_csv(p, keep_default_na=False)
        if df.empty:
            continue
        t = out.setdefault(p.parent.name, {})
        for r, c, m, s in zip(df["row"], df["column"], df["mean"], df["std"]):
            if m == "" or math.isnan(float(m)):
                continue
            t[(str(r), str(c))] = float(m)
            t[(str(r), str(c), "std")] = float(s) if s != "" else float("nan")
    return {k: v for k, v in out.items() if v}


def verdicts(tables) -> list[tuple[PaperClaim, str, list[str]]]:
    out = []
    for cl in CLAIMS:
        res = [c.measure(tables) for c in cl.conditions]
        oks = [ok for ok, _ in res]
        if None in oks:
            v = "not measured"
        elif all(oks):
            v = "reproduced"
        elif any(oks):
            v = f"partly ({sum(oks)} of {len(oks)} conditions)"
        else:
            v = "not reproduced"
        out.append((cl, v, [f"{'✓' if ok else ('✗' if ok is False else '?')} {txt}" for ok, txt in res]))
    return out


def table_calibration(results_dir: str | Path, name: str) -> str:
    """The calibration record(s) named by an experiment's table (its provenance line), or 'legacy'
    for a table written before run summaries recorded provenance."""
    import re
    md = Path(results_dir) / name / "table.md"
    if not md.exists():
        return "-"
    m = re.search(r"calibration record ([^;_]*)", md.read_text())
    if not m:
        return "legacy (before provenance)"
    return ", ".join(x.split(" (")[0] for x in m.group(1).strip().rstrip(".").split(", "))


def verdict_table(tables, results_dir: str | Path | None = None) -> str:
    lines = ["| claim | paper | verdict | measured (predicate) | calibration of the table |", "|---|---|---|---|---|"]
    for cl, v, ev in verdicts(tables):
        cal = ", ".join(dict.fromkeys(table_calibration(results_dir, c.experiment) for c in cl.conditions)) \
            if results_dir is not None else "-"
        lines.append(f"| {cl.statement} | {cl.paper} | **{v}** | {'; '.join(ev)} | {cal} |")
    return "\n".join(lines)


def verdict_summary(tables) -> str:
    """One line per claim: the verdict only (the README's view; RESULTS.md has the evidence)."""
    lines = ["| paper claim | verdict here |", "|---|---|"]
    for cl, v, _ in verdicts(tables):
        lines.append(f"| {cl.statement} | {v} |")
    return "\n".join(lines)


_HEAD = """# Results

Generated by `softprior reproduce paper` (or `softprior report paper`) from the run store: every
number below comes from the experiments' tables (`docs/results/NAME/table.csv`); the text around them
is fixed. "zero" = every gate forced to 0 (the prior removed); "normal" = the model's own gates,
`sigmoid(logit)`: for learned gates the trained value, for fixed and scheduled paths the untrained
logit (g = 0.5), so a faded model evaluated "normally" has its prior switched back on (see
`DESIGN.md`). Each table ends with the provenance of its runs (code version, torch, CPU, and the
calibration record they ran under, `CALIBRATION.md`).

## Verdicts

Each claim is declared once in `src/softprior/paper.py` (statement, cells, predicate); the verdict
is computed from the tables below.
"""


def formation_summary(results_dir: str | Path, names=None) -> str:
    """When the unforced circuit forms (normal accuracy first above .5), per seed, from each experiment's
    ``formation.csv`` (``report.formation_table``). A diagnostic beside the verdicts, never a target:
    the paper puts consolidation after the gate reaches zero."""
    import pandas as pd
    lines = ["### When the unforced circuit forms", "",
             "The step at which the unforced model's normal accuracy first exceeds .5, per seed (\"never\": not "
             "within the run). A diagnostic, not a criterion: the paper's mechanism trace puts consolidation "
             "after the gate reaches zero.", "", "| experiment | column | steps by seed |", "|---|---|---|"]
    n = len(lines)
    for name in names or (PAPER + OURS):
        f = Path(results_dir) / name / "formation.csv"
        if not f.exists():
            continue
        df = pd.read_csv(f, keep_default_na=False)
        df = df[df["row"] == "unforced"]
        for col, g in df.groupby("column", sort=False):
            steps = [f"seed {int(s)}: {v if v != '' else 'never'}" for s, v in zip(g["seed"], g["formation_step"])]
            lines.append(f"| {name} | {col or '-'} | {', '.join(steps)} |")
    return "\n".join(lines) if len(lines) > n else ""


def write_results_doc(results_dir: str | Path, doc: str | Path, names=None, extra: str = "") -> str:
    """Generate ``doc`` (the whole file) from the tables under ``results_dir``."""
    results_dir = Path(results_dir)
    tables = load_tables(results_dir)
    formation = formation_summary(results_dir, names)
    parts = [_HEAD, verdict_table(tables, results_dir), ""] + ([formation, ""] if formation else [])
    notes = results_dir / "NOTES.md"  # prose that explains the tables (no numbers: those come from them)
    if notes.exists():
        parts += [notes.read_text().strip(), ""]
    if extra:
        parts += [extra, ""]
    for name in names or (PAPER + OURS):
        md = results_dir / name / "table.md"
        if md.exists():
            tag = " (ours, not in the paper)" if name in OURS else ""
            body = md.read_text().strip().replace("### " + name + "\n", "", 1)
            parts += [f"## {name}{tag}", "", body, ""]
            if "_Provenance of" not in body:
                parts += ["_This table predates provenance records: it was measured on the legacy calibration "
                          "(`CALIBRATION.md`) with an earlier engine, and has not been re-run on the "
                          f"pre-registered one (`softprior reproduce {name}`)._", ""]
            for fig in ("figure.png", "curves.png", "heatmaps.png", "continuation.png"):
                if (results_dir / name / fig).exists():
                    rel = Path(__import__("os").path.relpath(results_dir / name / fig, Path(doc).parent))
                    parts.append(f"![{name} {fig}]({rel.as_posix()})")
            parts.append("")
    text = "\n".join(parts).rstrip() + "\n"
    Path(doc).write_text(text)
    return text


def paper_cells(opts, names=None):
    """(experiment, cells) for every experiment of the paper and ours, in order."""
    from .experiments import get_experiment
    return [(get_experiment(n), get_experiment(n).build(opts)) for n in (names or (PAPER + OURS))]


def write_reports(store, exps, out, *, opts, workers: int = 1, plugins=()) -> None:
    """Every experiment's report (``report.write_report``) under ``out/NAME``. With ``workers`` > 1 in
    a process pool (spawn), the costliest first (the mechanism and continuation analyses of snapshot
    runs: half an hour of a whole-paper report on one core), each worker with its share of the cores.
    A report is a function of the store alone, so the files are the same either way. ``opts`` (the
    ``experiments.Options`` the cells were built with) and ``plugins`` rebuild the cells in a worker."""
    from .report import write_report
    out = Path(out)
    if workers <= 1 or len(exps) <= 1:
        for exp, cells in exps:
            write_report(store, exp, cells, out / exp.name)
        return
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed
    threads = max(1, (os.cpu_count() or 1) // workers)
    order = sorted(exps, key=lambda e: _report_cost(e[1]), reverse=True)
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_report_one, str(store.root), exp.name, opts, tuple(plugins), str(out / exp.name), threads)
                for exp, _ in order]
        for f in as_completed(futs):
            f.result()  # a report's exception reaches the caller


def _report_cost(cells) -> float:
    """A relative cost for scheduling reports: the snapshot runs' analyses dominate (width² x layers x
    snapshots), then one unit per run read."""
    return sum(c.cfg.model.d_model ** 2 * c.cfg.model.n_layers * c.cfg.total_steps / c.cfg.snapshot_every
               for c in cells if c.cfg.snapshot_every) + len(cells)


def _report_one(root: str, name: str, opts, plugins: tuple, out_dir: str, threads: int) -> None:
    import torch

    from .experiments import get_experiment, load_plugin
    from .report import write_report
    from .store import RunStore
    torch.set_num_threads(threads)
    for f in plugins:
        load_plugin(f)
    exp = get_experiment(name)
    write_report(RunStore(root), exp, exp.build(opts), out_dir)
