"""Table cells: one run config plus where its numbers go in a table (``row``, ``col``) and which
evaluations to read from it (``Eval``). The experiments (``softprior.experiments``) build them and the
reports (``softprior.reports.experiment``, ``softprior.analysis.reports``) read them; a module of its own, below
both, so that neither has to import the other for the type.

"normal" and "zero" at the training length come from the stored run summary; other evaluations are
computed from the stored weights at report time (cheap and deterministic): ``evaluate_cell``, which the
reports and the calibration search read a cell with, as they read a run's ``formation_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import RunConfig

if TYPE_CHECKING:
    from .store import RunStore

__all__ = ["Eval", "Cell", "NORMAL", "ZERO", "evaluate_cell", "formation_step"]


@dataclass(frozen=True)
class Eval:
    name: str
    gates: tuple | None = None  # (g_pos, g_content); None entries keep the model's own gate
    length: int | None = None  # None: the training context
    optional: bool = False  # a reading added after a bundle was written: where it lacks it, not measured
    # past the training length, how B^pos and the context are read (calibration.identify.LENGTH_VARIANTS;
    # None: "clip", the model's own pos_beyond)
    reading: str | None = None

    @property
    def from_summary(self) -> bool:
        return self.length is None and self.gates in (None, (None, None), (0.0, 0.0))


# What the paper leaves open about length (Sec. 4.5 gives only soft_bias at T = 120, .263): B^pos past
# the training length (clipped to the last learned offset, or no bias), and whether the context keeps
# its pairs or fills with more of them as in MQAR (at most vocab - 1 - n_keys distinct values; the
# Bayes ceiling falls with the number of pairs). Evaluation-only: the same weights, read three ways.
LENGTH_VARIANTS = ("clip", "no bias beyond", "pairs fill")


def length_view(cfg, model, name: str, length: int):
    """(run config, model) read under the length reading ``name`` (``LENGTH_VARIANTS``) at ``length``: B^pos
    clipped or zero past the training length (the model's ``pos_beyond``, set on ``model`` in place), and
    the context's pairs as trained or filling the longer context."""
    if name not in LENGTH_VARIANTS:
        raise ValueError(f"unknown length reading {name!r}; one of {', '.join(LENGTH_VARIANTS)}")
    t_cfg = cfg.task.filling(length, cfg.model.n_ctx) if name == "pairs fill" else cfg.task
    m_cfg = cfg.model.model_copy(update={"pos_beyond": "zero" if name == "no bias beyond" else "clip"})
    model.cfg = m_cfg
    for block in model.blocks:
        block.attn.cfg = m_cfg
    return cfg.model_copy(update={"task": t_cfg}), model


NORMAL = Eval("normal")
ZERO = Eval("zero", (0.0, 0.0))
# "normal" on a path whose gates are forced (masked logits) reads sigmoid(initial logit); where that is not
# .5, tables read both gates at .5 beside it (``readings``)
HALF = Eval("g=.5", (0.5, 0.5), optional=True)


def masked(cfg) -> bool:
    """Whether a run's "normal" reading is at sigmoid(initial logit) rather than at a trained gate: a path
    that forces a gate (its logit masked) on a model whose initial logit is not 0 (sigmoid .5)."""
    return cfg.model.gate_logit_init != 0.0 and any(g.mode != "learned" for g in (cfg.path.pos, cfg.path.content))


def readings(cfg, evals: tuple) -> tuple:
    """``evals``, with the g = .5 reading after "normal" where the run's "normal" is not at .5 (``masked``)."""
    if NORMAL not in evals or HALF in evals or not masked(cfg):
        return evals
    i = evals.index(NORMAL)
    return evals[:i + 1] + (HALF,) + evals[i + 1:]


@dataclass
class Cell:
    cfg: RunConfig
    row: str
    col: str = ""
    evals: tuple[Eval, ...] = (ZERO, NORMAL)


def evaluate_cell(store: RunStore, cell: Cell, ev: Eval, _cache: dict | None = None) -> float:
    """``cell``'s run under ``ev``: from its summary ("normal", "zero"), else computed from its weights
    (asked of the source as ``evaluation``: a bundle gives back the value it recorded)."""
    from .bundle import ask
    cfg = cell.cfg
    summary = store.summary(cfg.run_id)
    m = summary["metric"]
    if ev.from_summary:
        return float(summary[("zero_" if ev.gates == (0.0, 0.0) else "normal_") + m])
    key = {"run": cfg.run_id, "gates": list(ev.gates) if ev.gates is not None else None, "length": ev.length,
           "metric": m, **({"reading": ev.reading} if ev.reading else {})}
    return float(ask(store, "evaluation", key, lambda: _evaluate_weights(store, cell, ev, m, _cache)))


def _evaluate_weights(store, cell: Cell, ev: Eval, m: str, _cache: dict | None) -> float:
    from .tasks.generators import make_task
    from .training.loop import evaluate
    cfg = cell.cfg
    key = cfg.run_id
    if _cache is not None and key in _cache:
        model = _cache[key]
    else:
        _, model = store.load_model(cfg.run_id)
        if _cache is not None:
            _cache[key] = model
    length = ev.length or cfg.model.n_ctx
    if ev.reading:  # the same weights read past the training length as the record registered (a copy of
        # the model: the view changes its config in place)
        cfg, model = length_view(cfg, store.load_model(cfg.run_id)[1], ev.reading, length)
    task = make_task(cfg.task)
    val = cfg.validation_batch(task, length=length)
    gp, gc = ev.gates if ev.gates is not None else (None, None)
    return float(evaluate(model, task, val.inputs, val.targets, gp, gc)[m])


def formation_step(metrics: list[dict], metric: str = "acc", level: float = 0.5) -> int | None:
    """The first evaluated step at which normal accuracy exceeds ``level``: when the circuit forms
    (a diagnostic, never a calibration target)."""
    for r in metrics:
        if r.get(f"normal_{metric}", 0.0) > level:
            return int(r["step"])
    return None
