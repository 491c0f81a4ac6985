"""How a sweep's runs are grouped into jobs: ``_jobs`` puts up to K compatible runs
(``engine.group_key``) in a group and orders the jobs longest first by their estimated cost
(``_job_cost``); ``--group auto`` chooses K per model size (``group_sizes``, ``choose_group_size``)
from the measured cost per run-step of each group size (``group_scaling``: this machine's table,
saved by ``softprior bench``, else the built-in ``GROUP_SCALING_BY_MODEL``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import RunConfig

__all__ = ["choose_group_size", "group_sizes", "group_scaling", "GROUP_SCALING", "GROUP_SCALING_BY_MODEL",
           "save_group_scaling", "load_group_scaling"]


# ms per run-step of a base-model group of K runs at 1 thread (each sweep worker's setting), measured by
# ``benchmarks/scaling.py`` on the development machine (docs/PERFORMANCE.md): per-op overhead is paid
# once per group, so the cost falls to K = 4-8 and rises again at 16 (the working set leaves the cache).
# ``softprior bench`` measures this machine's own table and saves it (``save_group_scaling``);
# ``--group auto`` reads that, else this one. docs/PERFORMANCE.md quotes both built-in tables (section 6,
# the "built in" rows; tests/executors/test_executors.py holds them equal).
GROUP_SCALING: dict[int, float] = {1: 7.82, 2: 8.07, 4: 6.80, 8: 6.22, 16: 6.72}
# the same for other model sizes (``model.config.size_label``), here measured on the development machine
# (session 2026-12-05, ``loop.Runs.step`` at 1 thread, assoc recall, batch 64): the large model is
# compute-bound at batch 64, so a group only adds memory traffic and it trains fastest alone (whole
# sweeps agree: docs/PERFORMANCE.md, section 6, "Group scaling"). A model size without a table uses
# the base one.
GROUP_SCALING_BY_MODEL: dict[str, dict[int, float]] = {"base": GROUP_SCALING,
                                                       "large": {1: 45.8, 2: 48.6, 4: 50.6, 6: 48.2}}


def _scaling_file():
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "softprior" / "group_scaling.json"


def save_group_scaling(scaling: dict[int, float], model: str = "base") -> str:
    """Save this machine's measured group scaling of ``model`` (a size label) where ``--group auto``
    finds it (one file; the other sizes' tables in it are kept)."""
    f = _scaling_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    import torch
    tables = _saved_tables()
    tables[model] = {str(k): v for k, v in scaling.items()}
    f.write_text(json.dumps({"ms_per_run_step": tables.get("base", {}),
                             "by_model": {m: t for m, t in tables.items() if m != "base"},
                             "torch": torch.__version__}))
    return str(f)


def _saved_tables() -> dict[str, dict]:
    try:
        d = json.loads(_scaling_file().read_text())
        tables = {"base": dict(d["ms_per_run_step"]), **{m: dict(t) for m, t in d.get("by_model", {}).items()}}
        return {m: t for m, t in tables.items() if t}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load_group_scaling(model: str = "base") -> dict[int, float] | None:
    """The saved table of ``model`` (``save_group_scaling``), or None when this machine has none (or it
    is unreadable)."""
    try:
        return {int(k): float(v) for k, v in _saved_tables()[model].items()} or None
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def group_scaling(model: str = "base") -> dict[int, float]:
    """The table ``--group auto`` uses for a model size: this machine's (``softprior bench``) if saved,
    else the development machine's (``GROUP_SCALING_BY_MODEL``), else the base model's."""
    return load_group_scaling(model) or GROUP_SCALING_BY_MODEL.get(model) or load_group_scaling() or GROUP_SCALING


def choose_group_size(n_runs: int, workers: int, scaling: dict[int, float] | None = None) -> int:
    """``--group auto``: the K that finishes ``n_runs`` soonest on ``workers`` workers, by the measured
    per-run-step time (``scaling``: K -> ms per run-step; default: the base model's ``group_scaling``).

    A K makes ceil(n / K) groups of equal size s (as ``_jobs`` builds them) that run in
    ceil(groups / workers) rounds, so the sweep takes ~ rounds x s x ms(s) per step (ms linearly
    interpolated between the measured K, the last one beyond). The smallest K within 5% of the best
    estimate wins: smaller groups balance better where the table's differences are noise. (9 runs on
    2 workers: K = 5, two groups at once, not K = 4, whose three groups leave one to run alone.)"""
    if scaling is None:
        scaling = group_scaling()
    n, w = max(1, n_runs), max(1, workers)
    ks = sorted(scaling)

    def ms(k):
        if k <= ks[0]:
            return scaling[ks[0]]
        for a, b in zip(ks, ks[1:]):
            if k <= b:
                return scaling[a] + (scaling[b] - scaling[a]) * (k - a) / (b - a)
        return scaling[ks[-1]]

    def estimate(k):
        groups = -(-n // k)
        size = -(-n // groups)
        return -(-groups // w) * size * ms(size)
    est = {k: estimate(k) for k in range(1, min(n, ks[-1]) + 1)}
    best = min(est.values())
    return min(k for k, e in est.items() if e <= 1.05 * best)


def group_sizes(cfgs: list[RunConfig], group_size: int | str, workers: int) -> dict[str, int]:
    """The group size of each model size (``model.config.size_label``) among ``cfgs``: ``group_size`` for
    all, or for "auto" each size's own ``choose_group_size`` over its own table and run count."""
    from collections import Counter

    from ..model.config import size_label
    counts = Counter(size_label(c.model) for c in cfgs)
    if group_size == "auto":
        return {m: choose_group_size(n, workers, group_scaling(m)) for m, n in counts.items()}
    return {m: group_size for m in counts}


def _jobs(cfgs: list[RunConfig], group_size: int | dict[str, int], kept: list[list[str]] = ()) -> list[list[RunConfig]]:
    """The jobs of a sweep: groups of up to ``group_size`` compatible runs (``engine.group_key``;
    ``group_size`` one K, or one per model size as ``group_sizes`` gives). A group in ``kept`` (run ids
    of a group checkpoint that a killed sweep left) is kept together, so it resumes where it stopped,
    whatever size the new plan would give it."""
    from ..training.engine import group_key
    from ..model.config import size_label
    by_id = {c.run_id: c for c in cfgs}
    jobs = [[by_id[r] for r in g] for g in kept]
    cfgs = [c for c in cfgs if not any(c.run_id in g for g in kept)]
    sizes = group_size if isinstance(group_size, dict) else {size_label(c.model): group_size for c in cfgs}
    buckets: dict[str, list[RunConfig]] = {}
    # snapshot runs train alone: a single run's checkpoint keeps its snapshots so far, a group's does not
    jobs += [[c] for c in cfgs if c.snapshot_every]
    for c in (c for c in cfgs if not c.snapshot_every):
        buckets.setdefault(group_key(c), []).append(c)
    for b in buckets.values():
        n = -(-len(b) // max(1, sizes.get(size_label(b[0].model), 1)))  # as few groups as K allows, equal (13 -> 5, 4, 4)
        jobs += [b[i::n] for i in range(n)]
    # longest first (LPT): the costly groups start early and the short ones fill in at the end, so the
    # workers finish together instead of the last large group running alone
    return sorted(jobs, key=_job_cost, reverse=True)


# a step of a positional scheme against a fast-path step of the same size without one, where they
# differ: the contextual schemes run their own code on every logit (benchmarks/contextual_fastpath.py,
# column "fast / nope": 1 thread, assoc recall and Markov, K = 1 and 4; the ranges measured are in
# docs/PERFORMANCE.md, section 4, "Positional schemes"). Every other scheme costs about what the soft
# prior's step does.
STEP_COST: dict[str, float] = {"cope": 3.0, "dape": 3.7, "gpsa": 1.5}
# a step through vmap of the readable model (a scheme the fast path does not know, or active hooks)
# against a plain fast-path step: NoPE and the bias schemes' readable -> fast ratios (docs/PERFORMANCE.md,
# section 4, "Positional schemes"); a contextual scheme there costs about its own factor, in the same benchmark
READABLE_STEP_COST = 2.0


def _job_cost(job: list[RunConfig]) -> float:
    """A relative cost estimate for scheduling: steps x runs x layers x width^2 x context, times the
    scheme's measured factor (``STEP_COST``), at least ``READABLE_STEP_COST`` off the fast path."""
    from ..model.fastpath import supports
    m = job[0].model
    factor = STEP_COST.get(m.positional, 1.0)
    if not supports(m):
        factor = max(factor, READABLE_STEP_COST)
    return job[0].total_steps * len(job) * m.n_layers * m.d_model ** 2 * m.n_ctx * factor
