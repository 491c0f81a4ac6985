"""``softprior study``: the paper's method, end to end, on a researcher's own prior and task
(docs/STUDY.md, "Your own prior or task").

Given a registered task (``tasks.registry.TASK_SPECS``) and prior family (``priors.PRIORS``), built in or
from a plugin file, one resumable command runs, in order (each stage idempotent, so a killed study
resumes where it stopped; the store keeps every finished run):

1. **the difficulty search** (``calibration.search.run_search``): task design and initialisation chosen
   by the difficulty rows alone (Sec. 4; docs/DESIGN.md, "Calibration"): the criteria the user states
   (``--criteria FILE``, or a plugin task's own), or the defaults (``default_criteria``: the prior-on
   path learns, the no-prior path does not);
2. **pre-registration** (``reports.calibration_doc.register``): the choice's calibration record, written to
   the store before any prediction row trains, and the study's claims with their thresholds
   (``preregistration.json`` beside the report, refused if a resumed study would change them);
3. **the paths** (Sec. 4: unforced, forced_zero, a constant gate, fade, linear anneal, two hard
   switches, post hoc), scaled to the study's step budget (``paths.scale_to_budget``) on the chosen
   configuration, through the executors (local, Ray, grouped) as for the paper;
4. **the robustness map** (``calibration/robustness.py``): the same paths on every other mapped
   candidate, each claim decided on each;
5. **the report** ``study/NAME/REPORT.md``: verdicts on intervals over seeds (``claims.verdicts``), the
   numbers, the figures (``reports.experiment.plot_curves``) and the mechanism trace of the fade
   (``analysis.reports.mechanism_report``).

The claims are the paper's (Sec. 4, Tables 1-2; ``claims.CLAIMS``) restated relative to the task's
chance level c and Bayes ceiling C (``study_claims``), so that they mean the same on any task:
"level s" is c + s (C - c), the metric's direction taken into account (for an MSE the ceiling is the
best reference, below chance).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from .calibration.criteria import Criterion, Row
from .calibration.space import SearchSpace
from .claims import Cond, PaperClaim, verdicts

__all__ = ["StudyPlan", "run_study", "study_claims", "default_criteria", "study_space", "STUDY_PATHS",
           "StudyError", "write_verdicts", "atlas_names", "atlas_plans", "cell_finished", "run_atlas",
           "ATLAS_TASKS", "ATLAS_SEEDS", "ATLAS_MAP", "VERDICTS_FORMAT", "traits", "MAP_LIMIT", "KEEP", "ANNEAL",
           "FAIL", "POSTHOC", "MARGIN"]

# the paper's paths (Sec. 4) as the study trains them: (row label, path name at the paper's 3,600 steps)
STUDY_PATHS = [("unforced", "unforced"), ("forced_zero", "forced_zero"), ("forced_const0.5", "forced_const0.5"),
               ("fade600", "fade600->0"), ("linear0.5->0", "linear0.5->0"), ("hard_switch600", "hard_switch600"),
               ("hard_switch1050", "hard_switch1050"), ("posthoc", "posthoc")]
PAPER_STEPS = 3600

# Shares of the span from chance to the ceiling (module docstring). The paper's thresholds on associative
# recall (claims.py: .77 x ceiling kept by the fade, .64 x ceiling by the linear anneal, a margin of
# .26 x ceiling between the fade and the late switch, .15 "near chance" and .3 for post hoc, with chance
# .1 and a ceiling near .78) restated on the span: c + .7 (C - c) = .58 against .77 x .78 = .60, and so on.
KEEP, ANNEAL, FAIL, POSTHOC, MARGIN, LEARNS = 0.7, 0.6, 0.2, 0.3, 0.26, 0.5
# The robustness map's reach: the nearest other candidates it trains every path on (a study's default;
# the atlas maps fewer, ATLAS_MAP, to fit twelve cells on a workstation: docs/STUDY.md, "The atlas").
MAP_LIMIT = 10


class StudyError(ValueError):
    pass


@dataclass
class StudyPlan:
    task: str
    prior: str
    name: str = ""
    quick: bool = False
    steps: int | None = None  # None: 3,600 (the paper's), or 60 with --quick
    seeds: int | None = None  # None: 3, or 2 with --quick
    budget: int | None = None  # candidates the search measures (None: 12, or 2 with --quick)
    map_limit: int | None = None  # other candidates the robustness map covers (None: MAP_LIMIT)
    criteria: list | None = None  # the difficulty criteria the user states (None: the task's, else defaults)
    out: str = "study"
    executor: str = "local"
    workers: int = 1
    group_size: int | str = 6
    address: str | None = None
    paths: list = field(default_factory=lambda: list(STUDY_PATHS))
    trace_examples: int = 256  # validation examples of the mechanism trace

    def __post_init__(self):
        self.steps = self.steps or (60 if self.quick else PAPER_STEPS)
        self.seeds = self.seeds or (2 if self.quick else 3)
        self.budget = self.budget or (2 if self.quick else 12)
        self.map_limit = MAP_LIMIT if self.map_limit is None else self.map_limit
        self.name = self.name or f"{self.task}-{self.prior}" + ("-quick" if self.quick else "")
        if self.steps < 2 or self.seeds < 1 or self.budget < 1 or self.map_limit < 0:
            raise StudyError("study: --steps must be >= 2, --seeds and --budget >= 1, --map >= 0")

    @property
    def dir(self) -> Path:
        return Path(self.out) / self.name


# ---------------------------------------------------------------------------------------------- levels
def task_levels(task: str, task_options: dict, model_options: dict | None = None) -> tuple[str, float, float]:
    """(metric, chance, ceiling) of ``task`` at the given options (its registered default merged in):
    the generator's chance level and its Bayes ceiling (``bayes_accuracy``) where it has one, else 1
    for accuracy and the best reference (``reference_mse``, else 0) for an MSE."""
    from .config import make_run_config
    from .tasks.generators import make_task
    cfg = make_run_config(task, "unforced", 0, task_options=task_options, model_options=model_options)
    t = make_task(cfg.task)
    if hasattr(t, "bayes_accuracy"):
        ceiling = float(t.bayes_accuracy()[0])
    elif t.metric == "mse" and hasattr(t, "reference_mse"):
        ceiling = float(min(v for v in t.reference_mse(cfg.validation_batch(t)).values() if math.isfinite(v)))
    else:
        ceiling = 1.0 if t.metric == "acc" else 0.0
    return t.metric, float(t.chance_at(cfg.model.n_ctx)), ceiling


def _level(chance: float, ceiling: float, share: float) -> float:
    return chance + share * (ceiling - chance)


def default_criteria(metric: str, chance: float, ceiling: float) -> list[Criterion]:
    """The defaults (module docstring): unforced, with the prior, reaches half the span from chance to
    the ceiling at its own gates; forced_zero, never given the prior, stays within a fifth of it."""
    good, bad = (">=", "<=") if metric == "acc" else ("<=", ">=")
    learns, fails = round(_level(chance, ceiling, LEARNS), 3), round(_level(chance, ceiling, FAIL), 3)

    def bound(op, v):
        return {"lo": v} if op == ">=" else {"hi": v}
    return [Criterion(name="unforced learns", row=Row(path="unforced"), gates="normal", **bound(good, learns)),
            Criterion(name="forced_zero does not", row=Row(path="forced_zero"), gates="zero", **bound(bad, fails))]


def study_claims(metric: str, chance: float, ceiling: float) -> list[PaperClaim]:
    """The paper's claims (``claims.CLAIMS``) on the study's table, thresholds as levels of the span."""
    good, bad = (">=", "<=") if metric == "acc" else ("<=", ">=")
    lv = lambda s: round(_level(chance, ceiling, s), 6)  # noqa: E731
    span = ceiling - chance

    def c(row, col, op, value, other=None):
        return Cond("study", row, col, op, value, other)
    learned = (c("unforced", "normal", good, lv(LEARNS)),)  # claims about what training keeps need a model that learned
    return [
        PaperClaim("prior helps", "With the prior the task is learned; without it, it is not (the difficulty rows)",
                   "Table 1", (c("unforced", "normal", good, lv(LEARNS)), c("forced_zero", "zero", bad, lv(FAIL)))),
        PaperClaim("unforced relies", "Unforced models rely on the prior: near chance at zero gate", "Table 2",
                   (c("unforced", "zero", bad, lv(FAIL)),), learned=learned),
        PaperClaim("fade keeps", "A smooth fade to zero keeps the zero-gate metric high", "Table 1",
                   (c("fade600", "zero", good, lv(KEEP)),), learned=learned),
        PaperClaim("linear anneal", "A linear anneal 0.5 -> 0 keeps much of the circuit", "Sec. 4",
                   (c("linear0.5->0", "zero", good, lv(ANNEAL)),), learned=learned),
        PaperClaim("constant gate", "A constant gate (0.5) leaves a prior-dependent model", "Sec. 4",
                   (c("forced_const0.5", "zero", bad, lv(FAIL)),)),
        PaperClaim("late hard switch", "An abrupt switch when the fade would end keeps much less than the fade",
                   "Table 2", (c("hard_switch1050", "zero", bad, round(-MARGIN * span, 6), ("fade600", "zero")),), learned=learned),
        PaperClaim("early hard switch", "An abrupt switch when the fade would start keeps nothing", "Table 2",
                   (c("hard_switch600", "zero", bad, lv(FAIL)),), learned=learned),
        PaperClaim("posthoc fails", "Post hoc zero-gate continuation of an unforced model does not recover",
                   "Table 2", (c("posthoc", "zero", bad, lv(POSTHOC)),), learned=learned),
    ]


# ---------------------------------------------------------------------------------------------- space
def _task_space(task: str) -> dict:
    """The task's search space as SearchSpace fields: its entry's, else the shipped ``spaces/<task>.toml``."""
    from .calibration.space import load_space, shipped_spaces
    from .tasks.registry import task_spec
    spec = task_spec(task).space
    if isinstance(spec, dict):
        return dict(spec)
    if spec is not None or task in shipped_spaces():
        return load_space(spec or task).model_dump(exclude={"name", "difficulty", "identify"})
    return {"task": task}


# the paper's table's own axes: inert under another family (its model reads none of them), so a search
# over them would train one model under several run ids; a family that reads one declares it in its axes
_SOFT_ONLY = {"model.prior_init", "model.prior_cap", "model.pos_beyond", "model.prior_scale"}


def study_space(plan: StudyPlan, criteria: list[Criterion]) -> SearchSpace:
    """The study's search space: the task's axes (less the soft table's own when the prior is another
    family) and the prior family's axes; with --quick one axis of two values, on a grid."""
    from .model.priors import prior_family
    base = _task_space(plan.task)
    axes = dict(base.get("axes", {}))
    if plan.prior != "soft":
        axes = {k: v for k, v in axes.items() if k not in _SOFT_ONLY}
    axes.update(prior_family(plan.prior).axes)
    if plan.quick:
        first = next(iter(prior_family(plan.prior).axes or axes), None)
        axes = {first: list(axes[first])[:2]} if first else {}
    fixed = {k: dict(v) for k, v in base.get("base", {}).items()}
    fixed.setdefault("model", {})["prior_family"] = plan.prior
    seeds = plan.seeds
    return SearchSpace(name=f"study-{plan.name}", task=plan.task, model="base",
                       sampler="grid" if plan.quick or not axes else base.get("sampler", "tpe"),
                       seeds=seeds, first_seeds=seeds if plan.quick else min(seeds, base.get("first_seeds", 1)),
                       base=fixed, axes=axes, difficulty=criteria)


# ---------------------------------------------------------------------------------------------- rows
def row_configs(space: SearchSpace, cand, plan: StudyPlan, seeds, snapshots: bool = False):
    """[(row label, seed, RunConfig)] of the study's paths on a candidate, each path scaled to the
    study's budget; the fade keeps weights every tenth of the run when ``snapshots`` (the trace)."""
    from .calibration.search import candidate_configs
    from .paths import get_path
    out = []
    for label, name in plan.paths:
        path = _at_budget(get_path(name), plan.steps)
        for _, s, cfg in candidate_configs(space, cand.task_options, cand.model_options, seeds,
                                           rows=[Row(path=name)], steps=plan.steps):
            upd = {"path": path}
            if snapshots and label == "fade600":
                upd["snapshot_every"] = max(1, plan.steps // 10)
            out.append((label, s, cfg.model_copy(update=upd)))
    return out


def _at_budget(path, steps: int):
    """``path`` scaled to ``steps`` (``paths.scale_to_budget``, a new name) where that changes its
    trajectory; as it is where nothing in it counts steps (unforced, forced_zero, a constant gate, the
    linear anneal to the final step), so the difficulty rows are the search's own runs."""
    from .paths import scale_path, scale_to_budget
    same = scale_path(path, steps / PAPER_STEPS).model_copy(update={"description": path.description}) == path
    return path if same else scale_to_budget(path, steps, PAPER_STEPS)


def _tables(store, rows) -> dict:
    """The study's cells as ``claims.verdicts`` reads them: ("study" -> (row, gates) -> mean, values, n)."""
    vals: dict = {}
    for label, _, cfg in rows:
        if store.is_done(cfg.run_id):
            sm = store.summary(cfg.run_id)
            for g in ("normal", "zero"):
                vals.setdefault((label, g), []).append(sm[f"{g}_{sm['metric']}"])
    t = {}
    for (label, g), v in vals.items():
        t[(label, g)], t[(label, g, "values")], t[(label, g, "n")] = sum(v) / len(v), v, float(len(v))
    return {"study": t}


# ---------------------------------------------------------------------------------------------- stages
def _check_state(plan: StudyPlan, space: SearchSpace) -> None:
    """study.json: the study's settings; a resumed study must have the same ones (else StudyError)."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    state = {"task": plan.task, "prior": plan.prior, "steps": plan.steps, "seeds": plan.seeds,
             "map_limit": plan.map_limit, "space": space.name, "space_digest": space.digest,
             "paths": [list(p) for p in plan.paths]}
    f = plan.dir / "study.json"
    if f.exists():
        old = {**_LEGACY, **json.loads(f.read_text())}
        if old != state:
            diff = sorted(k for k in state if old.get(k) != state[k])
            raise StudyError(f"study {plan.name!r} in {str(plan.dir)!r} was started with other settings "
                             f"({', '.join(diff)}); resume it with the same ones or pass another --name")
        return
    f.write_text(json.dumps(state, indent=1, sort_keys=True))


def _chosen(cands, rec: dict):
    """The candidate the record registered (its note names the candidate id)."""
    for c in cands:
        if f"candidate {c.cid} " in rec.get("note", ""):
            return c
    raise StudyError(f"the registered record {rec['hash']} names no candidate of this search")


def _preregister(plan: StudyPlan, rec: dict, levels: tuple, claims: list[PaperClaim]) -> dict:
    """Write the study's claims (and the record they rest on) before any path trains; on resume,
    refuse if they would differ from those written then."""
    body = {"record": rec["hash"], "metric": levels[0], "chance": levels[1], "ceiling": levels[2],
            "claims": [{"name": c.name, "conditions": [k.describe() for k in c.conditions]} for c in claims]}
    f = plan.dir / "preregistration.json"
    if f.exists():
        old = json.loads(f.read_text())
        if {k: old.get(k) for k in body} != body:  # the record, the levels and every claim's conditions
            raise StudyError(f"{f}: the study's claims or record changed since they were pre-registered "
                             f"(written {old.get('written_at')}); start a new study (--name)")
        return old
    body["written_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    f.write_text(json.dumps(body, indent=1, sort_keys=True))
    return body


def _execute(plan: StudyPlan, store, cfgs, log, registered: bool = True, train: bool = True) -> None:
    """Train ``cfgs``; ``registered=False`` for the robustness map, whose other candidates no record
    covers (as ``calibration.robustness.run_robustness``: the map comes after the registration and
    never feeds back into the choice); ``train=False``: StudyError if any is not in the store yet."""
    from .executors.sweep import execute
    missing = 0 if train else sum(not store.is_done(c.run_id) for c in cfgs)
    if missing:
        raise StudyError(f"study {plan.name}: {missing} of its runs are not in this store, and nothing may train")
    if not cfgs:
        return
    rep = execute(cfgs, store, executor=plan.executor, workers=plan.workers, group_size=plan.group_size,
                  address=plan.address, progress=False, sweep_bar=False, require_calibration=registered)
    if rep.failed:
        raise StudyError(f"study: {len(rep.failed)} run(s) failed: {rep.failed[0][1][:300]}")


def run_study(plan: StudyPlan, store, log=print, train: bool = True) -> Path:
    """Every stage (module docstring); returns the report's path. ``train=False``: a finished study's
    report and verdicts written again from its runs, StudyError where a path's run is missing."""
    from .reports.calibration_doc import register, registered_record
    from .calibration.robustness import mapped
    from .calibration.search import complete_nearest, run_search
    from .config import validation_message
    try:
        levels = task_levels(plan.task, {}, {"prior_family": plan.prior})
        criteria = [Criterion.model_validate(c) for c in plan.criteria] if plan.criteria else _task_criteria(plan.task)
        space = study_space(plan, criteria or default_criteria(*levels))
    except ValueError as e:
        raise StudyError(f"study: {validation_message(e)}") from None
    _check_state(plan, space)
    kw = dict(executor=plan.executor, workers=plan.workers, group_size=plan.group_size, address=plan.address,
              steps=plan.steps)
    log(f"study {plan.name}: 1/5 difficulty search ({space.grid_size()} candidate(s) on the grid, budget "
        f"{plan.budget}, {plan.steps} steps, {plan.seeds} seed(s))")
    cands = run_search(space, store, budget=plan.budget, batch=min(plan.budget, 6), progress=False, log=log, **kw)
    if not any(c.status == "passes" for c in cands):
        cands = complete_nearest(space, store, cands, progress=False, **kw)
    rec = registered_record(store, space)
    log(f"study {plan.name}: 2/5 pre-registration" + (" (registered before)" if rec else ""))
    rec = rec or register(space, store, cands, steps=plan.steps)
    chosen = _chosen(cands, rec)
    levels = task_levels(plan.task, chosen.task_options, chosen.model_options)
    claims = study_claims(*levels)
    _preregister(plan, rec, levels, claims)
    seeds = list(range(plan.seeds))
    main_rows = row_configs(space, chosen, plan, seeds, snapshots=True)
    log(f"study {plan.name}: 3/5 paths ({len(main_rows)} runs on candidate {chosen.cid})")
    _execute(plan, store, [cfg for _, _, cfg in main_rows], log, train=train)
    others = [c for c in mapped(space, cands, limit=plan.map_limit + 1) if c.cid != chosen.cid][:plan.map_limit]
    map_rows = {c.cid: row_configs(space, c, plan, seeds) for c in others}
    log(f"study {plan.name}: 4/5 robustness map ({len(others)} other candidate(s))")
    _execute(plan, store, [cfg for rows in map_rows.values() for _, _, cfg in rows], log, registered=False,
             train=train)
    log(f"study {plan.name}: 5/5 report")
    from .reports.study import write_report
    report = write_report(plan, store, space, cands, rec, chosen, claims, levels, main_rows,
                          {c.cid: (c, map_rows[c.cid]) for c in others}, verdicts_of=lambda rows: verdicts(
                              _tables(store, rows), claims))
    write_verdicts(plan, store, rec, chosen, claims, levels, main_rows)
    return report


# ---------------------------------------------------------------------------------------------- verdicts as data
_DIFFICULTY_ROWS = ("unforced", "forced_zero")  # the search's own runs; every other path is a prediction row


def _num(x):
    """A float for JSON: rounded to 6 digits, None where not finite (one seed gives no interval)."""
    return round(float(x), 6) if x is not None and math.isfinite(x) else None


def _utc(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else None


VERDICTS_FORMAT = 2  # 2: with the cell's traits (``traits``); a finished atlas cell of format 1 is rewritten


def traits(plan: StudyPlan, store, main_rows, levels: tuple) -> dict:
    """What the atlas compares across cells (docs/STUDY.md, "The atlas"): the trained unforced models'
    prior at their own gates (``analysis.mechanism.prior_profile``: locality and strength, per seed),
    the step at which each one's circuit forms (``cells.formation_step``: its normal metric past the
    study's "learns" level, accuracy tasks only; None: never) and the fade's window at the study's
    budget (the steps where the gate starts and ends its fall)."""
    from .analysis.mechanism import prior_profile
    from .cells import formation_step
    from .paths import get_path
    from .tasks.generators import make_task
    metric, chance, ceiling = levels
    learns = _level(chance, ceiling, LEARNS)
    fade = _at_budget(get_path(dict(plan.paths)["fade600"]), plan.steps).pos.schedule
    out = {"fade_window": [fade.start_step, fade.end_step], "learns_level": _num(learns), "seeds": []}
    for label, seed, cfg in main_rows:
        if label != "unforced" or not store.is_done(cfg.run_id):
            continue
        _, model = store.load_model(cfg.run_id)
        prof = prior_profile(model, cfg.validation_batch(make_task(cfg.task), n=1).inputs)
        forms = formation_step(store.metrics(cfg.run_id), metric, learns) if metric == "acc" else None
        out["seeds"].append({"seed": seed, "formation_step": forms, **{k: _num(v) for k, v in prof.items()}})
    return out


def write_verdicts(plan: StudyPlan, store, rec: dict, chosen, claims: list[PaperClaim], levels: tuple,
                   main_rows) -> Path:
    """``plan.dir/verdicts.json``, beside REPORT.md: the study's verdicts as data (what ``softprior atlas``
    reads; ``reports.atlas``): its settings, levels, the record it rests on and when it was registered,
    when the claims were pre-registered and when the first prediction row was stored, each path's
    per-seed values, and per claim its verdict, evidence and each condition's estimate and interval."""
    tables = _tables(store, main_rows)
    created = {r["run_id"]: r.get("created") for r in store.rows()}
    first = min((created[cfg.run_id] for label, _, cfg in main_rows if label not in _DIFFICULTY_ROWS
                 and created.get(cfg.run_id)), default=None)
    prereg = json.loads((plan.dir / "preregistration.json").read_text())
    t = tables["study"]
    paths = {label: {g: [_num(v) for v in t.get((label, g, "values"), [])] for g in ("normal", "zero")}
             for label, _ in plan.paths}
    fade = t.get(("fade600", "zero"))
    out = []
    for cl, v, ev in verdicts(tables, claims):
        conds = []
        for k in cl.conditions:
            e = k.evaluate(tables)
            conds.append({"condition": k.describe(), "measured": e is not None,
                          **({key: _num(e[key]) for key in ("est", "lo", "hi", "thr")} if e else {}),
                          **({"n": e["n"], "holds": e["ok"]} if e else {})})
        out.append({"name": cl.name, "statement": cl.statement, "paper": cl.paper, "verdict": v, "evidence": ev,
                    "conditions": conds})
    body = {"study": plan.name, "task": plan.task, "prior": plan.prior, "steps": plan.steps, "seeds": plan.seeds,
            "budget": plan.budget, "map_limit": plan.map_limit, "quick": plan.quick, "metric": levels[0],
            "chance": _num(levels[1]), "ceiling": _num(levels[2]), "record": rec["hash"],
            "registered_at": rec.get("registered_at"),
            "preregistered_at": prereg.get("written_at"), "first_prediction_row_at": _utc(first),
            "candidate": chosen.cid, "candidate_label": chosen.label, "task_options": rec.get("task_options"),
            "model_options": rec.get("model_options"),
            "fade_zero": _num(fade) if fade is not None else None, "paths": paths, "claims": out,
            "format": VERDICTS_FORMAT, "traits": traits(plan, store, main_rows, levels)}
    f = plan.dir / "verdicts.json"
    f.write_text(json.dumps(body, indent=1, sort_keys=True))
    return f


def _task_criteria(task: str) -> list[Criterion] | None:
    """A plugin task's own difficulty criteria (``register_task(difficulty=...)``); None for the rest:
    the built-ins' criteria are the paper's numbers for the paper's prior, so a study states its defaults."""
    from .tasks.registry import task_spec
    spec = task_spec(task)
    if spec.plugin is None or spec.difficulty is None:
        return None
    return [c if isinstance(c, Criterion) else Criterion.model_validate(c) for c in spec.difficulty]


def load_criteria(path: str) -> list[Criterion]:
    """Difficulty criteria a user states: a .json list of ``Criterion`` objects, or a .toml file of
    ``[[criteria]]`` tables (fields of ``calibration.criteria.Criterion``); StudyError in one line."""
    from .config import validation_message
    p = Path(path)
    if not p.is_file():
        raise StudyError(f"criteria file {path!r} does not exist")
    try:
        if p.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(p.read_text()).get("criteria", [])
        else:
            data = json.loads(p.read_text())
        out = [Criterion.model_validate(c) for c in data]
    except ValueError as e:
        raise StudyError(f"criteria file {path!r}: {validation_message(e)}") from None
    if not out:
        raise StudyError(f"criteria file {path!r} states no criterion")
    return out


# ---------------------------------------------------------------------------------------------- the atlas
ATLAS_TASKS = ("assoc_recall", "markov")  # associative recall and Markov induction
ATLAS_SEEDS = 5
ATLAS_MAP = 3  # the atlas's robustness map: the three nearest other candidates (MAP_LIMIT's comment)


def atlas_names(priors: list[str] | None, tasks: list[str] | None) -> tuple[list[str], list[str]]:
    """The atlas's priors (default: every registered family, plugins' included) and tasks (default
    ``ATLAS_TASKS``), each checked against its registry: StudyError naming the allowed values."""
    from .model.priors import PRIORS
    from .tasks.registry import TASK_SPECS
    priors = list(PRIORS) if not priors else priors
    tasks = list(ATLAS_TASKS) if not tasks else tasks
    for kind, names, allowed in (("prior", priors, list(PRIORS)), ("task", tasks, list(TASK_SPECS))):
        bad = [n for n in names if n not in allowed]
        if bad:
            raise StudyError(f"atlas: unknown {kind} {bad[0]!r} (allowed: {', '.join(allowed)})")
        if len(set(names)) != len(names):
            raise StudyError(f"atlas: a {kind} is named twice in {', '.join(names)}")
    return priors, tasks


def atlas_plans(priors: list[str], tasks: list[str], **study) -> list[StudyPlan]:
    """One study per (prior, task), prior by prior: named ``atlas-TASK-PRIOR`` (-quick with --quick), so
    that its search, record and directory are the atlas's own, apart from any ``softprior study`` of the
    same pair; ``study``: the StudyPlan fields every cell shares (seeds default ``ATLAS_SEEDS``, the study's with --quick)."""
    study = {**study, "seeds": study.get("seeds") or (None if study.get("quick") else ATLAS_SEEDS),
             "map_limit": ATLAS_MAP if study.get("map_limit") is None else study["map_limit"]}
    return [StudyPlan(task=t, prior=p, name=f"atlas-{t}-{p}" + ("-quick" if study.get("quick") else ""), **study)
            for p in priors for t in tasks]


_CELL_KEYS = ("task", "prior", "steps", "seeds", "budget", "map_limit", "quick")
_LEGACY = {"map_limit": MAP_LIMIT}  # what a study or cell written before a setting existed ran with


def cell_finished(plan: StudyPlan, copy: Path | None = None) -> Path | None:
    """The verdicts a finished cell wrote (its study's ``verdicts.json``, the last thing ``run_study``
    writes, or its copy beside the atlas document) at the plan's settings; None while it is not."""
    for f in (plan.dir / "verdicts.json", copy):
        if f is not None and f.is_file():
            body = json.loads(f.read_text())
            if all(body.get(k, _LEGACY.get(k)) == getattr(plan, k) for k in _CELL_KEYS):
                return f
    return None


def _rewritable(plan: StudyPlan, store, done: Path) -> bool:
    """Whether a finished cell's verdicts are in an older format (below ``VERDICTS_FORMAT``) and can be
    written again from its runs: its study directory is here and its record is in this store."""
    body = json.loads(done.read_text())
    return (body.get("format", 1) < VERDICTS_FORMAT and (plan.dir / "study.json").is_file()
            and body.get("record") in {r["hash"] for r in store.calibration_records()})


def run_atlas(plans: list[StudyPlan], store, cells_dir: Path, on_cell=None, log=print) -> list[Path]:
    """Every cell's study (``run_study``, its stages as they are), skipping the cells already finished
    (``cell_finished``); each finished cell's ``verdicts.json`` copied to ``cells_dir/TASK-PRIOR.json``
    (what the atlas document reads), then, where that file changed, ``on_cell()`` (the document rewritten). Killed, it resumes: a
    finished cell is kept (one whose verdicts an older version wrote is rewritten from its study's runs,
    nothing trained, where its study directory is here), an unfinished one resumes within its study.
    Returns the cells' files."""
    cells_dir = Path(cells_dir)
    cells_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for i, plan in enumerate(plans, 1):
        tag = f"cell {i}/{len(plans)}: {plan.prior} x {plan.task}"
        copy = cells_dir / f"{plan.task}-{plan.prior}.json"
        done = cell_finished(plan, copy)
        if done is not None and _rewritable(plan, store, done):
            log(f"{tag}: finished before; its verdicts rewritten in this version's format from its runs in the "
                "store")
            try:
                run_study(plan, store, log=lambda m: log(f"  {m}"), train=False)
                done = plan.dir / "verdicts.json"
            except StudyError as e:
                log(f"{tag}: kept as an older version wrote it ({e})")
        elif done:
            log(f"{tag}: finished before ({done}), not rerun")
        else:
            log(f"{tag} ({plan.steps} steps, {plan.seeds} seed(s), budget {plan.budget}) ...")
            started = time.time()
            run_study(plan, store, log=lambda m: log(f"  {m}"))
            done = plan.dir / "verdicts.json"
            log(f"{tag}: done ({time.time() - started:.0f} s)")
        fresh = done != copy and (not copy.is_file() or copy.read_text() != done.read_text())
        if fresh:
            copy.write_text(done.read_text())
        out.append(copy)
        if fresh and on_cell is not None:
            on_cell()
    return out
