"""Pre-registering a search's choice, and the generated blocks of ``docs/CALIBRATION.md``."""

from __future__ import annotations

import json
import math
import sys
from importlib import resources
from pathlib import Path

from ..calibration.register import make_record
from ..calibration.robustness import claim_counts, mapped, prediction_rows, space_prediction_rows
from ..calibration.search import candidate_configs
from ..preregistration import CalibrationMissing, calibration_key
from ..tiers import length_row
from .calibration import candidates_table, choose, criteria_text, formation_by_axis

__all__ = ["register", "update_doc", "write_calibration"]


def _nearest(cands):
    ok = [c for c in cands if c.status in ("fails", "pruned") and not math.isnan(c.distance)]
    return min(ok, key=lambda c: (c.status != "fails", c.distance)) if ok else None


def ship_record(rec: dict, name: str) -> Path:
    """Write ``rec`` as the package's ``registered/NAME`` and print the one command that commits it.
    Records are write-once (``preregistration``, "write-once"): a file that holds another record is
    refused, in one line; the record must be committed within ``WRITE_ONCE_MINUTES`` of its
    ``registered_at``, or every later use refuses it."""
    from ..preregistration import WRITE_ONCE_MINUTES, RecordRefused
    dest = Path(str(resources.files("softprior.calibration") / "registered")) / name
    if dest.exists() and json.loads(dest.read_text()).get("hash") != rec["hash"]:
        raise RecordRefused(str(dest), "holds another record, and a shipped record is never rewritten: move it "
                                       "aside (git mv) or ship the new one under another name")
    dest.write_text(json.dumps(rec, indent=1, sort_keys=True))
    print(f"softprior: shipped record {rec['hash']} as {dest}; commit it now (within {WRITE_ONCE_MINUTES} minutes "
          f"of its registration, before any prediction row): git add {dest} && git commit -m 'register "
          f"{rec['task']} record {rec['hash']}'", file=sys.stderr, flush=True)
    return dest


def register(space, store, cands, *, steps=None, ship=False, doc=None) -> dict:
    """Write the choice (``reports.calibration.choose``; if no candidate passes, the nearest, marked as failing)
    to the store, and refuse if a prediction row of it was trained before (``CalibrationMissing``, which
    the command line reports in one line, as it does when no candidate was measured). An identification
    search registers its identified set instead (``register_identified``)."""
    if space.identify:
        return register_identified(space, store, cands, steps=steps, ship=ship, doc=doc)
    c = choose(cands)
    passes = c is not None
    if c is None:
        c = _nearest(cands)
        if c is None:
            raise CalibrationMissing(f"search {space.name!r} has no measured candidate to register")
    pred = candidate_configs(space, c.task_options, c.model_options, range(space.seeds),
                             rows=prediction_rows(space.task), steps=steps)
    early = [cfg.run_id for _, _, cfg in pred if store.status(cfg.run_id) is not None]
    if early:
        raise CalibrationMissing(f"cannot pre-register candidate {c.cid}: prediction row {early[0]} of it was "
                         "trained before its calibration record")
    keys = []
    for model in ("base", "large"):
        sp = space.model_copy(update={"model": model})
        keys += [calibration_key(cfg) for _, _, cfg in candidate_configs(sp, c.task_options, c.model_options, [0],
                                                                          rows=prediction_rows(space.task) or None)]
    measured = {r.name: c.means.get(f"{r.row.key}|{r.gates}") for r in space.criteria()}
    measured["per_seed"] = c.values
    measured["distance"] = c.distance
    measured["formation"] = c.formation
    from ..calibration.search import ceiling
    measured["bayes_ceiling"] = ceiling(space, c.task_options, c.model_options)[0]
    # the options the search built the candidate from: the default it inherited (the package's
    # registered one, as ``candidate_configs`` merges it) plus its own, so that the new default trains
    # exactly the configurations the search measured
    from ..preregistration import default_options
    t_def, m_def = default_options(space.task)
    t_opts = {**t_def, **c.task_options}
    m_opts = {**m_def, **c.model_options}
    rec = make_record(space, t_opts, m_opts, keys, measured, passes,
                      note=f"candidate {c.cid} of study {space.name}-{space.digest}")
    store.write_record(rec)
    if ship:
        ship_record(rec, f"{space.task}.json")
    if doc:
        from .experiment import splice_into_doc
        splice_into_doc(doc, f"calibration-record-{space.task}", _record_md(rec))
    return rec


def register_identified(space, store, cands, *, steps=None, ship=False, doc=None) -> dict:
    """Pre-register an identification search's identified set (``identify.identified_at``: measured on
    five seeds): one record whose keys cover every member's prediction rows, base and large, and which
    lists each member's options and identification rows. Its task and model options are the best
    member's. Refuses if a prediction row of any member was trained before it."""
    from ..preregistration import default_options
    from ..calibration.identify import identified_at, length_reading, member_entry
    from ..calibration.search import with_completed
    members = identified_at(space, with_completed(space, store, cands))
    if not members:
        raise CalibrationMissing(f"search {space.name!r} has no candidate measured on five seeds (none measured "
                                 "yet: run the search with --budget first)")
    keys = []
    for c in members:
        rows = space_prediction_rows(space, wide=True)  # the search's own rows are not predictions
        pred = candidate_configs(space, c.task_options, c.model_options, range(space.seeds), rows=rows, steps=steps)
        early = [cfg.run_id for _, _, cfg in pred if store.status(cfg.run_id) is not None]
        if early:
            raise CalibrationMissing(f"cannot pre-register candidate {c.cid}: prediction row {early[0]} of it was "
                                     "trained before its calibration record")
        for model in ("base", "large"):
            sp = space.model_copy(update={"model": model})
            keys += [calibration_key(cfg) for _, _, cfg in candidate_configs(sp, c.task_options, c.model_options, [0],
                                                                              rows=rows)]
    best = members[0]
    t_def, m_def = default_options(space.task)
    entries = [member_entry(space, c) for c in members]
    for e, c in zip(entries, members):  # as ``register``: the options the search built each one from
        e["task_options"], e["model_options"] = {**t_def, **c.task_options}, {**m_def, **e["model_options"]}
    passes = all(e["hard_constraints"] and all(r["matched"] for r in e["rows"].values()) for e in entries)
    rec = make_record(space, entries[0]["task_options"], entries[0]["model_options"], keys,
                      {"distance": best.distance, "members": len(members)}, passes,
                      note=f"identified set of {len(members)} of study {space.name}-{space.digest}, best {best.cid}",
                      extra={"identified": entries, "length_reading": length_reading(space, store, members, steps=steps)})
    store.write_record(rec)
    if ship:
        ship_record(rec, f"identified-{space.task}.json" if space.name == f"{space.task}_identify" else f"{space.name}.json")
    if doc:
        from .experiment import splice_into_doc
        splice_into_doc(doc, *record_block(space, rec))
    return rec


def record_block(space, rec: dict) -> tuple[str, str]:
    """(block name, markdown) of a space's registered record in docs/CALIBRATION.md: a task's record
    (``calibration-record-TASK``), or an identified set's, with a line per member
    (``calibration-record-SPACE``)."""
    if "identified" not in rec:
        return f"calibration-record-{space.task}", _record_md(rec)
    return f"calibration-record-{space.name}", _record_md(rec) + "\n" + "\n".join(
        f"- member {e['cid']}: hard constraints {'held' if e['hard_constraints'] else 'broken'}, "
        f"{sum(bool(r['matched']) for r in e['rows'].values())}/{len(e['rows'])} rows matched, "
        f"distance {e['distance']:.1f}" for e in rec["identified"])


def _record_md(rec: dict) -> str:
    if "identified" in rec:
        verdict = ("every member holds the hard constraints and matches every row" if rec["passes"] else
                   "NOT every member holds the hard constraints and matches every row: the best ones")
    else:
        verdict = "passes every criterion" if rec["passes"] else "NO candidate passes: this is the nearest"
    lines = [f"**Pre-registered {rec['task']} calibration** `{rec['hash']}`, registered {rec['registered_at']} "
             f"({verdict}; "
             f"{rec['note']}).", "",
             f"- task options: `{json.dumps(rec['task_options'], sort_keys=True)}`",
             f"- model options: `{json.dumps(rec['model_options'], sort_keys=True)}`",
             "- measured: " + ", ".join(f"{k} {v:.3f}" for k, v in rec["measured"].items()
                                        if isinstance(v, float))]
    return "\n".join(lines)


def _mapped_rows(rows) -> str:
    """The map's prediction rows as the block names them; none when the task's mapped claims read only
    its difficulty rows (linear ICL's boundary case)."""
    keys = [r.key for r in rows]
    return f"rows {', '.join(keys)}" if keys else "no prediction rows (the claims read the difficulty rows)"


def update_doc(doc, space, store, cands, *, steps=None, figure=None) -> dict[str, str]:
    """Splice a search's generated blocks into ``doc``; returns the robustness and sensitivity blocks
    (by kind), which RESULTS.md's section of the search shows too (``write_sections``)."""
    from .experiment import splice_into_doc
    n = {s: sum(c.status == s for c in cands) for s in ("passes", "fails", "pruned", "infeasible", "interrupted")}
    head = [f"Search space `{space.name}` (digest `{space.digest}`, sampler {space.sampler}, "
            f"{space.first_seeds} then {space.seeds} seeds): {len(cands)} candidates measured: "
            + ", ".join(f"{v} {k}" for k, v in n.items()) + ".", "", "Criteria (the only calibration targets):", "",
            criteria_text(space), "", "Axes: " + "; ".join(f"`{k}` {v}" for k, v in space.axes.items()), ""]
    form = formation_by_axis(cands)
    splice_into_doc(doc, f"calibration-{space.name}", "\n".join(head) + "\n" + candidates_table(
        space, cands, _fades(space, store, cands, steps))
        + (f"\n\nWhen the unforced circuit forms, by axis value (all measured seeds):\n\n{form}" if form else ""))
    if space.identify:
        from ..calibration.identify import identification_block
        splice_into_doc(doc, f"identification-{space.name}", identification_block(space, cands))
    if space.effect:  # exploratory: no verdict of any claim is read from its runs (effect_section shows them)
        return {}
    if space.identify:
        from ..calibration.identify import identified_at
        if not identified_at(space, cands):  # a set never registered has no trajectory rows to map
            return {}
    blocks = {"robustness": robustness_block(space, store, cands, steps=steps)}
    splice_into_doc(doc, f"robustness-{space.name}", blocks["robustness"] + _figure_link(doc, figure))
    if space.identify:
        from ..calibration.robustness import sensitivity_block
        blocks["sensitivity"] = sensitivity_block(space, store, cands, steps=steps)
        splice_into_doc(doc, f"sensitivity-{space.name}", blocks["sensitivity"])
        if length_row(space.task) is not None:  # the paper's length test of the task (associative recall's)
            from ..calibration.identify import length_block
            splice_into_doc(doc, f"length-{space.name}", length_block(space, store, cands, steps=steps))
    return blocks


def _figure_link(doc, figure) -> str:
    if not figure:
        return ""
    import os
    rel = os.path.relpath(Path(figure).resolve(), Path(doc).resolve().parent)
    return f"\n\n![candidates]({Path(rel).as_posix()})"


def robustness_block(space, store, cands, *, steps=None) -> str:
    """The robustness map: per claim, on how many mapped configurations it is reproduced, and the
    verdict on each."""
    counts = claim_counts(space, store, cands, steps=steps)
    m = mapped(space, cands)
    passing = [c for c in cands if c.status == "passes"]
    what = ("the identified set" if space.identify else
            f"{'the passing ones' if passing else 'NO candidate passes: the nearest'}{', nearest ten' if len(passing) > 10 else ''}")
    lines = [f"Mapped configurations: {len(m)} ({what}); "
             f"{_mapped_rows(space_prediction_rows(space))} at {space.seeds} seeds.", "",
             "| claim | predicate | holds in | of measured | per configuration |",
             "|---|---|---|---|---|"]
    mark = {True: "y", False: "n", "inconclusive": "~", None: "?"}
    for cl, yes, tot, res in counts:
        per = ", ".join(f"{c.cid}:{mark[r]}" for c, r in res)
        pred = " and ".join(k.describe() for k in cl.conditions)
        lines.append(f"| {cl.statement} | {pred} | {yes} | {tot} | {per} |")
    lines += ["", "y: reproduced on that configuration (every condition's 95% interval over its seeds on its side), "
              "n: not, ~: inconclusive, ?: not measured (`softprior.claims`)."]
    return "\n".join(lines)


def write_sections(space, source, cands, out, blocks: dict, *, steps=None) -> Path | None:
    """What docs/RESULTS.md shows of a search (``paper.search_sections`` reads it from the results): an
    identification search's ``identified.md`` (``identify.results_section``, with the robustness and
    sensitivity ``blocks`` that ``update_doc`` spliced), an effect search's ``effect.md``
    (``effect_section``). None for other searches, or before there is anything to show."""
    if space.identify:
        from ..calibration.identify import results_section
        text, name = results_section(space, source, cands, blocks.get("robustness", ""),
                                     blocks.get("sensitivity", ""), steps=steps), "identified.md"
    elif space.effect:
        text, name = effect_section(space, cands), "effect.md"
    else:
        return None
    if not text:
        return None
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip() + "\n")
    return path


# model fields that a run whose gates are all forced never reads: its gate logits are masked (the
# initial value, and how many there are, change no forward pass and no update)
MASKED_GATE_INERT = ("gate_logit_init", "gate_granularity")


def trajectory_key(c) -> str:
    """What a candidate's masked-gate runs (the fade, forced_zero, the hard switch) are trained from: its
    model config as a run id sees it (``ModelConfig``: a cap on a prior that has none is dropped) less
    ``MASKED_GATE_INERT``, and its task options; candidates with one key train identical trajectory runs."""
    from ..model.config import ModelConfig
    m = ModelConfig(**c.model_options).model_dump(mode="json")
    return json.dumps([c.task_options, {k: v for k, v in m.items() if k not in MASKED_GATE_INERT}], sort_keys=True)


def effect_section(space, cands, top: int = 8) -> str:
    """The exploratory search for where the trajectory effect lives, for docs/RESULTS.md: the
    candidates with the largest effect (fade600 zero minus the larger of forced_zero and hard_switch600
    zero, means over their seeds) and the identification rows those runs also measure, beside the
    paper's values. Exploratory: none of these runs enters a verdict table."""
    from ..tiers import rows_for
    from ..calibration.criteria import EFFECT_PATHS, trajectory_effect
    keys = [f"{p}|zero" for p in EFFECT_PATHS]
    done = [c for c in cands if all(k in c.means for k in keys)]
    if not done:
        return ""
    groups: dict[str, list] = {}  # candidates whose trajectory runs cannot differ: one effect
    for c in sorted(done, key=lambda c: (-c.n_seeds, -trajectory_effect(c.means), c.cid)):  # most seeds first
        groups.setdefault(trajectory_key(c), []).append(c)
    groups = dict(sorted(groups.items(), key=lambda kv: (-trajectory_effect(kv[1][0].means), kv[1][0].cid)))
    paper = {(r.source, r.read): r for r in rows_for(space.task) if r.model == space.model}
    u_n, u_z = paper.get(("unforced", "normal")), paper.get(("unforced", "zero"))
    pat = {r.source: r.paper for r in rows_for(space.task, "trajectory") + rows_for(space.task)
           if r.model == space.model and r.source in EFFECT_PATHS and r.read == "zero" and r.paper is not None}
    big = [g for g in groups.values() if any(trajectory_effect(c.means) >= 0.15 and c.checks.get("unforced zero per seed", False)
                                             for c in g)]
    lines = ["## Where the effect lives (exploratory, ours)", "",
             f"Search space `{space.name}` (digest `{space.digest}`): the same choices as the identification search, "
             f"searched for the trajectory effect itself: fade600 zero minus the larger of forced_zero zero and "
             f"hard_switch600 zero, the unforced model relying on its prior (zero gate at most .15 on every seed). "
             f"{len(done)} candidates measured ({sum(c.n_seeds >= space.seeds for c in done)} on {space.seeds} seeds), "
             f"{len(groups)} distinct trajectories: candidates that differ only in "
             f"{' and '.join(MASKED_GATE_INERT)} train the same fade, forced_zero and hard-switch runs (their gates are "
             f"forced, the logit never read), so they count as one effect; {len(big)} show an effect of at least .15 "
             "with the unforced model relying on its prior. These runs "
             "are exploratory: no record covers them and none enters a verdict table. The paper's pattern: fade600 zero "
             f"{pat['fade600']:g} against forced_zero {pat['forced_zero']:g} and hard_switch600 {pat['hard_switch600']:g} "
             f"(an effect of {pat['fade600'] - max(pat['forced_zero'], pat['hard_switch600']):.3f}).", "",
             f"The {min(top, len(groups))} largest effects (means over the seeds measured; the candidates sharing "
             "each one's trajectory runs listed with it), with the identification "
             "rows these runs also measure beside the paper's values "
             f"(unforced normal {u_n.paper if u_n else '-'}, unforced zero {u_z.paper if u_z else '-'}):", "",
             "| id | seeds | effect | fade600 zero | forced_zero zero | hard_switch600 zero | unforced normal | "
             "unforced zero | candidate |", "|---|---|---|---|---|---|---|---|---|"]
    for g in list(groups.values())[:top]:
        c, m = g[0], g[0].means
        lines.append(f"| {', '.join(x.cid for x in g)} | {c.n_seeds} | {trajectory_effect(m):+.3f} | " + " | ".join(
            f"{m[k]:.3f}" for k in keys) + f" | {m.get('unforced|normal', float('nan')):.3f} | "
            f"{m.get('unforced|zero', float('nan')):.3f} | {c.label} |")
    return "\n".join(lines)


def _fades(space, store, cands, steps):
    from ..calibration.robustness import fade_points
    f = fade_points(space, store, cands, steps=steps)
    return f or None


# ---------------------------------------------------------------- from a source (a store or a results bundle)
def write_calibration(doc, source, space, out, *, steps=None) -> bool:
    """Every generated block of ``space`` in ``doc`` (its registered record, the candidates, the
    robustness map) and its outputs under ``out`` (candidates.md, .json, .png), from a source: a run
    store (its Optuna study, records and runs) or a results bundle (``softprior.bundle``), which gives
    back what was recorded when the same function ran on the store. False, writing nothing, for a
    space never searched."""
    from dataclasses import asdict

    from ..bundle import ask
    from ..preregistration import verify_record
    from .calibration import write_outputs
    from ..calibration.robustness import fade_points
    from ..calibration.search import Candidate, load_candidates
    cands = ask(source, "calibration_candidates", {"space": space.name, "digest": space.digest},
                lambda: load_candidates(space, source), encode=lambda cs: [asdict(c) for c in cs],
                decode=lambda ds: [Candidate(**d) for d in ds])
    if not cands:
        return False
    where = f"{getattr(source, 'root', 'the source')} (the record of search space {space.name})"
    rec = ask(source, "calibration_record", {"space": space.name, "digest": space.digest},
              lambda: registered_record(source, space), decode=lambda r: verify_record(r, where) if r else None)
    fade = fade_points(space, source, cands, steps=steps) or None
    files = write_outputs(space, cands, Path(out), fade)
    if rec is not None:
        from .experiment import splice_into_doc
        splice_into_doc(doc, *record_block(space, rec))
    blocks = update_doc(doc, space, source, cands, steps=steps, figure=files.get("figure"))
    write_sections(space, source, cands, out, blocks, steps=steps)
    return True


def registered_record(store, space) -> dict | None:
    """The record registered last for ``space`` (its name and digest) in the store, or None."""
    recs = [r for r in store.calibration_records() if r.get("space") == space.name
            and r.get("space_digest") == space.digest]
    return max(recs, key=lambda r: (r.get("registered_at", ""), r["hash"])) if recs else None
