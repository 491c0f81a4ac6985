"""Run one config against a store: the single code path behind ``softprior train``, local sweeps and
Ray sweeps. Finished runs are never trained again; derived runs (post hoc continuation) train their
parent first; a run killed mid-way resumes from its last checkpoint."""

from __future__ import annotations

from .config import RunConfig
from .store import RunStore, StoreError
from .train import RunResult, train

__all__ = ["run", "RunBusyError", "train_pure"]


class RunBusyError(StoreError):
    pass


def train_pure(cfg: RunConfig, init_state=None, resume=None, on_checkpoint=None, progress=False) -> RunResult:
    """Config in, result out: no store access (what a remote worker runs)."""
    return train(cfg, init_state=init_state, resume=resume, on_checkpoint=on_checkpoint, progress=progress)


def run(cfg: RunConfig, store: RunStore, *, progress: bool = False) -> dict:
    """Ensure ``cfg`` is trained and stored; return its summary."""
    if store.is_done(cfg.run_id):
        return store.summary(cfg.run_id)
    init_state = None
    parent = cfg.parent()
    if parent is not None:
        run(parent, store, progress=progress)
        init_state = store.load_state(parent.run_id)
    if not store.claim(cfg):
        if store.is_done(cfg.run_id):
            return store.summary(cfg.run_id)
        raise RunBusyError(f"run {cfg.run_id} is being trained by another process")
    resume = store.load_checkpoint(cfg.run_id)
    try:
        result = train_pure(cfg, init_state=init_state, resume=resume,
                            on_checkpoint=lambda c: store.save_checkpoint(cfg.run_id, c), progress=progress)
    except KeyboardInterrupt:
        store.release(cfg.run_id)
        raise
    except Exception as e:
        store.record_failure(cfg, f"{type(e).__name__}: {e}")
        raise
    store.save_result(result)
    return result.summary
