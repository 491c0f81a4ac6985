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

    @property
    def from_summary(self) -> bool:
        return self.length is None and self.gates in (None, (None, None), (0.0, 0.0))


NORMAL = Eval("normal")
ZERO = Eval("zero", (0.0, 0.0))


@dataclass
class Cell:
    cfg: RunConfig
    row: str
    col: str = ""
    evals: tuple[Eval, ...] = (ZERO, NORMAL)
