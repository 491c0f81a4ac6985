"""The calibration search (docs/DESIGN.md, "Calibration"): Optuna proposes candidates, the project's executors train them.

Each Optuna trial is one candidate (task design + initialisation, see ``space.py``). A candidate is
measured on the difficulty rows of its task (``criteria.difficulty_rows``) first on
``space.first_seeds`` seeds, then, if promising, on ``space.seeds`` seeds (successive halving over
seed counts). The promotion rule is declared, not tuned: every per-seed ("each") criterion holds on
the first seeds, and every mean criterion lies within twice its tolerance (bound-only criteria: within
0.1). A pruner (``_pruner``, built when a search runs) applies it through Optuna's pruning interface.

Trials are asked in batches; all their runs go through ``executors.sweep.execute`` in one call, so
grouping, worker processes, Ray and resume-after-kill work as for any sweep. Optuna's study lives in
SQLite beside the run store (``STORE/optuna.sqlite3``); a trial left RUNNING by a killed process is
re-enqueued with the same parameters (its runs are already stored or are retrained), so a search
resumes where it stopped. The objective is the difficulty distance (``Criterion.check``); a candidate
*passes* when every criterion holds on ``space.seeds`` seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..cells import formation_step
from ..config import make_run_config, validation_message
from .criteria import PAPER_ACCURACY, Criterion, Row, trajectory_effect
from .space import SearchSpace

__all__ = ["Candidate", "run_search", "load_candidates", "complete_nearest", "candidate_configs", "measure",
           "study_name", "ceiling", "check_ceiling"]


@dataclass
class Candidate:
    number: int
    params: dict
    task_options: dict
    model_options: dict
    status: str  # passes | fails | pruned | infeasible | running
    distance: float = math.nan
    n_seeds: int = 0
    means: dict = field(default_factory=dict)  # "row|gates" -> mean
    values: dict = field(default_factory=dict)  # "row|gates" -> per-seed list
    checks: dict = field(default_factory=dict)  # criterion name -> ok
    formation: list = field(default_factory=list)  # unforced: first step normal acc > .5, per seed
    error: str = ""

    @property
    def cid(self) -> str:
        """A stable id from the parameters (trial numbers change when a killed search is resumed)."""
        import hashlib
        return hashlib.sha256(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:6]

    @property
    def label(self) -> str:
        return ", ".join(f"{k.split('.', 1)[1]}={json.loads(v)}" for k, v in sorted(self.params.items()))


def study_name(space: SearchSpace) -> str:
    return f"{space.name}-{space.digest}"


def candidate_configs(space: SearchSpace, t_opts: dict, m_opts: dict, seeds, rows: list[Row] | None = None,
                      steps: int | None = None):
    """Run configs of a candidate's rows at ``seeds`` (raises ValueError / ValidationError if infeasible);
    ``rows``: None for the task's difficulty rows (an empty list is no rows)."""
    out = []
    for row in rows if rows is not None else space.rows():
        for s in seeds:
            out.append((row, s, make_run_config(space.task, row.path, s, model=space.model, steps=steps,
                                                task_options={**t_opts, **row.task}, model_options=m_opts)))
    return out


def ceiling(space: SearchSpace, t_opts: dict, m_opts: dict, row: Row | None = None) -> tuple[float, float]:
    """The Bayes ceiling (value, standard error) of a candidate's task at ``row``'s task options
    (token tasks; ``Task.bayes_accuracy``), nan for linear ICL (its references are MSEs)."""
    from ..tasks.generators import make_task
    row = row or space.rows()[0]
    cfg = candidate_configs(space, t_opts, m_opts, [0], rows=[row])[0][2]
    task = make_task(cfg.task)
    return task.bayes_accuracy() if hasattr(task, "bayes_accuracy") else (math.nan, math.nan)


def refused_reason(space: SearchSpace, t_opts: dict, m_opts: dict) -> str | None:
    """Why validation refuses a candidate's options, in one line (``config.validation_message``), or None
    where its configurations validate. Cheap and deterministic, so an infeasible candidate's reason is
    re-derived from the code each time it is shown, not read from text stored when it was searched."""
    try:
        candidate_configs(space, t_opts, m_opts, [0])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        return validation_message(e)
    return None


def check_ceiling(space: SearchSpace, t_opts: dict, m_opts: dict) -> None:
    """Raise ValueError (the candidate is infeasible) if its ceiling, two standard errors up, lies below
    an accuracy the paper reports for that row (``criteria.PAPER_ACCURACY``)."""
    for row, paper in PAPER_ACCURACY.get(space.task, []):
        acc, se = ceiling(space, t_opts, m_opts, row)
        if acc + 2 * se < paper:
            raise ValueError(f"Bayes ceiling {acc:.3f} +- {se:.3f} at {row.key} is below the paper's {paper:.2f}: "
                             f"not the paper's task")


def measure(space: SearchSpace, store, t_opts: dict, m_opts: dict, seeds, steps: int | None = None):
    """Criterion results of a candidate from the stored runs: (results, means, values, formation)."""
    crit = space.criteria()
    extra = {(c.row.key, c.gates) for c in crit if c.gates not in ("normal", "zero")}
    values, chances, formation = {}, {}, []
    for row, s, cfg in candidate_configs(space, t_opts, m_opts, seeds, steps=steps):
        sm = store.summary(cfg.run_id)
        m = sm["metric"]
        for g in ("normal", "zero"):
            values.setdefault(f"{row.key}|{g}", []).append(sm[f"{g}_{m}"])
        for key, read in extra:
            if key == row.key:
                values.setdefault(f"{row.key}|{read}", []).append(read_value(store, cfg, read))
        chances[row.key] = sm["chance"]
        if row.path == "unforced" and m == "acc" and not row.task:
            formation.append(formation_step(store.metrics(cfg.run_id)))
    results = [c.check(values[f"{c.row.key}|{c.gates}"], chances[c.row.key]) for c in crit]
    means = {k: sum(v) / len(v) for k, v in values.items()}
    return results, means, values, formation


# an effect search measures a candidate on all its seeds only if its first seed shows this much effect
EFFECT_PROMOTE = 0.15

# the evaluations an identification row reads of a stored run (tiers.READS), beyond its summary
_EVALS = {"pos=0": ((0.0, None), None), "content=0": ((None, 0.0), None), "T=120": (None, 120),
          "g=.5": ((0.5, 0.5), None)}


def read_value(store, cfg, read: str) -> float:
    """One identification read of a stored run: an evaluation from its weights (``cells.evaluate_cell``,
    cached in the store like every report's), or its parameter count in thousands (no weights needed)."""
    if read == "params":
        from ..model.transformer import build_model
        return build_model(cfg).n_params() / 1000.0
    from ..cells import Cell, Eval, evaluate_cell
    gates, length = _EVALS[read]
    return evaluate_cell(store, Cell(cfg, row=cfg.path.name), Eval(read, gates, length))


def promote(space: SearchSpace, crit: list[Criterion], res, means: dict) -> bool:
    """Whether a candidate measured on its first seeds goes on to all of them: the declared rule
    (``promising``) on a difficulty space; on an identification space the hard constraints alone (its
    rows may conflict, so no candidate need come near every one: ranking them is the identified set's
    job); on an effect space the constraints and a first-seed effect of at least ``EFFECT_PROMOTE``."""
    if space.identify:
        hard = [(c, r) for c, r in zip(crit, res) if c.scale is None]
        return promising([c for c, _ in hard], [r for _, r in hard])
    return promising(crit, res) and (not space.effect or trajectory_effect(means) >= EFFECT_PROMOTE)


def promising(crit: list[Criterion], results) -> bool:
    """The declared promotion rule (module docstring)."""
    for c, r in zip(crit, results):
        if c.stat == "each" and not r.ok:
            return False
        if c.stat == "mean":
            slack = c.tol if c.tol is not None else 0.1
            lo, hi = c.bounds()
            x = r.mean
            if x < lo - slack or x > hi + slack:
                return False
    return True


def _pruner():
    import optuna

    class PromotionPruner(optuna.pruners.BasePruner):
        """Prunes a trial whose first-seed measurement is not promising (``promising``)."""

        def prune(self, study, trial) -> bool:
            return not trial.user_attrs.get("promote", True)

    return PromotionPruner()


def _sampler(space: SearchSpace):
    import optuna
    if space.sampler in ("grid", "random"):  # grid: every point is enqueued (``_enqueue_grid``)
        return optuna.samplers.RandomSampler(seed=space.sampler_seed)
    return optuna.samplers.TPESampler(seed=space.sampler_seed, n_startup_trials=20, multivariate=True,
                                      constant_liar=True)


def _enqueue_grid(study, space: SearchSpace) -> None:
    """Grid search through Optuna's trial queue: every point of the grid, in a seeded random order
    (Optuna's GridSampler stops the study from inside ``tell``, which the ask/tell loop cannot use)."""
    import itertools
    import random
    keys = list(space.axes)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(space.labels(k) for k in keys))]
    random.Random(space.sampler_seed).shuffle(points)
    for p in points:
        study.enqueue_trial(p)


def _study(space: SearchSpace, store, create: bool = True):
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = store.optuna_url()
    if not create:
        return optuna.load_study(study_name=study_name(space), storage=storage)
    return optuna.create_study(study_name=study_name(space), storage=storage, load_if_exists=True,
                               direction="minimize", sampler=_sampler(space), pruner=_pruner())


def run_search(space: SearchSpace, store, *, budget: int, executor: str = "local", workers: int = 1,
               group_size: int = 6, batch: int = 4, progress: bool = True, address: str | None = None,
               steps: int | None = None, log=print) -> list[Candidate]:
    """Measure up to ``budget`` candidates in total (a resumed search counts those already measured)."""
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    from ..executors.sweep import execute

    study = _study(space, store)
    if not study.get_trials(deepcopy=False):
        for point in space.enqueue:  # declared first candidates, then the sampler's
            study.enqueue_trial({k: json.dumps(point.get(k, vals[0])) for k, vals in space.axes.items()})
        if space.sampler == "grid":
            _enqueue_grid(study, space)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # left by a killed process
        study.enqueue_trial(t.params)
        study.tell(t.number, state=TrialState.FAIL)
    dists = {k: CategoricalDistribution(space.labels(k)) for k in space.axes}
    crit = space.criteria()
    first, full = list(range(space.first_seeds)), list(range(space.seeds))

    def n_measured():  # distinct candidates: a sampler may propose a parameter set again
        return len({json.dumps(t.params, sort_keys=True) for t in study.get_trials(deepcopy=False)
                    if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                    or (t.state == TrialState.FAIL and "infeasible" in t.user_attrs)})

    def run(cfgs):
        if cfgs:
            rep = execute(cfgs, store, executor=executor, workers=workers, group_size=group_size, address=address,
                          progress=progress, sweep_bar=progress, require_calibration=False)
            if rep.failed:
                log(f"calibrate: {len(rep.failed)} run(s) failed: {rep.failed[0][1][:200]}")

    while n_measured() < budget:
        if space.sampler == "grid" and n_measured() >= space.grid_size():
            log(f"calibrate: the grid of {space.grid_size()} candidates is complete")
            break
        trials = []
        for _ in range(min(batch, budget - n_measured())):
            tr = study.ask(dists)
            t_opts, m_opts = space.options(tr.params)
            try:
                candidate_configs(space, t_opts, m_opts, full, steps=steps)
                check_ceiling(space, t_opts, m_opts)
            except ValueError as e:  # pydantic's ValidationError is a ValueError
                msg = validation_message(e)
                tr.set_user_attr("infeasible", msg[:300])
                study.tell(tr, state=TrialState.FAIL)
                continue
            trials.append((tr, t_opts, m_opts))
        if not trials:
            continue
        run([c for _, t, m in trials for _, _, c in candidate_configs(space, t, m, first, steps=steps)])
        promoted = []
        for tr, t_opts, m_opts in trials:
            res, means, values, form = measure(space, store, t_opts, m_opts, first, steps=steps)
            dist = space.distance(res, means)
            tr.set_user_attr("promote", promote(space, crit, res, means))
            tr.report(dist, step=len(first))
            if space.seeds == space.first_seeds:
                _finish(tr, res, means, values, form, len(first))
                study.tell(tr, dist)
            elif tr.should_prune():
                _finish(tr, res, means, values, form, len(first))
                study.tell(tr, state=TrialState.PRUNED)
            else:
                promoted.append((tr, t_opts, m_opts))
        run([c for _, t, m in promoted for _, _, c in candidate_configs(space, t, m, full, steps=steps)])
        for tr, t_opts, m_opts in promoted:
            res, means, values, form = measure(space, store, t_opts, m_opts, full, steps=steps)
            dist = space.distance(res, means)
            tr.report(dist, step=len(full))
            _finish(tr, res, means, values, form, len(full))
            study.tell(tr, dist)
        log(f"calibrate {space.name}: {n_measured()}/{budget} candidates measured")
    return load_candidates(space, store)


def _finish(tr, res, means, values, form, n_seeds):
    tr.set_user_attr("n_seeds", n_seeds)
    tr.set_user_attr("checks", {r.name: r.ok for r in res})
    tr.set_user_attr("means", means)
    tr.set_user_attr("values", values)
    tr.set_user_attr("formation", form)
    tr.set_user_attr("passes", all(r.ok for r in res))


def _nearest_file(space: SearchSpace, store):
    return store.calibration_dir() / f"{study_name(space)}-nearest.json"


def complete_nearest(space: SearchSpace, store, cands: list[Candidate], k: int = 5, *, executor: str = "local",
                     workers: int = 1, group_size: int = 6, progress: bool = True, address: str | None = None,
                     steps: int | None = None) -> list[Candidate]:
    """When no candidate passes, the ``k`` nearest that were pruned after the first seeds are measured
    on every seed (difficulty rows only), so the nearest candidate is chosen on as many seeds as a
    passing one would be (a declared rule; the results are kept beside the study)."""
    from ..executors.sweep import execute
    if any(c.status == "passes" for c in cands):
        return cands
    from ..preregistration import calibration_key
    todo, seen = [], set()
    for c in sorted([c for c in cands if c.status == "pruned" and not math.isnan(c.distance)],
                    key=lambda c: (c.distance, c.cid)):
        key = calibration_key(candidate_configs(space, c.task_options, c.model_options, [0], steps=steps)[0][2])
        if key not in seen and len(todo) < k:  # two spellings of one configuration count once
            seen.add(key)
            todo.append(c)
    full = list(range(space.seeds))
    cfgs = [cfg for c in todo for _, _, cfg in candidate_configs(space, c.task_options, c.model_options, full, steps=steps)]
    if cfgs:
        execute(cfgs, store, executor=executor, workers=workers, group_size=group_size, address=address,
                progress=progress, sweep_bar=progress, require_calibration=False)
    keep_measurements(space, store, _nearest_file(space, store), todo, full, steps)
    return load_candidates(space, store)


def keep_measurements(space: SearchSpace, store, f, cands, seeds, steps: int | None = None) -> None:
    """Measure ``cands`` on ``seeds`` from the stored runs and keep the results beside the study, in
    ``f`` (a JSON object by candidate id, merged with what it holds), where ``load_candidates`` reads
    them back."""
    done = json.loads(f.read_text()) if f.exists() else {}
    for c in cands:
        res, means, values, form = measure(space, store, c.task_options, c.model_options, seeds, steps=steps)
        done[c.cid] = {"distance": space.distance(res, means), "passes": all(r.ok for r in res), "means": means,
                       "values": values, "formation": form, "checks": {r.name: r.ok for r in res}}
    store.write_calibration_file(f.name, json.dumps(done, indent=1, sort_keys=True))


def load_candidates(space: SearchSpace, store) -> list[Candidate]:
    """Every measured candidate of the space's study, in trial order (duplicates of an earlier
    parameter set, e.g. a re-enqueued trial, are listed once)."""
    from optuna.trial import TrialState
    try:
        study = _study(space, store, create=False)
    except KeyError:
        return []
    out, seen = [], set()
    for t in study.get_trials(deepcopy=False):
        key = json.dumps(t.params, sort_keys=True)
        if t.state == TrialState.WAITING or (t.state == TrialState.FAIL and "infeasible" not in t.user_attrs):
            continue
        if key in seen:
            continue
        seen.add(key)
        t_opts, m_opts = space.options(t.params)
        a = t.user_attrs
        if t.state == TrialState.RUNNING:  # a search in progress or interrupted: what its first seeds show
            try:
                res, means, values, form = measure(space, store, t_opts, m_opts, range(space.first_seeds))
            except Exception:  # noqa: BLE001 - runs not (all) stored yet
                continue
            out.append(Candidate(t.number, dict(t.params), t_opts, m_opts, "interrupted", space.distance(res, means),
                                 space.first_seeds, means, values, {r.name: r.ok for r in res}, form))
            continue
        if t.state == TrialState.FAIL:
            status = "infeasible"
        elif t.state == TrialState.PRUNED:
            status = "pruned"
        else:
            status = "passes" if a.get("passes") else "fails"
        dist = t.value if t.value is not None else (t.intermediate_values.get(space.first_seeds, math.nan))
        # infeasible: refused by validation (re-derived), else by the ceiling check (a Monte Carlo: stored)
        why = (refused_reason(space, t_opts, m_opts) or a.get("infeasible", "")) if status == "infeasible" else ""
        out.append(Candidate(t.number, dict(t.params), t_opts, m_opts, status, dist, a.get("n_seeds", 0),
                             a.get("means", {}), a.get("values", {}), a.get("checks", {}), a.get("formation", []),
                             why))
    _apply_kept(_nearest_file(space, store), out, space.seeds)  # measured on every seed (``complete_nearest``)
    if space.identify:  # measured on five seeds before registration (``identify.complete``)
        out = with_completed(space, store, out)
    return out


REGISTER_SEEDS = 5  # a candidate enters the identified set only once measured on five seeds


def completed_file(space, store):
    """Where an identification search keeps its five-seed measurements (``identify.complete``)."""
    return store.calibration_dir() / f"{study_name(space)}-identified.json"


def with_completed(space, store, cands) -> list:
    """``cands`` with the five-seed measurements of ``complete`` where they exist (status, values,
    distance and checks as measured on ``REGISTER_SEEDS`` seeds)."""
    return _apply_kept(completed_file(space, store), cands, REGISTER_SEEDS)


def _apply_kept(f, cands, n_seeds: int) -> list:
    """``cands`` with the measurements ``keep_measurements`` kept in ``f`` (on ``n_seeds`` seeds) where
    it holds one for a candidate: status, distance, values, formation and checks as measured there."""
    done = json.loads(f.read_text()) if f.exists() else {}
    for c in cands:
        e = done.get(c.cid)
        if e is not None:
            c.status = "passes" if e["passes"] else "fails"
            c.distance, c.means, c.values = e["distance"], e["means"], e["values"]
            c.formation, c.checks, c.n_seeds = e["formation"], e["checks"], n_seeds
    return cands

