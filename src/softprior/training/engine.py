"""Which runs may train together, and the entry point for a group of them (for sweeps).

The training loop itself is ``loop.train_runs`` (``loop.Runs``: the K runs' parameters stacked on a
leading run dimension, one step and one evaluation for all of them); ``loop.train`` is the same
loop with K = 1, so a run's per-step rules (gates, prior dropout, dual loss, clipping, logging)
exist once. Every model ``fastpath.supports`` (no positional scheme, or any registered one: bias,
absolute, rotary or contextual) runs through ``fastpath.fast_forward``, written for the run dimension;
a model it does not support (a scheme it does not know) applies the readable model with
``torch.func.vmap(functional_call(...))``. Either way every op runs once per step for all K runs,
so the per-op overhead that dominates a tiny model is paid once, not K times. On a GPU the same
code path trains a whole sweep in a few kernels per op.

Runs in a group must share everything that fixes tensor shapes and the optimiser: task, model,
batch size, step budget, learning rate, weight decay, eval interval and validation set
(``group_key``); they may differ in path, seed, gradient clipping and (on the fast path)
initialisation. A group checkpoints and resumes as a single run does (``loop.checkpoint``: the
stacked weights, the optimiser state, every run's generators), bit-identically; the checkpoint names
its runs, and resuming it into another group is refused.
"""

from __future__ import annotations

import json

import torch

from ..model import fastpath
from ..config import RunConfig
from .loop import RunResult, train_runs

__all__ = ["train_group", "group_key"]


# initialisation-only model fields: read by the model's constructor (each run builds its own model
# from its own config), never by the fast forward, so runs that differ only in them can share a group
INIT_ONLY = ("embed_init_std", "content_init_std", "prior_init", "prior_layers", "prior_scale", "prior_cap",
             "gate_logit_init")


def group_key(cfg: RunConfig) -> str:
    """Configs with equal keys can share a group: they differ only in path, seed, gradient clipping
    and (on the fast path) initialisation."""
    d = cfg.canonical()
    for k in ("path", "seed", "grad_clip"):
        d.pop(k, None)
    if fastpath.supports(cfg.model):
        for k in INIT_ONLY:
            d["model"].pop(k, None)
    d["total_steps"] = cfg.total_steps
    d["has_parent"] = cfg.path.parent is not None
    return json.dumps(d, sort_keys=True)


def train_group(cfgs: list[RunConfig], init_states: list[dict] | None = None, progress: bool = False,
                device: str | torch.device | None = None, *, resume: dict | None = None,
                on_checkpoint=None, checkpoint_seconds: float | None = None) -> list[RunResult]:
    """Train ``cfgs`` together. ``device``: where the stacked parameters and batches live (default
    ``$SOFTPRIOR_DEVICE`` or ``cpu``; e.g. ``cuda``). Data is drawn on the CPU from each run's own
    generator and copied over, so a run's numbers depend only on its config, not on the device's RNG.
    Results (weights, metrics) come back on the CPU. Applies ``runtime.prepare_training()``
    (the allocator setting).

    resume / on_checkpoint / checkpoint_seconds: as in ``loop.train``, for the whole group (the
    first config's ``checkpoint_every``); the checkpoint's ``meta["run_ids"]`` names the runs, in order."""
    if not cfgs:
        return []
    keys = {group_key(c) for c in cfgs}
    if len(keys) != 1:
        raise ValueError("train_group needs configs that differ only in path, seed, grad_clip and initialisation")
    return train_runs(cfgs, init_states, progress=progress, device=device, resume=resume, on_checkpoint=on_checkpoint,
                      checkpoint_seconds=checkpoint_seconds)
