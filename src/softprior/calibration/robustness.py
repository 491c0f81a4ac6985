"""The robustness map (issue 14): the paper's prediction rows on every candidate that passes the
difficulty criteria (or the ten nearest, if more pass), and per claim the number of passing
configurations in which it holds. Run only after the search's choice is pre-registered: the map is a
prediction, it never feeds back into the choice.

Also trains fade600->0 at seed 0 on every other measured candidate, for the figure (difficulty
distance against fade600 zero-gate accuracy).
"""

from __future__ import annotations

import math

from .criteria import Row, claims_for
from .record import store_records
from .search import candidate_configs

__all__ = ["prediction_rows", "run_robustness", "claim_counts", "fade_row"]

_PRED = {"assoc_recall": ["fade600", "hard_switch1050", "posthoc", "linear0.5->0"],
         "markov": ["fade600"], "linear_icl": ["fade600"]}
_MARKOV_P = (0.2, 0.5, 0.8)


def prediction_rows(task: str) -> list[Row]:
    if task == "markov":
        return [Row(path=p, task={"p": q}) for p in _PRED[task] for q in _MARKOV_P]
    return [Row(path=p) for p in _PRED[task]]


def fade_row(task: str) -> Row:
    return Row(path="fade600", task={"p": 0.5}) if task == "markov" else Row(path="fade600")


def mapped(space, cands, limit: int = 10):
    """The configurations the map covers: the passing candidates (nearest ``limit``); if none passes,
    those measured on every seed (the nearest, completed before registration), nearest first. A
    distance measured on one seed is not comparable with one on three, so pruned candidates are not
    mapped. Two spellings of one configuration are mapped once."""
    from .record import calibration_key
    passing = sorted([c for c in cands if c.status == "passes"], key=lambda c: c.distance)
    pool = passing or sorted([c for c in cands if c.status == "fails" and not math.isnan(c.distance)],
                             key=lambda c: (c.distance, c.cid))
    out, seen = [], set()
    for c in pool:
        (_, _, cfg), *_ = candidate_configs(space, c.task_options, c.model_options, [0])
        key = calibration_key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:limit]


def run_robustness(space, store, cands, *, executor="local", workers=1, group_size=6, progress=True,
                   steps: int | None = None, all_fade: bool = True):
    """Train the map's rows. Refuses unless a calibration record of this space is registered."""
    from ..executors import execute
    from .record import CalibrationMissing
    if not any(r.get("space_digest") == space.digest for r in store_records(store.root)):
        raise CalibrationMissing(f"no calibration record of space {space.name!r} is registered in "
                                 f"{str(store.root)!r}: run `softprior calibrate {space.task} --register` first")
    seeds = list(range(space.seeds))
    cfgs = []
    for c in mapped(space, cands):
        cfgs += [cfg for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, seeds,
                                                        rows=prediction_rows(space.task), steps=steps)]
    if all_fade:
        for c in cands:
            if c.status != "infeasible":
                cfgs += [cfg for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, [0],
                                                                rows=[fade_row(space.task)], steps=steps)]
    return execute(cfgs, store, executor=executor, workers=workers, group_size=group_size, progress=progress,
                   sweep_bar=progress, require_calibration=False)


def _means(space, store, c, seeds, rows, steps):
    out = {}
    for row, s, cfg in candidate_configs(space, c.task_options, c.model_options, seeds, rows=rows, steps=steps):
        if not store.is_done(cfg.run_id):
            continue
        sm = store.summary(cfg.run_id)
        for g in ("normal", "zero"):
            out.setdefault(f"{row.key}|{g}", []).append(sm[f"{g}_{sm['metric']}"])
    return {k: sum(v) / len(v) for k, v in out.items() if len(v) == len(seeds)}


def claim_counts(space, store, cands, steps: int | None = None):
    """[(claim, holds_in, measured_in, per-candidate results)] over the mapped candidates."""
    seeds = list(range(space.seeds))
    rows = prediction_rows(space.task)
    per = []
    for c in mapped(space, cands):
        means = dict(c.means)
        means.update(_means(space, store, c, seeds, rows, steps))
        per.append((c, means))
    out = []
    for cl in claims_for(space.task):
        res = [(c, cl.holds(m)) for c, m in per]
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
