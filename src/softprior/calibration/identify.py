"""Identification: which candidate models match the paper's static numbers (``softprior.tiers``).

A candidate of an identification search (``SearchSpace.identify``) is measured on every identification
row a base run can give (``PaperRow.search``). For each row, its distance from the paper is
z = |mean - paper| / scale (the paper's spread, at least one validation standard error, or a stated
tolerance: ``PaperRow.scale``); the row is *matched* when z <= ``tiers.MATCH_Z``. The per-seed
difficulty criteria stay hard constraints. The candidate's search distance is the sum of its z's.

The *identified set* (``identified``) is declared before any trajectory row runs on it: every candidate
measured on all of the space's seeds that holds the hard constraints on every seed and matches every
row; if fewer than ``MIN_SET`` do, the ``MIN_SET`` best (hard constraints first, then the most rows
matched, then the smallest distance), so the trajectory claims are decided on a set of models rather
than on one.
"""

from __future__ import annotations

import json
import math

from ..cells import LENGTH_VARIANTS, length_view
from ..tiers import MATCH_Z, length_row, rows_for
from .search import REGISTER_SEEDS, completed_file, with_completed

__all__ = ["row_values", "matched_rows", "hard_ok", "identified", "identified_at",
           "identified_set", "identification_block", "complete", "length_reading", "member_table", "results_section", "member_entry", "conflicts"]



def _crit(space):
    return [c for c in space.criteria() if c.scale is not None]


def row_values(space, cand) -> dict[str, list[float]]:
    """Per identification row (by name): the candidate's per-seed values."""
    return {c.name: cand.values.get(f"{c.row.key}|{c.gates}", []) for c in _crit(space)}


def _checks(space, cand) -> dict:
    """Per identification row: its criterion's result on the candidate's values (``Criterion.check``:
    ok when the mean lies within MATCH_Z units of the row's scale, gap the distance in those units), or
    None if not measured."""
    vals = row_values(space, cand)
    return {c.name: c.check(vals[c.name]) if vals[c.name] else None for c in _crit(space)}


def matched_rows(space, cand) -> dict[str, bool | None]:
    """Per identification row: matched (mean within MATCH_Z of its scale), or None if not measured."""
    return {n: None if r is None else r.ok for n, r in _checks(space, cand).items()}


def hard_ok(space, cand) -> bool:
    """Every per-seed difficulty criterion holds on every measured seed."""
    return all(cand.checks.get(c.name, False) for c in space.criteria() if c.scale is None)


def _rank(space, cand):
    m = matched_rows(space, cand)
    d = cand.distance if not math.isnan(cand.distance) else math.inf
    return (not hard_ok(space, cand), -sum(bool(x) for x in m.values()), d, cand.cid)


def seeds_held(space, cand) -> float:
    """The share of a candidate's measured seeds on which every per-seed difficulty constraint holds
    (a candidate broken on one seed of five is nearer than one that never learns)."""
    hard = [c for c in space.criteria() if c.scale is None]
    per = [cand.values.get(f"{c.row.key}|{c.gates}", []) for c in hard]
    n = min((len(v) for v in per), default=0)
    if not n:
        return 0.0
    return sum(all(c.check([v[i]]).ok for c, v in zip(hard, per)) for i in range(n)) / n


def identified(space, cands, k: int | None = None) -> list:
    """The identified set (module docstring), best first: candidates measured on every seed only; ``k``
    (default the space's ``min_set``, ``MIN_SET`` unless it says) is the least it holds."""
    k = space.min_set if k is None else k
    full = [c for c in cands if c.n_seeds >= space.seeds and c.status in ("passes", "fails")]
    ranked = sorted(full, key=lambda c: _rank(space, c))
    passing = [c for c in ranked if hard_ok(space, c) and all(matched_rows(space, c).values())]
    return passing if len(passing) >= k else ranked[:k]


def identified_set(space, cands) -> list:
    """The identified set as it stands: over the five-seed measurements once any exist (registration),
    else over the search's own seeds."""
    return identified_at(space, cands) or identified(space, cands)


def _paper(r) -> str:
    if r.spread is not None:
        return f"{r.paper:g} ± {r.spread:g}"
    return f"{r.paper:g}" if r.paper is not None else "-"


def identification_block(space, cands, top: int = 30) -> str:
    """Markdown for docs/CALIBRATION.md: the rows, the paper's values and scales, then per candidate
    (best first, at most ``top``; the rest are in candidates.json) the measured mean of every row,
    marked where it is matched."""
    rows = [r for r in rows_for(space.task) if r.model == space.model or r.read == "params"]
    crit = {c.name: c for c in _crit(space)}
    lines = [f"Identification rows of `{space.task}` (`src/softprior/tiers.py`; a row is matched within "
             f"{MATCH_Z:g} units of its scale):", "",
             "| row | paper | scale | where | why identification | measured on every candidate |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {_paper(r)} | {r.scale:g} | {r.where} | {r.reason} | "
                     f"{'yes' if r.name in crit else 'on the identified set'} |")
    names = list(crit)
    measured = [c for c in cands if c.status in ("passes", "fails", "pruned")]
    ranked = sorted(measured, key=lambda c: _rank(space, c))
    ids = {c.cid for c in identified_set(space, cands)}
    lines += ["", f"{len(measured)} candidates measured; the {min(top, len(ranked))} best "
              "(per-seed difficulty constraints held first, then rows matched, then distance). "
              "A value in bold is matched; * marks the identified set.", "",
              "| id | seeds | hard constraints | matched | distance | " + " | ".join(names) + " | candidate |",
              "|" + "---|" * (len(names) + 6)]
    for c in ranked[:top]:
        m = matched_rows(space, c)
        vals = row_values(space, c)
        cells = []
        for n in names:
            v = vals[n]
            s = "-" if not v else f"{sum(v) / len(v):.3f}"
            cells.append(f"**{s}**" if m[n] else s)
        lines.append(f"| {c.cid}{'*' if c.cid in ids else ''} | {c.n_seeds} | {'held' if hard_ok(space, c) else 'broken'} "
                     f"| {sum(bool(x) for x in m.values())}/{len(names)} | {c.distance:.1f} | " + " | ".join(cells)
                     + f" | {c.label} |")
    clash = [(a, b, na, nb) for a, b, na, nb, both in conflicts(space, cands) if na and nb and not both]
    if clash:
        lines += ["", "Rows in conflict within the searched family so far: each matched by some measured "
                  "candidates, never both by one:", ""]
        lines += [f"- {a} ({na} candidates) and {b} ({nb})" for a, b, na, nb in clash]
    return "\n".join(lines)


def conflicts(space, cands) -> list[tuple[str, str, int, int, int]]:
    """Pairs of rows that the measured candidates rarely match together: (row a, row b, matched a,
    matched b, matched both), over every measured candidate. Two rows each matched by some candidates
    but never together are in conflict within the searched family."""
    ok = [c for c in cands if c.status in ("passes", "fails", "pruned")]
    ms = [matched_rows(space, c) for c in ok]
    names = [c.name for c in _crit(space)]
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            na = sum(bool(m[a]) for m in ms)
            nb = sum(bool(m[b]) for m in ms)
            both = sum(bool(m[a]) and bool(m[b]) for m in ms)
            out.append((a, b, na, nb, both))
    return out


def complete(space, store, cands, *, k: int | None = None, steps=None, log=print, **execute_kw) -> list:
    """Measure the best candidates (ranked on the seeds the search measured them on: three, or one if it
    pruned them) on ``REGISTER_SEEDS`` seeds until ``k``
    of them hold the hard constraints on all five, or no candidate is left that holds them on the seeds
    measured so far (one broken seed already rules out five). A candidate that three seeds put near the
    top but five do not (a rare failure three cannot see) drops out, and the next is measured. If fewer
    than ``k`` are then measured on five seeds, the least broken of the rest (``seeds_held``, then the
    rank) fill them up to ``k``: the identified set is the ``k`` best measured on five seeds
    (``identified``). Resumable: the measurements are kept beside the study."""
    from ..executors.sweep import execute
    from .search import candidate_configs, keep_measurements
    seeds = list(range(REGISTER_SEEDS))
    k = space.min_set if k is None else k
    f = completed_file(space, store)
    tried: set[str] = set()
    while True:
        cands = with_completed(space, store, cands)
        pool = sorted([c for c in cands if c.status in ("passes", "fails", "pruned")], key=lambda c: _rank(space, c))
        held = [c for c in pool if c.n_seeds >= REGISTER_SEEDS and hard_ok(space, c)]
        todo = [c for c in pool if c.n_seeds < REGISTER_SEEDS and hard_ok(space, c) and c.cid not in tried]
        todo = todo[:max(0, k - len(held))]
        if not todo:  # none left that can hold on five: the least broken fill the set up to k (``identified``)
            full = sum(c.n_seeds >= REGISTER_SEEDS for c in pool)
            rest = sorted([c for c in pool if c.n_seeds < REGISTER_SEEDS and c.cid not in tried],
                          key=lambda c: (-seeds_held(space, c), _rank(space, c)))
            todo = rest[:max(0, k - full)]
        if not todo:
            return cands
        tried |= {c.cid for c in todo}  # a candidate whose runs failed is not measured again and again
        log(f"identify: measuring {len(todo)} candidate(s) on {REGISTER_SEEDS} seeds: {', '.join(c.cid for c in todo)}")
        cfgs = [cfg for c in todo for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, seeds,
                                                                    steps=steps)]
        execute(cfgs, store, require_calibration=False, **execute_kw)
        keep_measurements(space, store, f, todo, seeds, steps)


def identified_at(space, cands, k: int | None = None) -> list:
    """``identified`` over the candidates measured on ``REGISTER_SEEDS`` seeds only."""
    return identified(space.model_copy(update={"seeds": REGISTER_SEEDS}), cands, k)


def member_entry(space, c) -> dict:
    """What a record keeps of one member of the identified set: its options, per row its per-seed values,
    mean, z and whether it matched, and whether the hard constraints held."""
    vals = row_values(space, c)
    rows = {n: {"values": vals[n], "mean": None if r is None else r.mean, "z": None if r is None else r.gap,
                "matched": None if r is None else r.ok} for n, r in _checks(space, c).items()}
    return {"cid": c.cid, "task_options": c.task_options,
            "model_options": {k: list(v) if isinstance(v, tuple) else v for k, v in c.model_options.items()},
            "hard_constraints": hard_ok(space, c), "distance": c.distance, "rows": rows}




def length_variants(store, cfg, length: int = 120) -> dict[str, tuple[float, float]]:
    """A stored unforced run at ``length`` under each of ``LENGTH_VARIANTS``: (accuracy, Bayes ceiling)."""
    from ..tasks.generators import make_task
    from ..training.loop import evaluate
    _, model = store.load_model(cfg.run_id)
    out = {}
    for name in LENGTH_VARIANTS:
        view, model = length_view(cfg, model, name, length)
        task = make_task(view.task)
        val = view.validation_batch(task, length=length)
        out[name] = (float(evaluate(model, task, val.inputs, val.targets)["acc"]), view.task.ceiling())
    return out


def length_means(space, store, c, seeds: int = 3, steps=None) -> dict[str, tuple[float, float]] | None:
    """One candidate's unforced runs at T = 120 under each of ``LENGTH_VARIANTS``: (mean accuracy over
    the seeds stored, Bayes ceiling); None if none is stored, or if the paper gives the task no length
    test (Markov: nothing is read)."""
    if length_row(space.task) is None:
        return None
    from .search import candidate_configs
    from .criteria import Row
    from ..bundle import ask
    got = [{n: tuple(v) for n, v in ask(store, "length_variants", {"run_id": cfg.run_id},
                                        lambda cfg=cfg: length_variants(store, cfg)).items()}
           for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, range(seeds),
                                             rows=[Row(path="unforced")], steps=steps) if store.is_done(cfg.run_id)]
    if not got:
        return None
    return {n: (sum(g[n][0] for g in got) / len(got), got[0][n][1]) for n in LENGTH_VARIANTS}


def length_reading(space, store, members, seeds: int = 3, steps=None) -> dict:
    """Which reading of the paper's length test (soft_bias at T = 120: .263) the identified set supports:
    per reading, the mean over the members of their unforced accuracy at T = 120, and the reading
    nearest the paper's value. An identification row only (the same weights read three ways), decided
    at registration and kept in the record; nothing is trained under it. Empty where the paper has no
    length test of the task (Markov: none)."""
    return _reading(space, [length_means(space, store, c, seeds, steps) for c in members])


def _reading(space, per: list) -> dict:
    """``length_reading`` from the members' ``length_means`` (None where nothing is stored)."""
    row = length_row(space.task)
    paper = row.paper if row is not None else None
    per = [m for m in per if m] if paper is not None else []
    if not per:
        return {}
    means = {n: round(sum(m[n][0] for m in per) / len(per), 4) for n in LENGTH_VARIANTS}
    return {"paper": paper, "members": len(per), "means": means,
            "chosen": min(LENGTH_VARIANTS, key=lambda n: abs(means[n] - paper))}


def length_block(space, store, cands, seeds: int = 3, steps=None) -> str:
    """The identified set's unforced runs at T = 120 under each length reading, beside the paper's .263."""
    members = identified_set(space, cands)
    which = "The identified set's"
    if not members:  # before any candidate is measured on every seed: the best ranked so far, on their seeds
        members = sorted([c for c in cands if c.status in ("passes", "fails", "pruned")], key=lambda c: _rank(space, c))
        members, which = members[:space.min_set], f"No identified set yet; the {min(space.min_set, len(members))} best ranked so far:"
    lines = [f"{which} unforced runs at T = 120, read three ways (the same weights; the paper: "
             "soft_bias .263). Accuracy, mean over the seeds measured, and the task's Bayes ceiling at that length.",
             "", "| id | " + " | ".join(LENGTH_VARIANTS) + " |", "|---|" + "---|" * len(LENGTH_VARIANTS)]
    for c in members:
        got = length_means(space, store, c, seeds, steps)
        if got:
            lines.append(f"| {c.cid} | " + " | ".join(f"{got[n][0]:.3f} (ceiling {got[n][1]:.3f})"
                                                       for n in LENGTH_VARIANTS) + " |")
    return "\n".join(lines)


def member_table(space, c) -> str:
    """One configuration's identification rows beside the paper's values: the mean over its seeds,
    the distance in units of the row's scale, matched or not."""
    rows = {r.name: r for r in rows_for(space.task)}
    vals = row_values(space, c)
    lines = ["| identification row | paper | measured (seeds) | distance (scale) | matched |", "|---|---|---|---|---|"]
    for n, r in _checks(space, c).items():
        paper = _paper(rows[n]) if n in rows else "-"
        if r is None:
            lines.append(f"| {n} | {paper} | not measured | - | - |")
            continue
        scale = f"{rows[n].scale:g}" if n in rows else "bound"
        lines.append(f"| {n} | {paper} | {r.mean:.3f} ({len(vals[n])}) | {r.gap:.1f} ({scale}) | "
                     f"{'yes' if r.ok else '**no**'} |")
    return "\n".join(lines)


def results_section(space, store, cands, robustness: str, sensitivity: str, steps=None) -> str:
    """The identification round for docs/RESULTS.md (written beside the search's outputs as
    ``identified.md``): the best identified configuration's rows beside the paper's, the length test
    read three ways, the robustness map over the identified set and the sensitivity table."""
    members = identified_set(space, cands)
    if not members:
        return ""
    best = members[0]
    five = bool(identified_at(space, cands))
    own = (f"The identified model of `{space.task}`" if space.name == f"{space.task}_identify"
           else f"The identified set of `{space.name}`")
    title = own if five else f"A further identification search, `{space.name}` (not registered)"
    lines = [f"## {title} (ours: `docs/CALIBRATION.md`, \"Identification\")", "",
             f"Search space `{space.name}` (digest `{space.digest}`): {sum(c.status != 'infeasible' for c in cands)} "
             f"candidates measured; the identified set is {len(members)} configurations"
             f"{' measured on five seeds' if five else ' (not yet measured on five seeds: not registered)'}. "
             "Every identification row of the best one beside the paper's value (`src/softprior/tiers.py`):", "",
             f"Best identified configuration `{best.cid}`: {best.label}.", "", member_table(space, best), ""]
    per = [length_means(space, store, c, steps=steps) for c in members]  # each member's runs read once
    lm = per[0]
    if lm:
        lines += ["The row at T = 120 reads B^pos clipped past the training length. Its unforced runs under each "
                  "reading of the length test (the same weights; the paper: soft_bias .263): "
                  + "; ".join(f"{n} {a:.3f} (ceiling {ceil:.3f})" for n, (a, ceil) in lm.items()) + "."]
        lr = _reading(space, per)
        if lr:
            lines += [f"Over the identified set ({lr['members']} configurations) the readings average "
                      + ", ".join(f"{n} {v:.3f}" for n, v in lr["means"].items())
                      + f"; the nearest the paper's, \"{lr['chosen']}\", is the reading "
                      + ("the record states." if five else "a record of this set would state.")]
        lines.append("")
    if five:  # a set not registered has no trajectory row to show (the store refuses them)
        lines += ["### The trajectory claims on every identified configuration", "", robustness, "",
                  "### Sensitivity", "", sensitivity, "",
                  "A marginal view over the identified set, not a factorial design: an axis value held by few "
                  "configurations says little.", ""]
    return "\n".join(lines)
