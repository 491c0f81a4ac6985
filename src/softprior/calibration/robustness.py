"""The robustness map: the paper's prediction rows on every candidate that passes the difficulty
criteria (or the ten nearest, if more pass), and per claim the number of passing configurations in
which it is reproduced. Run only after the search's choice is pre-registered: the map is a
prediction, it never feeds back into the choice.

The claims are the paper's own declaration (``softprior.claims.CLAIMS``, those marked ``map``),
decided on each candidate exactly as the verdicts are (intervals over the candidate's seeds); the
rows a candidate trains are the base-model rows those claims read (``Cond.as_row``).

Also trains fade600->0 at seed 0 on every other measured candidate, for the figure (difficulty
distance against fade600 zero-gate accuracy).
"""

from __future__ import annotations

import json
import math

from ..claims import NOT_APPLICABLE, claims_for_task, verdicts
from .criteria import Row, difficulty_rows
from ..store.record_clock import store_records
from .search import candidate_configs, ceiling

__all__ = ["prediction_rows", "space_prediction_rows", "run_robustness", "claim_counts", "fade_row", "claim_rows"]


# On an identified set the map decides every claim whose cells are base-model training rows; these two
# (five fade starts, five shapes) on the best three configurations only (``TOP_WIDE``)
WIDE = ("fade window", "fade shapes")
TOP_WIDE = 3


def map_claims(task: str, identify: bool = False, wide: bool = False) -> list:
    """The claims the map decides: those marked ``map`` (a difficulty search); on an identified set,
    every claim all of whose cells are base-model rows (``Cond.as_row``), less ``WIDE`` unless ``wide``."""
    if not identify:
        return claims_for_task(task)
    return [cl for cl in claims_for_task(task, mapped_only=False)
            if all(c.as_row() for c in cl.conditions) and (wide or cl.name not in WIDE)]


def claim_rows(task: str, identify: bool = False, wide: bool = False) -> list[Row]:
    """Every base-model row the map's claims about ``task`` read, in declaration order."""
    out: list[Row] = []
    for cl in map_claims(task, identify, wide):
        for cond in cl.conditions:
            for path, opts, _ in cond.as_row() or []:
                r = Row(path=path, task=opts)
                if r not in out:
                    out.append(r)
    return out


def prediction_rows(task: str, identify: bool = False, wide: bool = False, searched=()) -> list[Row]:
    """The rows the map trains: those the claims read that the search did not train (its rows: the
    task's difficulty rows, and ``searched``, the rows a search space declares itself, such as Markov's
    forced_zero at every p). None for a task the paper's claims are not about (a plugin's: ``softprior
    study`` declares its own)."""
    rows = claim_rows(task, identify, wide)
    if not rows:
        return []
    diff = difficulty_rows(task, identify) + list(searched)
    return [r for r in rows if r not in diff]


def space_prediction_rows(space, wide: bool = False) -> list[Row]:
    """``prediction_rows`` of a search space: its task's, less (in an identification search) the rows the
    space itself measures, which are identification rows there. An exploratory search (the effect
    search) measures trajectory rows, and its map still counts them."""
    return prediction_rows(space.task, space.identify, wide, searched=space.rows() if space.identify else ())


def fade_row(task: str) -> Row:
    """The fade600 row that stands for a configuration of ``task`` (its fade point): at the task's
    ``Task.row_options`` (Markov: p = .5; none by default)."""
    from ..tasks.registry import task_spec
    options = task_spec(task).task_class().row_options
    return Row(path="fade600", task=dict(options)) if options else Row(path="fade600")


def mapped(space, cands, limit: int = 10):
    """The configurations the map covers: an identification search's identified set; else the passing
    candidates (nearest ``limit``); if none passes,
    those measured on every seed (the nearest, completed before registration), nearest first. A
    distance measured on one seed is not comparable with one on three, so pruned candidates are not
    mapped. Two spellings of one configuration are mapped once."""
    from ..preregistration import calibration_key
    if space.identify:  # the identified set (declared in identify.py), best first, all of it
        from .identify import identified_set
        pool = identified_set(space, cands)
        limit = len(pool)
    else:
        pool = (sorted([c for c in cands if c.status == "passes"], key=lambda c: c.distance)
                or sorted([c for c in cands if c.status == "fails" and not math.isnan(c.distance)],
                          key=lambda c: (c.distance, c.cid)))
    out, seen = [], set()
    for c in pool:
        (_, _, cfg), *_ = candidate_configs(space, c.task_options, c.model_options, [0])
        key = calibration_key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:limit]


def run_robustness(space, store, cands, *, executor="local", workers=1, group_size=6, progress=True,
                   steps: int | None = None, all_fade: bool = True, wide: int = TOP_WIDE):
    """Train the map's rows (an identified set's ``wide`` best configurations also the fade's other
    starts and shapes). Refuses unless a calibration record of this space is registered."""
    from ..executors.sweep import execute
    from ..preregistration import CalibrationMissing
    if not any(r.get("space_digest") == space.digest for r in store_records(store.root)):
        raise CalibrationMissing(f"no calibration record of space {space.name!r} is registered in "
                                 f"{str(store.root)!r}: run `softprior calibrate {space.task} --register` first")
    seeds = list(range(space.seeds))
    cfgs = []
    for i, c in enumerate(mapped(space, cands)):
        rows = space_prediction_rows(space, wide=space.identify and i < wide)
        cfgs += [cfg for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, seeds,
                                                        rows=rows, steps=steps)]
    if all_fade and not space.identify:  # an identified set trains no trajectory row outside it
        for c in cands:
            if c.status != "infeasible":
                cfgs += [cfg for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, [0],
                                                                rows=[fade_row(space.task)], steps=steps)]
    return execute(cfgs, store, executor=executor, workers=workers, group_size=group_size, progress=progress,
                   sweep_bar=progress, require_calibration=False)


def _values(space, store, c, seeds, rows, steps) -> dict[str, list[float]]:
    """"row key|gates" -> per-seed values of a candidate's stored rows (complete rows only)."""
    out = {}
    for row, s, cfg in candidate_configs(space, c.task_options, c.model_options, seeds, rows=rows, steps=steps):
        if not store.is_done(cfg.run_id):
            continue
        sm = store.summary(cfg.run_id)
        for g in ("normal", "zero"):
            out.setdefault(f"{row.key}|{g}", []).append(sm[f"{g}_{sm['metric']}"])
    return {k: v for k, v in out.items() if len(v) == len(seeds)}


def candidate_tables(space, c, values: dict[str, list[float]]) -> dict:
    """The mapped claims' cells for one candidate, in the shape ``claims.verdicts`` reads
    (experiment -> (row, column[, key]) -> value), from its per-seed values."""
    tables: dict = {}
    for cl in map_claims(space.task, space.identify, wide=True):
        for cond in cl.conditions:
            cells = [(cond.row, cond.column)] + ([cond.other] if cond.other else [])
            for (rname, col), (path, opts, gates) in zip(cells, cond.as_row() or []):
                row = Row(path=path, task=opts)
                vals = values.get(f"{row.key}|{gates}")
                if not vals:
                    continue
                t = tables.setdefault(cond.experiment, {})
                t[(rname, col)] = sum(vals) / len(vals)
                t[(rname, col, "values")] = list(vals)
                t[(rname, col, "n")] = float(len(vals))
                t[(rname, col, "ceiling")] = ceiling(space, c.task_options, c.model_options, row)[0]
    return tables


def claim_counts(space, store, cands, steps: int | None = None):
    """[(claim, reproduced_in, measured_in, per-candidate verdicts)] over the mapped candidates; a
    per-candidate verdict is True (reproduced), False (any other decided verdict), "inconclusive",
    or None (not measured)."""
    seeds = list(range(space.seeds))
    claims = map_claims(space.task, space.identify, wide=True)
    names = {cl.name for cl in claims}
    per = []
    for c in mapped(space, cands):
        vals = _values(space, store, c, seeds, claim_rows(space.task, space.identify, wide=True), steps)
        for k, v in (c.values or {}).items():  # the search's own measurements of the difficulty rows
            if len(v) == len(seeds):
                vals.setdefault(k, list(v))
        per.append((c, {cl.name: v for cl, v, _ in verdicts(candidate_tables(space, c, vals)) if cl.name in names}))
    out = []
    for cl in claims:
        res = []
        for c, vs in per:
            v = vs[cl.name]
            res.append((c, None if v in ("not measured", NOT_APPLICABLE) else True if v == "reproduced"
                        else "inconclusive" if v.startswith("inconclusive") else False))
        out.append((cl, sum(r is True for _, r in res), sum(r is not None for _, r in res), res))
    return out


def fade_points(space, store, cands, steps: int | None = None) -> dict[int, float]:
    """Candidate id -> fade600 zero-gate metric at seed 0 (where trained)."""
    out = {}
    for c in cands:
        if c.status == "infeasible":
            continue
        (_, _, cfg), = candidate_configs(space, c.task_options, c.model_options, [0], rows=[fade_row(space.task)],
                                         steps=steps)
        if store.is_done(cfg.run_id):
            sm = store.summary(cfg.run_id)
            out[c.cid] = sm[f"zero_{sm['metric']}"]
    return out


def sensitivity_block(space, store, cands, claim: str = "fade keeps (base)", steps=None) -> str:
    """For each value of each axis, the share of the identified configurations on which ``claim`` is
    reproduced (its interval over seeds above the threshold: a fade keeping at least .77 x ceiling), of
    those on which it was decided. A marginal view over a set of ten-odd configurations, not a factorial
    design: say so beside it."""
    res = next((r for cl, _, _, r in claim_counts(space, store, cands, steps=steps) if cl.name == claim), [])
    if not res:
        return f"No identified configuration has claim {claim!r} measured yet."
    by: dict[str, dict[str, list]] = {}
    for c, verdict in res:
        for axis, label in c.params.items():
            by.setdefault(axis.split(".", 1)[1], {}).setdefault(label, []).append(verdict)
    lines = [f"Claim \"{claim}\" on the {len(res)} identified configurations, by axis value: reproduced / "
             "decided (y), inconclusive (~), not measured (?).", "",
             "| axis | value: reproduced of decided (inconclusive, not measured) |", "|---|---|"]
    for axis, vals in sorted(by.items()):
        cells = []
        for label, vs in sorted(vals.items()):
            dec = [v for v in vs if v in (True, False)]
            cells.append(f"{json.loads(label)}: {sum(v is True for v in dec)}/{len(dec)}"
                         + (f" (~{sum(v == 'inconclusive' for v in vs)}, ?{sum(v is None for v in vs)})"
                            if len(dec) < len(vs) else ""))
        lines.append(f"| {axis} | {'; '.join(cells)} |")
    return "\n".join(lines)

