"""Table cells: one run config plus where its numbers go in a table (``row``, ``col``) and which
evaluations to read from it (``Eval``). The experiments (``softprior.experiments``) build them and the
reports (``softprior.report``, ``softprior.analysis.reports``) read them; a module of its own, below
both, so that neither has to import the other for the type.

"normal" and "zero" at the training length come from the stored run summary; other evaluations are
computed from the stored weights at report time (cheap and deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import RunConfig

__all__ = ["Eval", "Cell", "NORMAL", "ZERO"]


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
    t_cfg = cfg.task
    if name == "pairs fill":
        room = t_cfg.vocab - 1 - t_cfg.n_keys if t_cfg.keys == "replacement" else (t_cfg.vocab - 1) // 2
        t_cfg = t_cfg.model_copy(update={"n_pairs": max(t_cfg.n_pairs, min(room, t_cfg.n_pairs * length
                                                                           // cfg.model.n_ctx))})
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
