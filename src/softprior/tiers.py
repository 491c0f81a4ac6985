"""The paper's numbers in two tiers, declared once, as data (beside the claims, ``claims.py``).

- **Identification rows**: numbers the paper measured without a gate trajectory: a constant or a
  learned gate, or no prior at all (the difficulty rows of both sizes, the constant gate of Table 1,
  the static baselines of Sec. 4.1, the gate interventions, the length test, the parameter counts of
  Sec. 3). They describe the model and the task, so they are calibration targets: a candidate model is
  *identified* by how many of them it matches (``calibration/criteria.py::identification_criteria``,
  ``docs/CALIBRATION.md``).
- **Trajectory predictions**: everything that removes or changes the prior during training (the fades,
  the linear anneal, the hard switches, post hoc continuation, prior dropout, the dual loss, the Markov
  and linear-ICL fades, the mechanism timing, the continuation claims). Nothing is tuned on them; they
  are decided by the claims (``claims.py``) on a configuration registered before they run.

Each row carries the paper's value, its spread where the paper gives one (the ± of Tables 1-2, a
standard deviation over seeds), and a one-line reason for its tier. ``tiers_spec()`` is what a
calibration record registers (its hash covers the tier assignment), so a row cannot move between tiers
after the results were seen.

The distance of a measurement from a row is in units of ``scale``: the paper's spread, but never below
``SE_FLOOR`` (one standard error of an accuracy near .78 on the 512 validation examples:
sqrt(.78 x .22 / 512) = .018, rounded up to .02; a paper spread of .003 is below what 512 examples can
resolve), or the row's stated tolerance where the paper gives no spread. A row is *matched* within
``MATCH_Z`` such units. This module imports nothing from the package (a bottom layer).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PaperRow", "SE_FLOOR", "MATCH_Z", "IDENTIFICATION", "TRAJECTORY", "ROWS", "tiers_spec", "rows_for",
           "length_row", "READS"]

SE_FLOOR = 0.02
MATCH_Z = 2.0
# what a row reads of a trained run: its summary at the model's own gates ("normal") or every gate 0
# ("zero"), an evaluation with one gate forced to 0, at length 120, both gates at .5 ("g=.5": a
# masked-gate path's "normal" is read at sigmoid(initial logit), the constant gate trained at .5), or
# the model's parameter count in thousands ("params"; no training needed)
READS = ("normal", "zero", "pos=0", "content=0", "T=120", "g=.5", "params")


@dataclass(frozen=True)
class PaperRow:
    name: str
    tier: str  # "identification" | "trajectory"
    task: str
    model: str  # "base" | "large"
    source: str  # path (e.g. "forced_const0.5") or static baseline (e.g. "soft_pos_only")
    read: str  # one of READS; "" for a qualitative or trajectory row without one number
    paper: float | None
    spread: float | None = None  # the paper's ± (sd over seeds), where it gives one
    tol: float | None = None  # a stated tolerance where the paper gives no spread
    reason: str = ""
    where: str = ""  # where the paper reports it
    search: bool = False  # measured on every candidate of an identification search at its size (``model``)

    @property
    def scale(self) -> float:
        """The unit of distance: the paper's spread (at least ``SE_FLOOR``), else the stated tolerance."""
        if self.spread is not None:
            return max(self.spread, SE_FLOOR)
        return self.tol if self.tol is not None else SE_FLOOR

    def z(self, value: float) -> float:
        """|value - paper| in units of ``scale``."""
        return abs(value - self.paper) / self.scale

    def matched(self, value: float) -> bool:
        return self.z(value) <= MATCH_Z


_STATIC = "no gate trajectory: a learned or constant gate"
_NOPRIOR = "no prior at any step"


def _id(name, model, source, read, paper, spread=None, tol=None, reason="", where="", search=False, task="assoc_recall"):
    return PaperRow(name, "identification", task, model, source, read, paper, spread, tol, reason, where, search)


def _tr(name, source, where, reason, task="assoc_recall", model="base", read="zero", paper=None, spread=None):
    return PaperRow(name, "trajectory", task, model, source, read, paper, spread, None, reason, where)


IDENTIFICATION: list[PaperRow] = [
    # Table 1, base: the difficulty rows and the constant gate
    _id("unforced base normal", "base", "unforced", "normal", 0.780, 0.007, reason=_STATIC + " (both learned)",
        where="Table 1", search=True),
    _id("unforced base zero", "base", "unforced", "zero", 0.100, 0.006, reason=_STATIC + " (both learned), "
        "evaluated with the prior off", where="Table 1", search=True),
    _id("forced_zero base zero", "base", "forced_zero", "zero", 0.094, 0.013, reason=_NOPRIOR, where="Table 1",
        search=True),
    _id("forced_const0.5 base zero", "base", "forced_const0.5", "zero", 0.114, 0.006,
        reason="a constant gate: the prior never changes during training", where="Table 1", search=True),
    _id("forced_const0.5 base normal", "base", "forced_const0.5", "normal", 0.164, 0.003,
        reason="a constant gate: the prior never changes during training", where="Table 1", search=True),
    # Table 1, large
    _id("unforced large normal", "large", "unforced", "normal", 0.797, 0.017, reason=_STATIC, where="Table 1",
        search=True),
    _id("unforced large zero", "large", "unforced", "zero", 0.102, 0.005, reason=_STATIC, where="Table 1", search=True),
    _id("forced_zero large zero", "large", "forced_zero", "zero", 0.102, 0.010, reason=_NOPRIOR, where="Table 1",
        search=True),
    _id("forced_const0.5 large zero", "large", "forced_const0.5", "zero", 0.160, 0.011, reason="a constant gate",
        where="Table 1", search=True),
    _id("forced_const0.5 large normal", "large", "forced_const0.5", "normal", 0.212, 0.024, reason="a constant gate",
        where="Table 1", search=True),
    # Sec. 3: parameter counts ("about 35K", "about 265K"), in thousands; a stated tolerance of 3%
    _id("parameters base (K)", "base", "unforced", "params", 35.0, tol=35.0 * 0.03 / 2,
        reason="the architecture itself; no training", where="Sec. 3", search=True),
    _id("parameters large (K)", "large", "unforced", "params", 265.0, tol=265.0 * 0.03 / 2,
        reason="the architecture itself; no training", where="Sec. 3", search=True),
    # Sec. 4.1: static baselines on associative recall (soft_bias is the unforced path)
    _id("soft_pos_only normal", "base", "soft_pos_only", "normal", 0.783, tol=0.03, reason=_STATIC,
        where="Sec. 4.1, static baselines"),
    _id("soft_content_only normal", "base", "soft_content_only", "normal", 0.067, tol=0.03, reason=_STATIC,
        where="Sec. 4.1, static baselines"),
    # Sec. 4.2: gate interventions on a normally trained soft_bias model
    _id("soft_bias content gate 0", "base", "unforced", "content=0", 0.791, tol=0.03,
        reason="an evaluation-time intervention on a model trained with learned gates", where="Sec. 4.2",
        search=True),
    _id("soft_bias position gate 0", "base", "unforced", "pos=0", 0.073, tol=0.03,
        reason="an evaluation-time intervention on a model trained with learned gates", where="Sec. 4.2",
        search=True),
    # Sec. 4.5: length generalisation
    _id("soft_bias at T = 120", "base", "unforced", "T=120", 0.263, tol=0.05,
        reason="a model trained with learned gates, evaluated at a longer length", where="Sec. 4.5", search=True),
    # Sec. 4.4: linear ICL difficulty rows (query MSE relative to the zero predictor)
    _id("linear_icl unforced normal", "base", "unforced", "normal", 0.0656, tol=0.015, reason=_STATIC,
        where="Sec. 4.4", task="linear_icl"),
    _id("linear_icl forced_zero zero", "base", "forced_zero", "zero", 0.0722, tol=0.015, reason=_NOPRIOR,
        where="Sec. 4.4", task="linear_icl"),
    # qualitative static rows, stated as predicates (decided by the static_baselines table)
    PaperRow("soft_bias highest of 13 (assoc_recall)", "identification", "assoc_recall", "base", "soft_bias", "",
             0.794, 0.022, None, "static baselines: no gate trajectory", "Sec. 4.1"),
    PaperRow("linear_icl: soft_pos_only, t5, soft_bias, dape within 1.5%", "identification", "linear_icl", "base",
             "static", "", None, None, 0.015, "static baselines: no gate trajectory", "Sec. 4.1"),
    PaperRow("markov: soft_bias among the strongest, especially at p = .2", "identification", "markov", "base",
             "static", "", None, None, None, "static baselines: no gate trajectory", "Sec. 4.1"),
]

_REMOVES = "the prior is removed or changed during training"
TRAJECTORY: list[PaperRow] = [
    _tr("fade600 base", "fade600", "Table 1", _REMOVES + " (a fade)", paper=0.734, spread=0.028),
    _tr("fade600 large", "fade600", "Table 1", _REMOVES + " (a fade)", model="large", paper=0.731, spread=0.024),
    _tr("linear0.5->0 base", "linear0.5->0", "Table 1", _REMOVES + " (a linear anneal)", paper=0.617, spread=0.024),
    _tr("linear0.5->0 large", "linear0.5->0", "Table 1", _REMOVES + " (a linear anneal)", model="large",
        paper=0.635, spread=0.040),
    _tr("hard switch 1050", "hard_switch1050", "Table 2", _REMOVES + " (an abrupt switch)", paper=0.293),
    _tr("hard switch 600", "hard_switch600", "Table 2", _REMOVES + " (an abrupt switch)", paper=0.097),
    _tr("post hoc continuation", "posthoc", "Table 2", _REMOVES + " (after training)", paper=0.178),
    _tr("fade window S in 400-800", "fade*", "Sec. 4.3", _REMOVES + " (fades at other starts)"),
    _tr("fade shapes", "fade600->0:*", "Sec. 4.3", _REMOVES + " (fades of other shapes)"),
    _tr("prior dropout", "prior_dropout", "Sec. 4.6", "the prior is switched off on random steps"),
    _tr("dual condition loss", "dual_loss", "Sec. 4.6", "every step also trains with the prior off"),
    _tr("markov fade", "fade600", "Sec. 4.3", _REMOVES + " (a fade)", task="markov"),
    _tr("linear_icl fade", "fade600", "Sec. 4.4", _REMOVES + " (a fade)", task="linear_icl"),
    _tr("mechanism timing", "fade600", "Sec. 4.7", "when a circuit forms along a fade"),
    _tr("continuation claims", "*", "Sec. 3.3", "how the optimum moves as the gate changes"),
]

ROWS: list[PaperRow] = IDENTIFICATION + TRAJECTORY


def length_row(task: str) -> PaperRow | None:
    """The paper's length test of ``task`` (its identification row read at T = 120: associative recall's
    soft_bias .263), or None where the paper has none."""
    return next((r for r in IDENTIFICATION if r.task == task and r.read == "T=120"), None)


def rows_for(task: str, tier: str = "identification", search_only: bool = False) -> list[PaperRow]:
    return [r for r in ROWS if r.task == task and r.tier == tier and (r.search or not search_only)]


def tiers_spec() -> list[dict]:
    """The tier assignment as a record registers it: every row's name, tier, paper value, spread,
    tolerance and reason (sorted by name, so the hash does not depend on declaration order)."""
    return sorted(({"name": r.name, "tier": r.tier, "task": r.task, "model": r.model, "source": r.source,
                    "read": r.read, "paper": r.paper, "spread": r.spread, "tol": r.tol, "reason": r.reason}
                   for r in ROWS), key=lambda d: d["name"])
