"""Experiments as data: a name, a description, the run configs it needs (as table cells), and how
to tabulate and plot them. Every experiment of the paper (Sec. 4, Tables 1-2) is registered here; users register
their own with ``register_experiment`` (e.g. from a Python file passed as ``--plugin FILE``).

A ``Cell`` is one run config plus where its numbers go in the table (``row``, ``col``) and which
evaluations to read from it (``Eval``: the model's own gates, zero gates, any gate override, any
length). "normal" and "zero" at the training length come from the stored run summary; other
evaluations are computed from the stored weights at report time (cheap and deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .cells import NORMAL, ZERO, Cell, Eval, readings
from .config import RunConfig, make_run_config
from .registry import Registry

__all__ = ["Experiment", "Options", "register_experiment", "get_experiment", "list_experiments", "UnknownExperimentError",
           "UnknownTaskFilterError"]


class UnknownExperimentError(ValueError):
    pass


class UnknownTaskFilterError(ValueError):
    pass


@dataclass
class Options:
    seeds: int | None = None  # None: the experiment's (paper's) seed count
    quick: bool = False
    tasks: tuple[str, ...] | None = None  # a filter: labels or task names of TASK_VARIANTS
    # (experiment, row, column) cells whose verdict was undecided at the paper's seed counts, run on
    # more seeds (``paper.more_seeds``; read by ``paper.build_cells``, not by an experiment's build)
    extend: tuple[tuple[str, str, str], ...] = ()
    extend_seeds: int | None = None  # the seeds those cells run on (None: paper.MAX_SEEDS)
    # a shipped pre-registered record (``registered/NAME.json``) in place of its task's default: the
    # experiments' cells of that task, built on its configuration (``Experiment.cells``)
    record: str | None = None

    def __post_init__(self):
        if self.record is not None:
            from .preregistration import record_named
            record_named(self.record)  # UnknownRecordError names the shipped records
        if self.tasks is not None:
            allowed = list(dict.fromkeys([*TASK_VARIANTS, *(t for t, _ in TASK_VARIANTS.values())]))
            for t in self.tasks:
                if t not in allowed:  # a typo would otherwise select nothing: an empty table
                    raise UnknownTaskFilterError(f"unknown task {t!r} in --tasks; allowed: {', '.join(allowed)}")

    def n_seeds(self, default: int) -> int:
        if self.seeds is not None:
            return self.seeds
        return 1 if self.quick else default

    def run_kwargs(self) -> dict:
        """Overrides for --quick: few steps, a small validation set."""
        return dict(steps=QUICK_STEPS, eval_every=QUICK_STEPS // 18, n_val=128) if self.quick else {}

    def scaled(self, cfg: RunConfig) -> RunConfig:
        """--quick: every schedule scaled to the quick budget (``paths.scale_path``), so a smoke run keeps
        each path's shape (a fade at 600 of 3,600 becomes one at 1/6 of the quick budget)."""
        if not self.quick:
            return cfg
        from .paths import scale_path
        return cfg.model_copy(update={"path": scale_path(cfg.path, QUICK_STEPS / PAPER_STEPS)})


PAPER_STEPS = 3600
QUICK_STEPS = 180


@dataclass
class Experiment:
    name: str
    description: str
    build: Callable[[Options], list[Cell]]
    paper: dict[tuple[str, str], str] = field(default_factory=dict)  # (row, column label) -> paper value
    curves: bool = True  # also plot training curves per row
    analysis: Callable | None = None  # extra analysis (e.g. mechanism traces): f(store, cells, out_dir) -> md

    def cells(self, opts: Options) -> list[Cell]:
        """The cells under ``opts``; with ``opts.record``, those of the record's task, built with the
        record's configuration as the task's default (``preregistration.use_record``)."""
        if opts.record is None:
            return self.build(opts)
        from .preregistration import use_record
        with use_record(opts.record) as rec:
            return [c for c in self.build(opts) if c.cfg.task.name == rec["task"]]


EXPERIMENTS: Registry[Experiment] = Registry("experiment", UnknownExperimentError, describe=lambda e: e.description)


def register_experiment(exp: Experiment, *, overwrite: bool = False) -> Experiment:
    return EXPERIMENTS.register(exp.name, exp, overwrite=overwrite)


def get_experiment(name: str) -> Experiment:
    return EXPERIMENTS[name]


def list_experiments() -> list[tuple[str, str]]:
    return EXPERIMENTS.listing()



# ------------------------------------------------------------------------------------- helpers
def _path_cells(opts: Options, paths, *, task="assoc_recall", models=("base",), seeds=3, seeds_for=None,
                col_of=None, task_options=None, evals=(ZERO, NORMAL)) -> list[Cell]:
    cells = []
    for model in models:
        for path in paths:
            n = opts.n_seeds((seeds_for or {}).get(path, seeds))
            for seed in range(n):
                cfg = make_run_config(task, path, seed, model=model, task_options=task_options, **opts.run_kwargs())
                cfg = opts.scaled(cfg)
                cells.append(Cell(cfg, row=path, col=col_of(model) if col_of else (model if len(models) > 1 else ""),
                                  evals=readings(cfg, evals)))
    return cells


MAIN_PATHS = ["fade600", "linear0.5->0", "forced_const0.5", "unforced", "forced_zero"]
TASK_VARIANTS = {  # label -> (task, task options)
    "assoc_recall": ("assoc_recall", {}),
    "markov p=0.2": ("markov", {"p": 0.2}),
    "markov p=0.5": ("markov", {"p": 0.5}),
    "markov p=0.8": ("markov", {"p": 0.8}),
    "linear_icl": ("linear_icl", {}),
}


def _baseline_cells(opts: Options, tasks, evals=(ZERO, NORMAL), seeds=3) -> list[Cell]:
    from .model.baselines import BASELINES
    cells = []
    for label, (task, topts) in TASK_VARIANTS.items():
        if label not in tasks and task not in tasks:
            continue
        for b in BASELINES:
            for seed in range(opts.n_seeds(seeds)):
                cfg = make_run_config(task, seed=seed, baseline=b, task_options=topts, **opts.run_kwargs())
                cells.append(Cell(cfg, row=b, col=label, evals=evals))
    return cells


# ------------------------------------------------------------------------------------- registry
register_experiment(Experiment(
    "removability", "headline: unforced vs forced_zero vs fade600->0 on associative recall (3 seeds)",
    lambda o: _path_cells(o, ["unforced", "forced_zero", "fade600"]),
    paper={("fade600", "zero"): ".734±.028", ("fade600", "normal"): ".694±.078",
           ("unforced", "zero"): ".100±.006", ("unforced", "normal"): ".780±.007",
           ("forced_zero", "zero"): ".094±.013", ("forced_zero", "normal"): ".092±.006"}))

_T1 = {("fade600", "base"): (".734±.028", ".694±.078"), ("linear0.5->0", "base"): (".617±.024", ".792±.022"),
       ("forced_const0.5", "base"): (".114±.006", ".164±.003"), ("unforced", "base"): (".100±.006", ".780±.007"),
       ("forced_zero", "base"): (".094±.013", ".092±.006"),
       ("fade600", "large"): (".731±.024", ".432±.091"), ("linear0.5->0", "large"): (".635±.040", ".778±.015"),
       ("forced_const0.5", "large"): (".160±.011", ".212±.024"), ("unforced", "large"): (".102±.005", ".797±.017"),
       ("forced_zero", "large"): (".102±.010", ".100±.016")}
register_experiment(Experiment(
    "paths", "Table 1: five training paths on associative recall, base and large (fade 5 seeds, others 3)",
    lambda o: _path_cells(o, MAIN_PATHS, models=("base", "large"), seeds_for={"fade600": 5}),
    paper={(r, f"{m} {e}"): v[i] for (r, m), v in _T1.items() for i, e in enumerate(("zero", "normal"))}))

_T2 = {"fade600": (".734", ".694"), "hard_switch1050": (".293", ".367"), "hard_switch600": (".097", ".102"),
       "posthoc": (".178", ".619"), "unforced": (".095", ".772"), "forced_zero": (".091", ".088")}
register_experiment(Experiment(
    "causal_controls", "Table 2: hard switches at 1050 and 600, post hoc zero continuation, controls (5 seeds)",
    lambda o: _path_cells(o, list(_T2), seeds=5),
    paper={(r, e): v[i] for r, v in _T2.items() for i, e in enumerate(("zero", "normal"))}))

register_experiment(Experiment(
    "fade_window", "fade start S in {400, 500, 600, 700, 800} (width 450), associative recall",
    lambda o: _path_cells(o, [f"fade{s}" for s in (400, 500, 600, 700, 800)])))

register_experiment(Experiment(
    "fade_shapes", "fade600->0 with linear, cosine, convex, concave and two-step shapes",
    lambda o: _path_cells(o, ["fade600"] + [f"fade600->0:{s}" for s in ("cosine", "convex", "concave", "two_step")])))

register_experiment(Experiment(
    "markov_paths", "Markov induction at p in {0.2, 0.5, 0.8}: unforced, forced_zero, fade600->0",
    lambda o: [c for p in (0.2, 0.5, 0.8) for c in
               _path_cells(o, ["unforced", "forced_zero", "fade600"], task="markov", task_options={"p": p},
                           col_of=lambda m, p=p: f"p={p}")]))

register_experiment(Experiment(
    "markov_controls", "not in the paper: Markov induction at p in {0.2, 0.5, 0.8} on five seeds, the fade beside "
    "Table 2's controls (hard switches at 1050 and 600, the post hoc zero continuation), unforced and forced_zero",
    lambda o: [c for p in (0.2, 0.5, 0.8) for c in
               _path_cells(o, list(_T2), task="markov", task_options={"p": p}, seeds=5,
                           col_of=lambda m, p=p: f"p={p}")]))

register_experiment(Experiment(
    "large_controls", "not in the paper: Table 2's hard switch at 1050 on the large model (5 seeds), beside its "
    "fade600->0 and linear anneal (Table 1's large rows)",
    lambda o: _path_cells(o, ["fade600", "linear0.5->0", "hard_switch1050"], models=("large",), seeds=5)))

register_experiment(Experiment(
    "linear_paths", "linear-regression ICL: normal and zero-gate query MSE/d (least squares is exact: 0)",
    lambda o: _path_cells(o, ["unforced", "forced_zero", "fade600"], task="linear_icl")))

register_experiment(Experiment(
    "extra_controls", "prior dropout (50% of steps at g=0) and the dual condition loss, beside unforced and fade600",
    lambda o: _path_cells(o, ["prior_dropout", "dual_loss", "unforced", "fade600"])))

register_experiment(Experiment(
    "static_baselines", "the thirteen positional baselines on every task (mean ± std over seeds)",
    lambda o: _baseline_cells(o, o.tasks or tuple(TASK_VARIANTS), evals=(NORMAL,)), curves=False))

register_experiment(Experiment(
    "gate_interventions", "a soft_bias model evaluated with the content gate, the position gate, or both zeroed",
    lambda o: [Cell(c.cfg, row="soft_bias", col=c.col, evals=(NORMAL, Eval("content=0", (None, 0.0)),
                                                                Eval("pos=0", (0.0, None)), ZERO))
               for c in _baseline_cells(o, o.tasks or ("assoc_recall",)) if c.row == "soft_bias"], curves=False))

def _length_evals(o: Options) -> tuple:
    """T = 32 and T = 120 (B^pos clipped past the training length); on a record that registered another
    reading of the length test (``length_reading``), that reading beside it."""
    evals = (NORMAL, Eval("T=120", None, 120))
    if o.record is None:
        return evals
    from .preregistration import record_reading
    chosen = record_reading(o.record)
    if chosen is None:
        return evals
    return evals + (Eval(f"T=120 ({chosen})", None, 120, optional=True, reading=chosen),)


register_experiment(Experiment(
    "length_generalisation", "associative recall trained at T=32, evaluated at T=32 and T=120, every baseline",
    lambda o: _baseline_cells(o, ("assoc_recall",), evals=_length_evals(o)), curves=False))


def _with_snapshots(o: Options, cells: list[Cell]) -> list[Cell]:
    """``cells`` whose runs keep a weight snapshot every 300 training steps (50 in a --quick run)."""
    every = 50 if o.quick else 300
    return [Cell(c.cfg.model_copy(update={"snapshot_every": every}), c.row, c.col, c.evals) for c in cells]


def _mechanism_cells(o: Options) -> list[Cell]:
    return _with_snapshots(o, _path_cells(o, ["fade600"]))


def _mechanism_analysis(store, cells, out_dir):
    from .analysis.reports import mechanism_report
    return mechanism_report(store, cells, out_dir)


register_experiment(Experiment(
    "mechanism_trace", "fade600->0 runs with a snapshot every 300 steps: successor-value mass and zero-gate "
    "ablation importance per head over training", _mechanism_cells, analysis=_mechanism_analysis))


# Calibration is its own command (``softprior calibrate``, ``softprior.calibration``): a search, not
# an experiment of the paper.


# ------------------------------------------------------------------------------------- our addition
register_experiment(Experiment(
    "late_fade", "not in the paper: fades that start after the unforced circuit has formed (S = 2000, 2400), "
    "beside unforced; tests whether a smooth fade preserves a circuit that exists",
    lambda o: _path_cells(o, ["unforced", "fade2000", "fade2400", "hard_switch2400"])))


register_experiment(Experiment(
    "mechanism_trace_late", "not in the paper: the mechanism trace of fade2400->0 runs (the fade starts after "
    "the unforced circuit has formed)", lambda o: _with_snapshots(o, _path_cells(o, ["fade2400"])),
    analysis=_mechanism_analysis))

register_experiment(Experiment(
    "mechanism_trace_large", "the mechanism trace of fade600->0 on the large model, where (unlike the base model) "
    "the circuit can form before the fade", lambda o: _with_snapshots(o, _path_cells(o, ["fade600"], models=("large",))),
    analysis=_mechanism_analysis))


# ------------------------------------------------------------------------------------- continuation
CONTINUATION_PATHS = {"assoc_recall": ["fade600", "hard_switch1050", "forced_zero", "unforced", "posthoc"],
                      "linear_icl": ["fade600", "forced_zero"]}


def _continuation_cells(o: Options, models=("base",)) -> list[Cell]:
    return _with_snapshots(o, [c for task, paths in CONTINUATION_PATHS.items()
                               for c in _path_cells(o, paths, task=task, models=models, col_of=lambda m, t=task: t)])


def _continuation_analysis(store, cells, out_dir):
    """The first min(256, n_val) validation examples, the solver's own product budget (CG to its
    tolerance, docs/CONTINUATION.md; a --quick smoke run: 32 examples, 10 products, which shows the
    shapes, not the numbers: its tangents do not converge). The full analysis measures the
    uncached traces on every core (one process each); a smoke run's are too cheap to pay for the spawns."""
    import os

    from .analysis.reports import continuation_report
    if all(c.cfg.steps <= QUICK_STEPS for c in cells):
        return continuation_report(store, cells, out_dir, n_examples=32, max_iter=10)
    n = min([256] + [c.cfg.n_val for c in cells])
    return continuation_report(store, cells, out_dir, n_examples=n, workers=os.cpu_count() or 1)


register_experiment(Experiment(
    "continuation_trace", "the paper's continuation view (Sec. 3.3), measured every 300 steps: zero-gate recovery "
    "signal on the circuit's Q/K/V/O and optimum tracking (dθ*/dg = −(G + λI)⁻¹A, damped Gauss-Newton, by CG; docs/CONTINUATION.md) along "
    "fade600->0, hard_switch1050, forced_zero, unforced, posthoc (assoc_recall) and fade600->0, forced_zero (linear_icl)",
    _continuation_cells, analysis=_continuation_analysis))

register_experiment(Experiment(
    "continuation_trace_large", "continuation_trace on the large model (where a circuit can form before the fade)",
    lambda o: _continuation_cells(o, models=("large",)), analysis=_continuation_analysis))
