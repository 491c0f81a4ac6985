"""Continuation traces over a run's snapshots: the gates a path applies (``path_gates``), where it
removes the prior (``removal_step``), and per snapshot the recovery signal, its controls and the
tracking of the optimum (``continuation_trace``; several runs' traces in worker processes:
``continuation_traces``). The package docstring (``softprior.analysis.continuation``) says what
the quantities are."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ...model.transformer import SoftPriorTransformer
from .core import CURVATURES, MAX_ITER, REL_DAMPING, TOL, RecoverySignal, _cos, recovery_signal_fn
from .model import ParamLayout, circuit_mask, model_loss, optimum_tangent, solution_cosine, zero_gate_mask

__all__ = ["continuation_trace", "removal_step", "path_gates"]


def path_gates(path, step: int, total_steps: int, state: dict | None = None, model=None) -> tuple[float, float]:
    """The (g_pos, g_content) the path applies at ``step``: the schedule's value, or for a learned
    gate the model's own sigmoid(logit) from ``state`` (loaded into ``model``), averaged over units."""
    out = []
    for i, gc in enumerate((path.pos, path.content)):
        v = gc.value_at(step, total_steps)
        if v is None:
            logits = (state or {}).get("gate_logits")
            if logits is None and model is not None:
                logits = model.gate_logits
            v = float(torch.sigmoid(logits[i].detach()).mean()) if logits is not None else float("nan")
        out.append(float(v))
    return out[0], out[1]


def removal_step(path, total_steps: int) -> int:
    """Where the path removes the prior: 0 if both gates start at 0 (forced_zero, post hoc
    continuation), the final step if a gate is learned (unforced: removal would come after training),
    else the last step before a gate first falls below its step-0 value, the last prior-trained state
    (fade S: S; hard switch at s: s - 1)."""
    if path.pos.mode == "learned" or path.content.mode == "learned":
        return total_steps
    g0 = [g.value_at(0, total_steps) for g in (path.pos, path.content)]
    if max(g0) == 0.0:
        return 0
    for s in range(1, total_steps + 1):
        if any(g.value_at(s, total_steps) < v for g, v in zip((path.pos, path.content), g0)):
            return s - 1
    return total_steps


def _as_heads(circuit) -> list[tuple[int, int]] | None:
    """The circuit as (layer, head) pairs, or None when it is given otherwise (names, masks)."""
    if torch.is_tensor(circuit) or isinstance(circuit, dict):
        return None
    items = list(circuit)
    if not items or any(isinstance(x, str) for x in items):
        return None
    return [(int(l), int(h)) for l, h in items]


def _other_heads_share(rs: RecoverySignal, other_masks, heads) -> float:
    """A second control: the share of k random heads outside the circuit (k = len(heads)), as the root
    of its mean square, sqrt(k mean_{h not in C} ||P_h grad||^2) / ||grad|| (squared shares of disjoint
    coordinate sets add). NaN without a head circuit or without other heads."""
    if not heads or not other_masks or rs.grad_norm == 0:
        return float("nan")
    sq = [float(torch.linalg.vector_norm(rs.grad[m])) ** 2 for m in other_masks]
    return math.sqrt(len(heads) * sum(sq) / len(sq)) / rs.grad_norm


def continuation_trace(snapshots: Sequence[tuple[int, dict]], cfg, circuit, batch=None, n_examples: int = 256,
                       damping: float | None = None, max_iter: int = MAX_ITER, method: str = "cg",
                       n_control: int = 8, step_offset: int = 0, task=None, tol: float = TOL, curvature: str = "ggn",
                       rel_damping: float = REL_DAMPING):
    """Per snapshot of one run (a pandas DataFrame, one row per snapshot, in step order):

        step, g_pos, g_content, signal, grad_norm, share, control_share, expected_share,
        other_heads_share, solution_cos, dg_pos, dg_content, tracking_cos, norm_ratio, residual,
        rel_residual, cg_iters, negative_curvature, damping, curvature_scale, converged, damping_cos, seconds

    - ``signal``, ``share``, ``control_share``: ``recovery_signal`` at the zero gate with the circuit
      ``circuit`` (see ``circuit_mask``); ``other_heads_share``: the same number of heads outside the
      circuit (``_other_heads_share``; for a circuit given as heads); ``solution_cos`` = cos(-grad_theta L(theta_s, 0),
      theta_final - theta_s) (is the zero-gate descent direction aligned with where the run ends?).
    - ``tracking_cos``: for consecutive snapshots s, s', the tangent at s along the path's gate
      change w = g(s') - g(s) (so t_w predicts theta(s') - theta(s) to first order) against the actual
      change: ``tracking_cosine``; ``norm_ratio`` = ||t_w|| / ||theta(s') - theta(s)||. NaN where the
      gate did not change (nothing to track) and on the last snapshot. ``residual``/``rel_residual``/
      ``cg_iters``/``negative_curvature``/``damping``/``curvature_scale``/``damping_cos``: the solver's
      report (``Tangent``: the curvature ``curvature``; the damping lambda used, ``rel_damping`` x the
      snapshot's curvature scale unless ``damping`` is given; the relative tolerance ``tol``, at most
      ``max_iter`` products; the cosine with the tangent at 10 lambda); ``converged``: False where a tangent was
      solved and missed ``tol`` (True on the rows without a tangent), so ``df["converged"].all()`` says
      whether every tracking cosine of the trace rests on a converged tangent.
    - ``seconds``: the wall time of the snapshot's measurements.

    The batch is the run's validation set (the first ``n_examples`` of ``cfg.val_seed`` at length
    ``cfg.model.n_ctx``), the same for every snapshot; gates are the path's (``path_gates``).
    ``step_offset`` is added to the reported steps (a post hoc continuation starts at its parent's end).
    ``continuation_traces`` measures several runs' traces in worker processes.
    """
    import pandas as pd

    snaps = sorted(((int(s), sd) for s, sd in snapshots), key=lambda x: x[0])
    if not snaps:
        return pd.DataFrame()
    ctx = _TraceContext(snaps, cfg, circuit, batch, n_examples, damping, max_iter, method, n_control, step_offset,
                        task, tol, curvature, rel_damping)
    return pd.DataFrame([ctx.row(i) for i in range(len(snaps))])


def continuation_traces(specs: Sequence[dict], workers: int = 1, on_trace: Callable | None = None) -> list:
    """``continuation_trace(**spec)`` for each spec (its keyword arguments), in order; ``on_trace(j, df)``
    is called as soon as run j's trace is complete (a caller caches it there: an interrupted batch keeps
    what it finished).

    ``workers`` > 1: every snapshot of every run is one task for a pool of that many spawned processes
    at one torch thread each (a snapshot's row depends only on the run's snapshots, so the rows are
    independent); the costly tasks start first (rows with a tangent, the larger models first), so the
    workers finish together. The snapshots travel to the workers as numpy arrays (pickled by value;
    torch tensors would hold one shared-memory file open per tensor in every process). The numbers
    equal a serial trace's at one thread; only ``seconds`` differs."""
    import pandas as pd
    out: list = [None] * len(specs)

    def done(j, df):
        out[j] = df
        if on_trace is not None:
            on_trace(j, df)
    if workers <= 1:
        for j, spec in enumerate(specs):
            done(j, continuation_trace(**spec))
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    ctxs = [_TraceContext.of(s) for s in specs]  # here only to order the tasks
    for j, c in enumerate(ctxs):
        if c is None:
            done(j, pd.DataFrame())
    tasks = [(j, i) for j, c in enumerate(ctxs) if c is not None for i in range(len(c.snaps))]
    tasks.sort(key=lambda t: (not ctxs[t[0]].has_tangent(t[1]), -ctxs[t[0]].thetas[0].numel()))
    if not tasks:
        return out
    left = {j: len(c.snaps) for j, c in enumerate(ctxs) if c is not None}
    rows: dict = {}
    portable = [{**s, "snapshots": [(st, {k: v.detach().cpu().numpy() for k, v in sd.items()})
                                    for st, sd in s["snapshots"]]} for s in specs]
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=mp.get_context("spawn"),
                             initializer=_trace_worker_init, initargs=(portable,)) as ex:
        futures = {ex.submit(_trace_worker_row, t): t for t in tasks}
        for f in as_completed(futures):
            j, i = futures[f]
            rows[j, i] = f.result()  # a task's exception reaches the caller
            left[j] -= 1
            if not left[j]:
                done(j, pd.DataFrame([rows.pop((j, k)) for k in range(len(ctxs[j].snaps))]))
    return out


class _TraceContext:
    """What every row of a continuation trace reads (the model, batch, masks, flattened snapshots and the
    path's gates); ``row(i)`` measures snapshot i."""

    @classmethod
    def of(cls, spec: dict) -> "_TraceContext | None":
        """The context of ``continuation_trace(**spec)`` (None: no snapshots)."""
        import inspect
        bound = inspect.signature(continuation_trace).bind(**spec)  # a misspelt key raises, as in a serial trace
        bound.apply_defaults()
        kw = dict(bound.arguments)
        snaps = sorted(((int(s), sd) for s, sd in kw.pop("snapshots")), key=lambda x: x[0])
        if not snaps:
            return None
        return cls(snaps, kw["cfg"], kw["circuit"], kw["batch"], kw["n_examples"], kw["damping"], kw["max_iter"],
                   kw["method"], kw["n_control"], kw["step_offset"], kw["task"], kw["tol"], kw["curvature"],
                   kw["rel_damping"])

    def __init__(self, snaps, cfg, circuit, batch, n_examples, damping, max_iter, method, n_control, step_offset,
                 task, tol=TOL, curvature="ggn", rel_damping=REL_DAMPING):
        from ...tasks.generators import make_task
        from ..mechanism import _strip_state
        if curvature not in CURVATURES:  # raised here, before any snapshot is measured
            raise ValueError(f"unknown curvature {curvature!r}; allowed: {', '.join(CURVATURES)}")
        self.cfg = cfg
        self.kw = dict(damping=damping, max_iter=max_iter, method=method, tol=tol, curvature=curvature,
                       rel_damping=rel_damping)
        self.n_control, self.step_offset = n_control, step_offset
        self.task = task if task is not None else make_task(cfg.task)
        self.batch = batch if batch is not None else cfg.validation_batch(self.task, n=n_examples)
        with torch.random.fork_rng(devices=[]):
            model = SoftPriorTransformer(cfg.model)
        model.eval()
        self.model = model
        layout = ParamLayout.from_model(model)
        self.snaps = [(s, _strip_state(sd)) for s, sd in snaps]
        self.mask = circuit_mask(layout, cfg.model, circuit)
        self.eligible = zero_gate_mask(layout, cfg.model)
        self.heads = _as_heads(circuit)
        others = [(l, h) for l in range(cfg.model.n_layers) for h in range(cfg.model.n_heads)
                  if self.heads is not None and (l, h) not in self.heads]
        self.other_masks = [circuit_mask(layout, cfg.model, [x]) for x in others]
        self.thetas = [layout.flatten(sd) for _, sd in self.snaps]
        self.gates = [path_gates(cfg.path, s, cfg.total_steps, sd) for s, sd in self.snaps]
        self.learned = (cfg.path.pos.mode == "learned", cfg.path.content.mode == "learned")

    def _gate_change(self, i):
        g = self.gates
        return (g[i + 1][0] - g[i][0], g[i + 1][1] - g[i][1]) if i + 1 < len(g) else None

    def has_tangent(self, i) -> bool:
        w = self._gate_change(i)
        return w is not None and any(math.isfinite(x) and x != 0.0 for x in w)

    def row(self, i: int) -> dict:
        import time
        t0 = time.perf_counter()
        step, sd = self.snaps[i]
        model, task, batch, gates, thetas = self.model, self.task, self.batch, self.gates, self.thetas
        model.load_state_dict(sd)
        rs = recovery_signal_fn(*model_loss(model, task, batch, gate=(0.0, 0.0))[:2], self.mask, self.eligible,
                                self.n_control)
        row = {"step": step + self.step_offset, "g_pos": gates[i][0], "g_content": gates[i][1], "signal": rs.signal,
               "grad_norm": rs.grad_norm, "share": rs.share, "control_share": rs.control_share,
               "expected_share": rs.expected_share,
               "other_heads_share": _other_heads_share(rs, self.other_masks, self.heads),
               "solution_cos": solution_cosine(rs.grad, thetas[i], thetas[-1]),
               "dg_pos": float("nan"), "dg_content": float("nan"), "tracking_cos": float("nan"),
               "norm_ratio": float("nan"), "residual": float("nan"), "rel_residual": float("nan"),
               "cg_iters": 0, "negative_curvature": False, "damping": float("nan"),
               "curvature_scale": float("nan"), "converged": True, "damping_cos": float("nan")}
        w = self._gate_change(i)
        if w is not None:
            row["dg_pos"], row["dg_content"] = w
            if self.has_tangent(i):
                w = tuple(x if math.isfinite(x) else 0.0 for x in w)
                at = tuple(None if lrn else g for lrn, g in zip(self.learned, gates[i]))  # learned: the model's own
                tg = optimum_tangent(model, task, batch, gate=at, direction=w, **self.kw)
                delta = thetas[i + 1] - thetas[i]
                row.update(tracking_cos=_cos(tg.tangent, delta),
                           norm_ratio=float(torch.linalg.vector_norm(tg.tangent) / torch.linalg.vector_norm(delta))
                           if float(torch.linalg.vector_norm(delta)) > 0 else float("nan"),
                           residual=tg.residual, rel_residual=tg.rel_residual, cg_iters=tg.iterations,
                           negative_curvature=tg.negative_curvature, damping=tg.damping,
                           curvature_scale=tg.curvature_scale, converged=tg.converged, damping_cos=tg.damping_cos)
        row["seconds"] = time.perf_counter() - t0
        return row


_WORKER: dict = {}  # a trace worker's specs, and the contexts built from them as its tasks need them


def _trace_worker_init(specs):
    torch.set_num_threads(1)
    _WORKER.clear()
    _WORKER["specs"] = [{**s, "snapshots": [(st, {k: torch.from_numpy(v) for k, v in sd.items()})
                                            for st, sd in s["snapshots"]]} for s in specs]


def _trace_worker_row(task: tuple[int, int]) -> dict:
    j, i = task
    if j not in _WORKER:
        _WORKER[j] = _TraceContext.of(_WORKER["specs"][j])
    return _WORKER[j].row(i)
