"""Run one config against a store: ``softprior train`` and the Python API. It is a sweep of one
(``executors.execute``), so a single run, a local sweep and a Ray sweep share one code path:
finished runs are never trained again, derived runs (post hoc continuation) train their parent
first, and a run killed mid-way resumes from its last checkpoint."""

from __future__ import annotations

from .config import RunConfig
from .store import RunStore, StoreError

__all__ = ["run", "RunFailedError"]


class RunFailedError(StoreError):
    pass


def run(cfg: RunConfig, store: RunStore, *, progress: bool = False, require_calibration: bool = True) -> dict:
    """Ensure ``cfg`` is trained and stored; return its summary. A prediction row needs a
    pre-registered calibration record unless ``require_calibration=False`` (``store.record_clock.check_calibrated``)."""
    from .executors import execute
    if not store.is_done(cfg.run_id):
        report = execute([cfg], store, progress=progress, sweep_bar=False, require_calibration=require_calibration)
        if report.failed:
            rid, err = report.failed[-1]
            raise RunFailedError(f"run {rid} failed: {err.strip().splitlines()[0]}")
    return store.summary(cfg.run_id)
