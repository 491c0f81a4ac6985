"""The whole paper in one command.

``PAPER``: every experiment in dependency order (the paper's, then ours, marked as ours).
``claims.CLAIMS`` (declared once in ``claims.py``): each claim's statement, the table
cells it reads (experiment, row, column), the paper's numbers, and predicates decided on intervals
over seeds (``claims.verdict_of``). ``write_results_doc`` generates the whole of
``docs/RESULTS.md`` from the experiments' ``table.csv`` / ``table.md`` files: the prose there is
fixed text, every number comes from the tables.
"""

from __future__ import annotations

from pathlib import Path

from .preregistration import record_reading
from .claims import CLAIMS, NOT_APPLICABLE, PaperClaim, verdicts

__all__ = ["PAPER", "OURS", "verdict_table", "verdict_summary", "write_results_doc", "formation_summary",
           "paper_cells", "build_cells", "claim_tables", "more_seeds", "MAX_SEEDS", "write_reports",
           "write_calibration_docs", "CALIBRATION_SPACES"]

PAPER = ["removability", "paths", "causal_controls", "fade_window", "fade_shapes", "markov_paths", "linear_paths",
         "extra_controls", "static_baselines", "gate_interventions", "length_generalisation", "mechanism_trace",
         "continuation_trace"]
OURS = ["late_fade", "mechanism_trace_late", "mechanism_trace_large", "continuation_trace_large"]


def _table(records) -> dict[tuple, object]:
    """(row, column) -> mean, and (row, column, KEY) for KEY in "std", "n", "ceiling" and "values", from
    the records of a ``reports.experiment.aggregate`` table (as read back from ``table.csv`` or straight from it)."""
    import math
    t = {}
    for rec in records:
        m = rec["mean"]
        if m == "" or math.isnan(float(m)):
            continue
        key = (str(rec["row"]), str(rec["column"]))
        t[key] = float(m)
        for k in ("std", "n", "ceiling"):
            v = rec.get(k, "")
            t[(*key, k)] = float(v) if v != "" else float("nan")
        vals = str(rec.get("values", "") or "")
        t[(*key, "values")] = [float(v) for v in vals.split(";") if v != ""]
    return t


def load_tables(results_dir: str | Path) -> dict[str, dict[tuple, object]]:
    """experiment -> (row, column) -> mean, and (row, column, KEY) for KEY in "std", "n", "ceiling"
    (floats) and "values" (the per-seed values, a list), from ``results_dir/NAME/table.csv`` and,
    where an experiment's analysis writes one, ``claims.csv`` (same columns; e.g. the continuation
    quantities, ``analysis.reports.continuation_claims_table``). Empty cells (NaN) count as not
    measured; a table without "values" (written before they were recorded) is decided on its points."""
    import pandas as pd
    out = {}
    for p in sorted([*Path(results_dir).glob("*/table.csv"), *Path(results_dir).glob("*/claims.csv")]):
        df = pd.read_csv(p, keep_default_na=False)
        if not df.empty:
            out.setdefault(p.parent.name, {}).update(_table(df.to_dict("records")))
    return {k: v for k, v in out.items() if v}


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


def registered_changes(results_dir: str | Path) -> dict[str, list[str]]:
    """Claim name -> how its predicates differ today from those registered by a calibration record that
    its tables name (their provenance lines, ``table_calibration``), each line prefixed with the record;
    empty for a claim whose records registered no claims (v1 records) or the same ones. The records are
    the package's and the results bundle's (``results_dir/bundle/records``), each verified."""
    import re

    from .claims import changed_claims
    from .preregistration import all_shipped_records, read_record
    held = {r["hash"]: r for r in all_shipped_records()}
    for f in sorted((Path(results_dir) / "bundle" / "records").glob("*.json")):
        held.setdefault((r := read_record(f))["hash"], r)
    out: dict[str, list[str]] = {}
    for cl in CLAIMS:
        for exp in dict.fromkeys(c.experiment for c in cl.conditions):
            for h in re.findall(r"\b[0-9a-f]{16}\b", table_calibration(results_dir, exp)):
                rec = held.get(h)
                if rec is None or "claims" not in rec:
                    continue
                for line in changed_claims(rec["claims"]).get(cl.name, []):
                    out.setdefault(cl.name, []).append(f"record {h}: {line}")
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def verdict_table(tables, results_dir: str | Path | None = None) -> str:
    """The verdict of every claim on ``tables`` (``claims.verdicts``), with the calibration record(s) of
    its tables where ``results_dir`` is given; a claim whose predicates changed since those records
    registered them is refused, the row naming each changed predicate (``registered_changes``)."""
    lines = ["| claim | paper | verdict | measured (predicate) | calibration of the table |", "|---|---|---|---|---|"]
    changed = registered_changes(results_dir) if results_dir is not None else None
    for cl, v, ev in verdicts(tables, changed=changed):
        cal = ", ".join(dict.fromkeys(table_calibration(results_dir, c.experiment) for c in cl.conditions)) \
            if results_dir is not None else "-"
        lines.append(f"| {cl.statement} | {cl.paper} | **{v}** | {'; '.join(ev)} | {cal} |")
    return "\n".join(lines)


# the README's plain lists, in this order: a verdict's first word -> its heading
_PLAIN = (("reproduced", "**Holds here**"), ("not", "**Does not hold here**"),
          ("partly", "**Partly**"), ("inconclusive", "**Undecided**"),
          ("not applicable", "**Not applicable** (the model never learned what the claim asks it to keep)"))


def _failed(cl: PaperClaim, tables) -> list[str]:
    """The conditions of ``cl`` that fail on ``tables``, each as its cells, its estimate and threshold
    ("unforced normal std needs <= 0.050, got 0.204")."""
    out = []
    for c in cl.conditions:
        e = c.evaluate(tables)
        if e is not None and e["ok"] is False:
            what = f"{c.row} {c.column}" + (f" {c.stat}" if c.stat != "mean" else "") + \
                (f" - {c.other[0]} {c.other[1]}" if c.other else "")
            out.append(f"{what} needs {c.op} {e['thr']:.3f}, got {e['est']:.3f}")
    return out


def verdict_summary(tables, results_doc: str = "docs/RESULTS.md") -> str:
    """The README's answer in plain words: the claims grouped by verdict (holds, does not hold, partly,
    undecided; ``verdicts``), each by its statement, a partial or undecided one with how many of its
    conditions hold, then a link to the full verdict table (estimates, intervals, n) in ``results_doc``."""
    groups: dict[str, list[str]] = {}
    for cl, v, _ in verdicts(tables):
        word = v.split()[0]
        detail = f" ({v.split('(', 1)[1]}" if word in ("partly", "inconclusive") and "(" in v else ""
        if word == "partly":
            detail = detail[:-1] + "; fails: " + "; ".join(_failed(cl, tables)) + ")"
        if v == NOT_APPLICABLE:
            word = "not applicable"
        elif word == "not" and v != "not reproduced":
            word = "not measured"
        groups.setdefault(word, []).append(
            f"- {cl.statement}{detail}")
    out = []
    for word, head in _PLAIN + (("not measured", "**Not measured yet**"),):
        if groups.get(word):
            out += [f"{head} ({len(groups[word])} of {sum(map(len, groups.values()))} claims):", "", *groups[word], ""]
    out.append(f"Each claim's conditions, estimates and 95% intervals over seeds: the verdict table in "
               f"[`{results_doc}`]({results_doc}#verdicts).")
    return "\n".join(out)


_HEAD = """# Results

Generated by `softprior reproduce paper` (or `softprior report paper`) from the run store: every
number below comes from the experiments' tables (`docs/results/NAME/table.csv`); the text around them
is fixed. "zero" = every gate forced to 0 (the prior removed); "normal" = the model's own gates,
`sigmoid(logit)`: for learned gates the trained value, for fixed and scheduled paths the untrained
logit (g = 0.5 at the default initial logit 0; a table whose runs start elsewhere names the value and
reads g = .5 beside it), so a faded model evaluated "normally" has its prior switched back on (see
`DESIGN.md`). Each table ends with the provenance of its runs (code version, torch, CPU, and the
calibration record they ran under, `CALIBRATION.md`).

## Verdicts

Each claim is declared once in `src/softprior/claims.py` (statement, cells, predicate); the verdict
is computed from the tables below. Each condition is decided on a 95% interval over seeds (a Student t
interval for a mean, paired by seed for a difference between two paths, chi-square for a spread): it
*holds* when the whole interval lies on its side of the threshold, *fails* when the whole interval
lies on the other side, and is *undecided* otherwise; a claim is *reproduced* when every condition
holds, *not reproduced* when every one fails, *inconclusive* when none fails but one is undecided,
and *partly* otherwise. One seed gives no interval (inconclusive). Where a condition is undecided at
the paper's seed counts (5 for Table 1's fade and Table 2's causal controls, 3 elsewhere), the cells
it reads, and every cell compared with them, are run on up to 10 seeds before the claim is called:
once, decided on the paper's seeds alone (`paper.more_seeds`), so n beside each number says how many
seeds it rests on. A table written before per-seed
values were recorded is decided on its point values, and says so. Thresholds that mean "high
accuracy" are shares of the task's Bayes ceiling (`x ceiling`). What the continuation view (Sec. 3.3)
measures, and when its tangents count, is in `CONTINUATION.md`.
"""


def _id_cell(r) -> tuple[str, str, str] | None:
    """The table cell (experiment, row, column) that measures identification row ``r`` (``tiers.py``)."""
    if r.task == "linear_icl" and r.read in ("normal", "zero"):
        return "linear_paths", r.source, r.read
    if r.task != "assoc_recall" or not r.read or r.read == "params":
        return None
    if r.source in ("soft_pos_only", "soft_content_only"):
        return "static_baselines", r.source, f"assoc_recall {r.read}"
    if r.read in ("pos=0", "content=0"):
        return "gate_interventions", "soft_bias", f"assoc_recall {r.read}"
    if r.read == "T=120":
        return "length_generalisation", "soft_bias", "assoc_recall T=120"
    return "paths", r.source, f"{r.model} {r.read}"


def _rank(tables, col: str, row: str) -> tuple[int, int, str] | None:
    """(rank of ``row`` by its mean in ``col`` of the static baselines, highest first; rows; the leader)."""
    t = tables.get("static_baselines", {})
    means = {k[0]: v for k, v in t.items() if len(k) == 2 and k[1] == col}
    if row not in means:
        return None
    order = sorted(means, key=lambda k: -means[k])
    return order.index(row) + 1, len(order), order[0]


def _qualitative(r, tables) -> tuple[str, bool] | None:
    """The measured side of a qualitative identification row (a predicate over the static baselines)
    and whether it holds: soft_bias the highest of the thirteen on associative recall; among the three
    strongest on Markov at p = .2 ("among the strongest, especially at p = .2"); soft_pos_only, T5, soft_bias
    and DAPE within 1.5% of each other in linear-ICL eval loss ((max - min) / min)."""
    if r.name.startswith("soft_bias highest"):
        got = _rank(tables, "assoc_recall normal", "soft_bias")
        return None if got is None else (f"soft_bias ranks {got[0]} of {got[1]} (first: {got[2]})", got[0] == 1)
    if r.name.startswith("markov: soft_bias"):
        got = _rank(tables, "markov p=0.2 normal", "soft_bias")
        return None if got is None else (f"soft_bias ranks {got[0]} of {got[1]} at p = .2 (first: {got[2]})",
                                         got[0] <= 3)
    if r.name.startswith("linear_icl:"):
        t = tables.get("static_baselines", {})
        v = [t.get((k, "linear_icl normal")) for k in ("soft_pos_only", "t5", "soft_bias", "dape")]
        if None in v:
            return None
        spread = (max(v) - min(v)) / min(v)
        return f"spread (max - min) / min = {spread:.1%} ({', '.join(f'{x:.4f}' for x in v)})", spread <= r.tol
    return None


def identification_table(tables, params: dict[str, float] | None = None, reading: str | None = None) -> str:
    """The paper's identification rows (``tiers.py``) beside this project's measurement of each, from the
    experiments' tables (and ``params``: model size -> parameters in thousands, of the configuration the
    tables ran on): the distance in units of the row's scale and whether it is matched. ``reading``: the
    length reading the tables' record registered; the T = 120 row reads that column where it was measured,
    and says so where it was not."""
    from .tiers import IDENTIFICATION, MATCH_Z
    lines = ["| identification row | where | paper | measured here | distance (scale) | matched |",
             "|---|---|---|---|---|---|"]
    for r in IDENTIFICATION:
        paper = "-" if r.paper is None else f"{r.paper:g}" + (f" ± {r.spread:g}" if r.spread is not None else "")
        cell, x, how = _id_cell(r), None, ""
        if r.read == "params" and params:
            x = params.get(r.model)
        elif cell is not None:
            x = tables.get(cell[0], {}).get(cell[1:])
            if r.read == "T=120":  # a record's registered length reading, where its table measured it
                read = next((k for k in tables.get(cell[0], {}) if len(k) == 2 and k[0] == cell[1]
                             and k[1].startswith(cell[2] + " (")), None)
                if read is not None:
                    cell, x = (cell[0], *read), tables[cell[0]][read]
                    how = f", read {read[1].split(' (', 1)[1].rstrip(')')}"
                elif reading is not None and x is not None:
                    how = f", read clip: the record's reading \"{reading}\" not measured here"
        if x is None:
            q = _qualitative(r, tables)
            lines.append(f"| {r.name} | {r.where} | {paper} | {q[0] if q else 'not measured'} | - | "
                         f"{'-' if q is None else 'yes' if q[1] else '**no**'} |")
            continue
        n = tables.get(cell[0], {}).get((*cell[1:], "n")) if cell else None
        seeds = f" (n={int(n)}{how})" if n is not None and n == n else f" ({how[2:]})" if how else ""
        lines.append(f"| {r.name} | {r.where} | {paper} | {x:.3f}{seeds} | {r.z(x):.1f} ({r.scale:g}) | "
                     f"{'yes' if r.z(x) <= MATCH_Z else '**no**'} |")
    return "\n".join(lines)


def search_sections(results_dir: str | Path, spaces) -> list[str]:
    """The sections the searches ``spaces`` wrote for RESULTS.md beside their outputs
    (``reports.calibration_doc.write_sections``): each identification search's ``identified.md``, then each
    effect search's ``effect.md``. Only those written with this report, so RESULTS.md never shows a
    section its bundle could not give back."""
    root = Path(results_dir) / "calibration"
    out = []
    for name in ("identified.md", "effect.md"):
        for space in spaces:
            f = root / Path(str(space)).stem / name
            if f.is_file():
                out += [f.read_text().strip(), ""]
    return out


def default_params(record: str | None = None) -> dict[str, float]:
    """Parameters (thousands) of the shipped default associative-recall model, base and large (or of the
    shipped record ``record``'s configuration, ``preregistration.use_record``)."""
    from .config import make_run_config
    from .model.transformer import build_model
    from .preregistration import use_record
    with use_record(record) as rec:
        task = rec["task"] if rec else "assoc_recall"
        return {m: build_model(make_run_config(task, model=m)).n_params() / 1000.0 for m in ("base", "large")}


ON_RECORD_DIR = "on_record"  # results_dir/on_record/NAME: ``reproduce paper --record NAME --out`` there


def on_record_sections(results_dir: str | Path, doc: str | Path) -> list[str]:
    """For each ``results_dir/on_record/NAME`` (the paper's tables on the shipped record NAME, written by
    ``softprior reproduce paper --record NAME --out`` there, with their own bundle): its verdicts and its
    identification rows, in the form of those above, and where its tables are."""
    import os
    out = []
    for sub in sorted(p for p in (Path(results_dir) / ON_RECORD_DIR).glob("*") if p.is_dir()):
        tables = load_tables(sub)
        if not tables:
            continue
        rel = Path(os.path.relpath(sub / "RESULTS.md", Path(doc).parent)).as_posix()
        out += [f"## The paper's tables on record `{sub.name}` (ours)", "",
                f"The experiments of the paper on the configuration of the shipped record `{sub.name}` "
                f"(`src/softprior/calibration/registered/{sub.name}.json`) in place of its task's default, "
                f"without the continuation trace: `softprior reproduce paper --record {sub.name}`. Every table, "
                f"figure and provenance line: [{rel}]({rel}) (regenerated by `softprior report paper "
                f"--from-bundle {Path(os.path.relpath(sub, Path(doc).parent)).as_posix()}`). The claims of "
                "other tasks read no table here: \"not measured\".", "",
                "### Verdicts", "", verdict_table(tables, sub), "",
                "### Identification rows", "", identification_table(tables, default_params(sub.name), record_reading(sub.name)), ""]
    return out


# what each shipped record of the cross-regime table is (a record not named here is shown by its name)
REGIMES = {"identified-assoc_recall": "identified", "assoc_recall_blocked": "blocked constant gate",
           "assoc_recall_large_identify": "large, identified", "identified-markov": "Markov, identified"}


def _short(v: str) -> str:
    """A verdict as a table cell: its words before any parenthesis, and a partial one's count."""
    if v.startswith("partly") and "(" in v:
        return "partly (" + v.split("(", 1)[1].split(";")[0].rstrip(")") + ")"
    return v.split(" (")[0].split(":")[0]


def _regime_verdicts(results_dir: Path) -> list[tuple[str, dict[str, str]]]:
    """(column, claim name -> verdict) for the tables under ``results_dir`` (each task's default record)
    and each ``on_record/NAME`` (the paper's tables on record NAME) that holds tables."""
    cols = [("default records", results_dir)] + [
        (f"{REGIMES.get(p.name, p.name)} (`{p.name}`)", p)
        for p in sorted(q for q in (results_dir / ON_RECORD_DIR).glob("*") if q.is_dir()) if load_tables(p)]
    return [(c, {cl.name: v for cl, v, _ in verdicts(load_tables(d), changed=registered_changes(d))}) for c, d in cols]


def _cell(v: str) -> str:
    return f"**{_short(v)}**" if v in ("reproduced", "not reproduced") else _short(v)


def cross_regime_table(results_dir: str | Path) -> str:
    """Each claim's verdict on every registered record side by side (``_regime_verdicts``); empty when
    no table ran on another record."""
    got = _regime_verdicts(Path(results_dir))
    if len(got) < 2:
        return ""
    lines = ["| claim | " + " | ".join(c for c, _ in got) + " |", "|---|" + "---|" * len(got)]
    lines += [f"| {cl.statement} | " + " | ".join(_cell(g[cl.name]) for _, g in got) + " |" for cl in CLAIMS]
    return "\n".join(lines)


def cross_regime_summary(results_dir: str | Path, results_doc: str = "docs/RESULTS.md") -> str:
    """The README's form of ``cross_regime_table``, in words: per claim measured on more than one record,
    its verdict on each (records that do not measure it left out); empty when no table ran on another record."""
    got = _regime_verdicts(Path(results_dir))
    if len(got) < 2:
        return ""
    out = ["The same claims on every pre-registered record whose tables ran (the table: "
           f"[`{results_doc}`]({results_doc}#one-verdict-across-regimes)):", ""]
    for cl in CLAIMS:
        on = [(c, g[cl.name]) for c, g in got if not g[cl.name].startswith("not measured")]
        if len(on) > 1:
            out.append(f"- {cl.statement}: " + "; ".join(f"{c.split(' (`')[0]} {_cell(v)}" for c, v in on))
    return "\n".join(out)


_CROSS_HEAD = """## One verdict across regimes

Each claim's verdict (above; in bold where decided) on every record whose tables ran: the default tables
(each task's shipped default record) and the paper's tables on each further pre-registered record
(sections above). "not measured": no table of that record holds the claim's cells (a record of
another task, or an experiment not run on it). What the columns say in words: `results/NOTES.md`.
"""


_ID_HEAD = """## Identification rows

The paper's numbers that involve no gate trajectory (a constant or learned gate, or no prior), declared
in `src/softprior/tiers.py`, beside the same cells of the tables below. They describe the model and the
task, so they are what a configuration is identified by (`CALIBRATION.md`, "Identification"); a row is
matched within 2 units of its scale (the paper's spread, at least one validation standard error, .02,
or a stated tolerance). The parameter counts are the shipped default configuration's.
"""


def formation_summary(results_dir: str | Path, names=None) -> str:
    """When the unforced circuit forms (normal accuracy first above .5), per seed, from each experiment's
    ``formation.csv`` (``reports.experiment.formation_table``). A diagnostic beside the verdicts, never a target:
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


def write_results_doc(results_dir: str | Path, doc: str | Path, names=None, extra: str = "", spaces=(),
                      record: str | None = None) -> str:
    """Generate ``doc`` (the whole file) from the tables under ``results_dir`` and the sections of the
    searches ``spaces`` (written with them: ``search_sections``); ``record``: the tables ran on that
    shipped record's configuration (``reproduce paper --record``), whose parameters the identification
    rows then count."""
    results_dir = Path(results_dir)
    tables = load_tables(results_dir)
    formation = formation_summary(results_dir, names)
    id_head = _ID_HEAD if record is None else \
        _ID_HEAD.replace("the shipped default configuration's", f"those of record `{record}`'s configuration")
    parts = [_HEAD, verdict_table(tables, results_dir), "", id_head,
             identification_table(tables, default_params(record), record_reading(record)),
             ""] + search_sections(results_dir, spaces) + on_record_sections(results_dir, doc)
    cross = cross_regime_table(results_dir)
    parts += ([_CROSS_HEAD, cross, ""] if cross else []) + ([formation, ""] if formation else [])
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
    """(experiment, cells) for every experiment of the paper and ours, in order (``build_cells``); with
    ``opts.record``, the experiments that have cells of its task (``ON_RECORD`` unless ``names``)."""
    from .experiments import get_experiment
    if opts.record is not None:
        built = [(get_experiment(n), build_cells(get_experiment(n), opts)) for n in (names or ON_RECORD)]
        return [(e, cells) for e, cells in built if cells]
    return [(get_experiment(n), build_cells(get_experiment(n), opts)) for n in (names or (PAPER + OURS))]


# the paper's tables on another pre-registered configuration (``reproduce paper --record NAME``): the
# paper's experiments without the continuation trace, whose tangent solves (docs/PERFORMANCE.md, section 4,
# "Continuation traces on both cores") cost more than the runs it reads
ON_RECORD = [n for n in PAPER if n != "continuation_trace"] + ["markov_controls", "large_controls"]  # ours: controls


# where a condition is undecided at the paper's seed counts (5 for Table 1's fade and Table 2's causal
# controls, 3 elsewhere), the cells it reads are run on this many seeds before the claim is called
MAX_SEEDS = 10


def build_cells(exp, opts):
    """``exp``'s cells under ``opts``, plus, for each of its cells named in ``opts.extend``, the seeds
    up to ``opts.extend_seeds`` (the same configurations at further seeds, after the paper's cells)."""
    import dataclasses

    from .reports.experiment import column_label
    cells = exp.cells(opts)
    wanted = {(row, col) for e, row, col in opts.extend if e == exp.name}
    if not wanted:
        return cells
    have = {c.cfg.run_id for c in cells}
    more = exp.cells(dataclasses.replace(opts, seeds=opts.extend_seeds or MAX_SEEDS, extend=()))
    return cells + [c for c in more if c.cfg.run_id not in have
                    and any((c.row, column_label(c.col, ev.name)) in wanted for ev in c.evals)]


def claim_tables(source, exps) -> dict[str, dict[tuple, object]]:
    """The tables the claims read (as ``load_tables`` gives them), computed from the source's runs
    without writing a report: the experiments whose cells are training rows (``reports.experiment.aggregate``)."""
    from .reports.experiment import aggregate, collect
    read = {c.experiment for cl in CLAIMS for c in (*cl.conditions, *cl.valid_if)}
    out = {}
    for exp, cells in exps:
        if exp.name in read and exp.analysis is None:
            t = _table(aggregate(collect(source, cells)).to_dict("records"))
            if t:
                out[exp.name] = t
    return out


def more_seeds(tables) -> tuple[tuple[str, str, str], ...]:
    """The cells (experiment, row, column) to run on ``MAX_SEEDS`` seeds: those read by a condition
    whose interval straddles its threshold (undecided) on fewer seeds, and every cell compared with an
    extended one in any condition (so a paired difference stays paired by seed). One step, decided on
    the paper's seed counts alone, so the rule cannot be steered by looking at the added seeds; sorted,
    so the same tables give the same extension."""
    out = set()
    conds = [c for cl in CLAIMS for c in cl.conditions]
    for c in conds:
        e = c.evaluate(tables)
        if e is None or e["ok"] != "undecided" or e["point"] or not e["n"] or min(e["n"]) >= MAX_SEEDS:
            continue
        out.add((c.experiment, c.row, c.column))
    pairs = [((c.experiment, c.row, c.column), (c.experiment, *c.other)) for c in conds if c.other]
    grown = True
    while grown:  # close over comparisons: a cell compared with an extended one is extended too
        grown = False
        for a, b in pairs:
            for x, y in ((a, b), (b, a)):
                if x in out and y not in out:
                    out.add(y)
                    grown = True
    return tuple(sorted(out))


def write_reports(store, exps, out, *, opts, workers: int = 1, plugins=(), on_report=None, bundle=None,
                  exploratory: bool = False) -> None:
    """Every experiment's report (``reports.experiment.write_report``) under ``out/NAME``. With ``workers`` > 1 in
    a process pool (spawn), the costliest first (the mechanism and continuation analyses of snapshot
    runs: half an hour of a whole-paper report on one core), each worker with its share of the cores.
    A report is a function of the store alone, so the files are the same either way. ``opts`` (the
    ``experiments.Options`` the cells were built with) and ``plugins`` rebuild the cells in a worker.
    ``on_report(name, started_at, seconds, runs)``: called as each report is written, with its wall time
    (measured where it ran; the store's time ledger).

    ``store``: a run store or a results bundle (``bundle.BundleSource``). ``bundle``: the directory of a
    bundle being written (``bundle.BundleWriter.dir``): each report records what it reads there, as part
    NAME. ``exploratory``: tables may hold runs trained from a dirty tree, marked so (``write_report``)."""
    import time

    from .reports.experiment import write_report
    out = Path(out)
    if workers <= 1 or len(exps) <= 1:
        for exp, cells in exps:
            started, t0 = time.time(), time.perf_counter()
            _write_one(store, exp, cells, out / exp.name, bundle, exploratory, write_report)
            if on_report is not None:
                on_report(exp.name, started, time.perf_counter() - t0, len(cells))
        return
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from .training.runtime import usable_cores
    threads = max(1, usable_cores() // workers)
    order = sorted(exps, key=lambda e: _report_cost(e[1]), reverse=True)
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        futs = {ex.submit(_report_one, _source_spec(store), exp.name, opts, tuple(plugins), str(out / exp.name),
                          threads, str(bundle) if bundle is not None else None, exploratory):
                (exp.name, len(cells)) for exp, cells in order}
        for f in as_completed(futs):
            started, seconds = f.result()  # a report's exception reaches the caller
            if on_report is not None:
                on_report(futs[f][0], started, seconds, futs[f][1])


def _report_cost(cells) -> float:
    """A relative cost for scheduling reports: the snapshot runs' analyses dominate (width² x layers x
    snapshots), then one unit per run read."""
    return sum(c.cfg.model.d_model ** 2 * c.cfg.model.n_layers * c.cfg.total_steps / c.cfg.snapshot_every
               for c in cells if c.cfg.snapshot_every) + len(cells)


def _write_one(source, exp, cells, out_dir, bundle, exploratory: bool, write_report) -> None:
    """One report, recorded as part ``exp.name`` of the bundle being written at ``bundle`` (if any)."""
    from .bundle import Recorder
    src = Recorder(source, bundle, exp.name) if bundle is not None else source
    write_report(src, exp, cells, out_dir, exploratory=exploratory)
    if bundle is not None:
        src.close()


def _source_spec(source) -> tuple[str, str]:
    """How a worker opens the same source: ("bundle", its directory) or ("store", its root)."""
    from .bundle import BundleSource
    return ("bundle", str(source.root)) if isinstance(source, BundleSource) else ("store", str(source.root))


def _open_source(spec: tuple[str, str]):
    from .bundle import BundleSource
    from .store import RunStore
    kind, path = spec
    return BundleSource(path) if kind == "bundle" else RunStore(path)


def _report_one(spec: tuple[str, str], name: str, opts, plugins: tuple, out_dir: str, threads: int,
                bundle: str | None = None, exploratory: bool = False) -> tuple[float, float]:
    """Write one report in a worker; returns (unix start, wall seconds) for the time ledger."""
    import time
    started, t0 = time.time(), time.perf_counter()
    import torch

    from .experiments import get_experiment
    from .plugins import load_plugin
    from .reports.experiment import write_report
    torch.set_num_threads(threads)
    for f in plugins:
        load_plugin(f)
    exp = get_experiment(name)
    _write_one(_open_source(spec), exp, build_cells(exp, opts), out_dir, bundle, exploratory, write_report)
    return started, time.perf_counter() - t0


# the calibration search spaces whose blocks docs/CALIBRATION.md holds: per task, the first search's
# space, then the wider one searched after it. A space writes the task's record block with the record
# registered on it, so the later space comes last and the block ends with the task's current record.
CALIBRATION_SPACES = ("assoc_recall", "assoc_recall_ceiling", "markov", "markov_induction", "linear_icl",
                      "linear_icl_formats")


def write_calibration_docs(source, doc, out, spaces=CALIBRATION_SPACES, *, steps=None, bundle=None) -> list[str]:
    """The generated blocks of ``doc`` (docs/CALIBRATION.md) for each search space of ``spaces`` (shipped
    names or files) that was searched, and its outputs under ``out/calibration/SPACE``
    (``reports.calibration_doc.write_calibration``), from a store or a results bundle; with ``bundle`` (a bundle
    being written) each space is recorded as part ``calibration-SPACE``. Returns the spaces written."""
    from .bundle import Recorder
    from .calibration.space import load_space
    from .reports.calibration_doc import write_calibration
    done = []
    for name in spaces:
        space = load_space(name)
        src = Recorder(source, bundle, f"calibration-{space.name}") if bundle is not None else source
        if write_calibration(doc, src, space, Path(out) / "calibration" / space.name, steps=steps):
            done.append(name)
            if bundle is not None:
                src.close()
    return done
