"""softprior: annealable soft-prior Transformers and circuit-removability experiments
(after "Training Trajectories Determine Circuit Removability in Annealable Soft-Prior Transformers").

The public names are imported on first use (PEP 562), so ``import softprior`` and the command
line's ``--help`` and listings do not import torch."""

from __future__ import annotations

import importlib

_API = {"RunConfig": "config", "make_run_config": "config", "ModelConfig": "model.config",
        "SoftPriorTransformer": "model.transformer", "model_preset": "model.config", "GateConfig": "paths", "PathConfig": "paths",
        "get_path": "paths", "register_path": "paths", "run": "executors.sweep", "RunStore": "store",
        "load_results": "store", "train": "training.loop"}

__all__ = list(_API)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_API})
