"""The training loop: run configs in, results out (pure; the run store does the I/O).

One loop and one step for a single run and for a group (``train_runs``, ``Runs``): ``train`` is
the loop with K = 1, ``engine.train_group`` the same loop for K runs that may share a group.

Evaluation semantics (docs/DESIGN.md, '"normal" and "zero" evaluation'):
- "normal": the model's own gates, sigmoid(gate logit). For learned gates that is the trained
  value. In fixed and scheduled modes the logit is masked (no gradient), so it stays at its
  initial value (0 -> g = 0.5): a faded model evaluated "normally" has its prior switched back on.
  This is the reading under which the paper's Table 1 has different normal and zero numbers for
  fade600->0 and linear0.5->0 even though their gates end at 0.
- "zero": both gates forced to 0: the plain NoPE model.
The path's gate values at the evaluation step are logged beside them (``g_pos``, ``g_content``).

Weight decay applies to the projection and embedding matrices only (``is_decayed``: not to
LayerNorm, the prior tables, the gate logits or positional-scheme parameters), nanoGPT-style; the
prior tables would otherwise be pulled to zero.

Determinism: initialisation uses a forked global RNG seeded with the run seed; data, prior-dropout
and validation use their own ``torch.Generator`` objects. Same config + seed + machine + thread count
-> same bits, trained alone or in a group of any size: every operation whose rounding would depend on
the group's shape runs on each run's own slice (docs/DESIGN.md, "Bit-identity").
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.func import functional_call, stack_module_state, vmap

from ..model import fastpath
from ..config import RunConfig
from ..model.fastpath import model_forward
from ..model.transformer import SoftPriorTransformer, build_model
from ..paths import PathConfig
from ..provenance import provenance
from .runtime import one_thread, prepare_training
from ..tasks.generators import Task, make_task

__all__ = ["train", "train_runs", "Runs", "clip_per_run_", "RunResult", "evaluate", "TrainingDiverged", "seeded_generator", "prior_dropped",
           "step_gates", "with_dual_loss", "metrics_row", "check_finite"]


class TrainingDiverged(RuntimeError):
    pass


@dataclass
class RunResult:
    config: RunConfig
    summary: dict
    metrics: list[dict] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    snapshots: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)  # (step, weights)


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """An independent generator per (seed, stream): 0 = data, 1 = prior dropout."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream * 7919 + 17)


_DECAYED = ("embed.weight", "in_proj.weight", "out_proj.weight", "read_in.weight", "read_out.weight")


def is_decayed(name: str) -> bool:
    """Weight decay on the embedding and projection matrices only: not on LayerNorm, biases, the
    prior tables, the gate logits or the positional schemes' parameters."""
    return name.endswith(_DECAYED)


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """AdamW groups from (name, parameter) pairs: decayed (``is_decayed``) and not, in the given order."""
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if is_decayed(name) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def _step_per_run(opt: torch.optim.AdamW, K: int, closure=None):
    """``opt.step()`` for run-stacked parameters [K, ...] (``make_optimizer(runs=K)``), each run's slice
    updated as a tensor of its own. The update is elementwise, but its kernels (fused or not) treat a
    tensor's last, partial vector of elements with scalar code that rounds differently from their
    vector code, so a run's small tensors (the gate logits) inside a stacked tensor rounded differently
    from the same run alone (measured: exp_avg_sq differed after 8 steps in a group of 2). Each run
    now sees the kernel calls it sees alone; the state (and the checkpoint format) is the stacked
    tensors', as before. The update itself is ``torch.optim.adamw.adamw``, AdamW's own."""
    from torch.optim.adamw import adamw
    cache = opt.__dict__.setdefault("_per_run_views", {})
    for gi, group in enumerate(opt.param_groups):
        ps, gs, ms, vs, mx, steps = [], [], [], [], [], []
        opt._init_group(group, ps, gs, ms, vs, mx, steps)
        # the per-run views (and step counters, which adamw counts once per run) are made once per set of
        # tensors: a resumed state's new tensors make new ones (the views keep their bases, so ids stay unique)
        key = tuple(id(t) for ts in (ps, gs, ms, vs, mx, steps) for t in ts)
        if cache.get(gi, (None,))[0] != key:
            cache[gi] = (key, [[t[k] for t in ts for k in range(K)] for ts in (ps, gs, ms, vs, mx)],
                         [s.clone() for s in steps for _ in range(K)])
        _, views, per_run = cache[gi]
        beta1, beta2 = group["betas"]
        adamw(*views, per_run,
              foreach=False, fused=group["fused"], amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        for s in steps:
            s += 1
    return None


def make_optimizer(named_params, cfg: RunConfig, runs: int = 1) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter, ICLR 2019, Algorithm 2) over (name, parameter) pairs
    (``param_groups``), at the config's learning rate: ``torch.optim.AdamW(fused=True)``, or its
    non-fused implementation where the fused kernel has no implementation for the parameters' device
    (torch < 2.4 on the CPU, inside the declared ``torch>=2.2``: its constructor raises). The two may
    round differently in the last bits; runs are bit-identical between machines on the same branch.
    ``runs``: K for run-stacked parameters (``_step_per_run``: each run's slice updated as it is alone)."""
    named = list(named_params)
    try:
        opt = torch.optim.AdamW(param_groups(named, cfg.weight_decay), lr=cfg.lr, fused=True)
    except RuntimeError:  # fresh groups: the failed constructor has written its defaults into the first
        opt = torch.optim.AdamW(param_groups(named, cfg.weight_decay), lr=cfg.lr, fused=False)
    if runs > 1:
        opt.step = functools.partial(_step_per_run, opt, runs)
    return opt


@torch.no_grad()
def evaluate(model: SoftPriorTransformer, task: Task, inputs, targets, gate_pos=None, gate_content=None,
             length: int | None = None) -> dict:
    """Metric and loss of ``model`` on a batch under a gate override (None = the model's gates)."""
    T = inputs.shape[1] if length is None else length
    pos = task.loss_positions(T)
    out = model_forward(model, inputs, gate_pos, gate_content, positions=pos)
    return {task.metric: float(task.score(out, targets)), "loss": float(task.loss(out, targets))}


# ------------------------------------------------------------------- the per-step rules
# One definition each, used by the training loop below (``Runs``; one run or a group).
def prior_dropped(path: PathConfig, drop_gen: torch.Generator) -> bool:
    """Prior dropout (a training path's option, ``paths.PathConfig``): whether this step trains with both
    gates at 0. One draw from the run's own dropout generator per step on paths with dropout, none on
    the others."""
    return path.prior_dropout > 0 and float(torch.rand((), generator=drop_gen)) < path.prior_dropout


def step_gates(path: PathConfig, step: int, total_steps: int, dropped: bool) -> tuple[float | None, float | None]:
    """The (position, content) gates a training step applies (the model's gate modes and the path): the path's forced
    value of each kind at ``step`` (fixed or scheduled), None where the gate is learned (the model's
    own sigmoid(logit)), and 0 for both on a step whose prior is dropped."""
    if dropped:
        return 0.0, 0.0
    return path.pos.value_at(step, total_steps), path.content.value_at(step, total_steps)


def with_dual_loss(loss: torch.Tensor, zero_gate_loss: Callable[[], torch.Tensor], weight=1.0) -> torch.Tensor:
    """The dual condition loss (a training path's option): loss(normal gates) + loss(zero gates).
    ``weight``: 1 for a run with the dual loss; in ``Runs.step`` a per-run 0/1 vector [K]."""
    return loss + weight * zero_gate_loss()


def check_finite(train_loss: float, step: int, run_id: str) -> None:
    if not math.isfinite(train_loss):
        raise TrainingDiverged(f"run {run_id}: non-finite training loss at step {step} ({train_loss})")


def metrics_row(step: int, train_loss: float, applied: tuple, model_gates: tuple[float, float],
                normal: dict, zero: dict) -> dict:
    """One logged evaluation row, as ``train`` and ``train_group`` both log it.

    applied: the (position, content) gates the last step applied; None for a learned gate that was
        applied, logged as the model's own gate as updated by that step.
    model_gates: the model's own gates after the step, averaged over layers and heads.
    normal, zero: {metric: value, "loss": value} on the validation set with the model's gates / with
        both gates 0 (``evaluate``)."""
    return {"step": step, "train_loss": train_loss,
            "g_pos": model_gates[0] if applied[0] is None else applied[0],
            "g_content": model_gates[1] if applied[1] is None else applied[1],
            **{f"normal_{k}": v for k, v in normal.items()}, **{f"zero_{k}": v for k, v in zero.items()},
            "model_g_pos": model_gates[0], "model_g_content": model_gates[1]}


class Runs:
    """K runs in lockstep (K = 1: one run): their weights stacked on a leading run dimension
    (``torch.func.stack_module_state``), one AdamW over the stacked tensors, each run's own
    generators, and the one training step (``step``) and evaluation (``evaluate``) that ``train``
    and ``engine.train_group`` both use.

    Forward: ``fastpath.fast_forward``, written for the run dimension (a test holds it to the readable
    ``model/transformer.py``), for every model it supports (no positional scheme, or nope, alibi, t5, kerple,
    kerple_power, fire, vanilla, rope, cope, dape, gpsa); a model it does not support (a scheme it does
    not know) applies the readable model with ``vmap(functional_call(...))``.
    What stays per run (the per-step rules above): the data (each run's own generator), the gates
    (``step_gates``, ``prior_dropped``; a learned gate is the run's own sigmoid(logit)), the dual
    loss (a per-run 0/1 weight) and gradient clipping (the global norm of the run's own slice of
    every gradient). AdamW is elementwise, so one optimiser over stacked tensors is K optimisers.

    device: where the stacked weights and batches live (default ``$SOFTPRIOR_DEVICE`` or cpu);
    data is drawn on the CPU from each run's generator, so a run's numbers do not depend on it."""

    def __init__(self, cfgs: list[RunConfig], init_states: list | None = None, device=None):
        self.dev = dev = torch.device(device or os.environ.get("SOFTPRIOR_DEVICE") or "cpu")
        self.cfgs, self.K, c0 = cfgs, len(cfgs), cfgs[0]
        self.task = task = make_task(c0.task)
        self.T, self.steps = c0.model.n_ctx, c0.total_steps
        L, H = c0.model.n_layers, c0.model.n_heads
        models = [build_model(c) for c in cfgs]
        for m, s in zip(models, init_states or []):
            if s is not None:
                m.load_state_dict(s)
        stacked, _ = stack_module_state(models)  # on the CPU, where the models were built
        self.base = models[0].to(dev)
        self.params = {k: v.detach().to(dev).requires_grad_(True) for k, v in stacked.items()}
        for p in self.params.values():  # a zero gradient (not None) for a parameter a step leaves out (a
            p.grad = torch.zeros_like(p)  # forced or dropped gate's logit): AdamW counts every step for every tensor
        self.opt = make_optimizer(self.params.items(), c0, self.K)
        # each run's slice of each gradient as [1, n] (the gradients are zeroed in place, never replaced)
        self._grad_rows = [[p.grad[k].reshape(1, -1) for p in self.params.values()] for k in range(self.K)]
        self.clip = torch.tensor([c.grad_clip if c.grad_clip is not None else math.inf for c in cfgs], device=dev)
        self.data_gens = [seeded_generator(c.seed, 0) for c in cfgs]
        self.drop_gens = [seeded_generator(c.seed, 1) for c in cfgs]
        self.gens = {**{f"data.{k}": g for k, g in enumerate(self.data_gens)},
                     **{f"drop.{k}": g for k, g in enumerate(self.drop_gens)}}
        val = c0.validation_batch(task)
        self.val_inputs, self.val_targets = val.inputs.to(dev), val.targets.to(dev)
        self.loss_pos = loss_pos = task.loss_positions(self.T)
        self.dual = torch.tensor([float(c.path.dual_loss) for c in cfgs], device=dev)
        self.zeros = torch.zeros(self.K, L, H, device=dev)
        self._LH = (L, H)
        self.engine, self.engine_why = fastpath.engine(c0.model, c0.model.d_in is None, self.T, len(loss_pos),
                                                       torch.device(dev).type)
        if fastpath.supports(c0.model):  # hand-fused and run-stacked already (model/fastpath.py)
            def batched(p, inputs, gp, gc):
                return fastpath.fast_forward(p, c0.model, inputs, gp, gc, loss_pos)
            self.forward = self.forward_val = batched
            self.shared_inputs = self.K == 1
        else:  # a scheme the fast path does not know: the readable model, vmapped, one run at a time
            def fwd(p, inputs, gp, gc):
                return functional_call(self.base, p, (inputs, gp, gc), {"positions": loss_pos})
            self.forward = _one_run_at_a_time(vmap(fwd, in_dims=(0, 0, 0, 0)), shared=False)
            self.forward_val = _one_run_at_a_time(vmap(fwd, in_dims=(0, None, 0, 0)), shared=True)
            self.shared_inputs = False
        # the per-run loss [K]: each run's own scalar loss, as it is alone (a vmapped loss reduces [K, B]
        # row-wise, which rounds differently from one run's [B]: docs/DESIGN.md, "Bit-identity")
        self.loss = lambda out, t: torch.stack([task.loss(o, y) for o, y in zip(out, t)])
        self.applied: list[tuple] = []
        self.gates_applied = (self.zeros, self.zeros)

    def model_gates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each run's own (position, content) gates [K, L, H], as ``SoftPriorTransformer.gates``
        (a model without a prior has gates 0)."""
        if not self.cfgs[0].model.prior:
            return self.zeros, self.zeros
        L, H = self._LH
        g = _sigmoid_per_run(self.params["gate_logits"])  # [K, 2, a, b]
        return g[:, 0].expand(self.K, L, H), g[:, 1].expand(self.K, L, H)

    def _gate_tensor(self, applied, i, own):
        """[K, L, H]: run k's own gate where kind i is learned this step, else its forced value."""
        L, H = self._LH
        if self.K == 1:  # one run: its own gate (a view) or the forced value, without a select (fewer ops)
            v = applied[0][i]
            return own if v is None else torch.tensor(v, dtype=own.dtype, device=self.dev).reshape(1, 1, 1).expand(1, L, H)
        learned = torch.tensor([a[i] is None for a in applied], device=self.dev)
        forced = torch.tensor([0.0 if a[i] is None else a[i] for a in applied], dtype=own.dtype, device=self.dev)
        return torch.where(learned[:, None, None], own, forced[:, None, None].expand(self.K, L, H))

    def step(self, step: int) -> torch.Tensor:
        """One training step of every run (0-based ``step``); returns the per-run loss [K], detached."""
        task = self.task
        self.applied = [step_gates(c.path, step, self.steps, prior_dropped(c.path, g))
                        for c, g in zip(self.cfgs, self.drop_gens)]
        mp, mc = self.model_gates()
        gp, gc = self._gate_tensor(self.applied, 0, mp), self._gate_tensor(self.applied, 1, mc)
        self.gates_applied = (gp, gc)
        batches = [task.sample(self.cfgs[0].batch_size, self.T, g) for g in self.data_gens]
        targets = torch.stack([b.targets for b in batches]).to(self.dev)
        if self.shared_inputs:  # K = 1 on the fast path: the unstacked batch (same bits, fewer copies)
            inputs = batches[0].inputs.to(self.dev)
        else:
            inputs = torch.stack([b.inputs for b in batches]).to(self.dev)
        loss_k = self.loss(self.forward(self.params, inputs, gp, gc), targets)
        if bool(self.dual.any()):
            loss_k = with_dual_loss(
                loss_k, lambda: self.loss(self.forward(self.params, inputs, self.zeros, self.zeros), targets),
                self.dual)
        self.opt.zero_grad(set_to_none=False)
        (loss_k.sum() if loss_k.dim() else loss_k).backward()
        with one_thread():  # fixed reduction order and vector split, whatever the thread count (one_thread)
            clip_per_run_([p.grad for p in self.params.values()], self.clip, self._grad_rows)
            self.opt.step()
        return loss_k.detach().reshape(self.K)

    @torch.no_grad()
    def evaluate(self) -> list[tuple[dict, dict]]:
        """Per run, ({metric, loss} with the run's own gates, the same with both gates 0) on the
        validation set (``evaluate``'s semantics)."""
        task, vt = self.task, self.val_targets
        mp, mc = self.model_gates()
        out = {}
        for name, (gp, gc) in (("normal", (mp, mc)), ("zero", (self.zeros, self.zeros))):
            o = self.forward_val(self.params, self.val_inputs, gp, gc)
            # each run's own [1, ...] slice, as it is evaluated alone (a reduction over [K, ...] rounds otherwise)
            out[name] = ([float(vmap(task.score, in_dims=(0, None))(ok, vt)) for ok in o.split(1)],
                         [float(vmap(task.loss, in_dims=(0, None))(ok, vt)) for ok in o.split(1)])
        return [tuple({task.metric: out[n][0][k], "loss": out[n][1][k]} for n in ("normal", "zero"))
                for k in range(self.K)]

    def logged_gates(self, k: int) -> tuple:
        """Run k's applied gates of the last step as logged: forced ones as the float32 value the run
        trained with, None for a learned one (``metrics_row``). A forced gate is one value on every
        layer and head: its mean is taken as for the run alone, over that value broadcast to [L, H]
        (a mean of equal float32 values can round; a group's gate tensor holds them as separate values)."""
        L, H = self._LH
        return tuple(None if self.applied[k][i] is None else float(g[k, :1, :1].detach().expand(L, H).mean())
                     for i, g in enumerate(self.gates_applied))

    @torch.no_grad()
    def own_gate_means(self) -> list[tuple[float, float]]:
        """Each run's own (position, content) gates, averaged over layers and heads."""
        g = [x.reshape(2, -1).mean(-1).tolist() for x in _sigmoid_per_run(self.params["gate_logits"])]
        return [(a, b) for a, b in g]

    def weights(self, k: int) -> dict[str, torch.Tensor]:
        """Run k's weights, on the CPU (a copy)."""
        return {n: p[k].detach().to("cpu", copy=True) for n, p in self.params.items()}


def _sigmoid_per_run(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid of run-stacked gate logits [K, ...], each run's [1, ...] slice on its own: the kernel
    rounds a tensor's last partial vector (scalar code) differently from its vector code, and the few
    gate logits of a run fall in one or the other by their place in the stack (measured at K = 8)."""
    if logits.shape[0] == 1:
        return torch.sigmoid(logits)
    return torch.cat([torch.sigmoid(x) for x in logits.split(1)])


def _one_run_at_a_time(f: Callable, shared: bool) -> Callable:
    """``f(params, inputs, g_pos, g_content)`` (vmapped over the runs) called on each run's [1, ...]
    slice and concatenated, so each run computes what it computes alone (a vmapped model runs batched
    kernels whose rounding depends on K). ``shared``: the inputs are every run's (not run-stacked)."""
    def per_run(params, inputs, gp, gc):
        K = gp.shape[0]
        if K == 1:
            return f(params, inputs, gp, gc)
        return torch.cat([f({n: t[k:k + 1] for n, t in params.items()}, inputs if shared else inputs[k:k + 1],
                            gp[k:k + 1], gc[k:k + 1]) for k in range(K)])
    return per_run


def clip_per_run_(grads: list[torch.Tensor], max_norm: torch.Tensor, rows: list | None = None) -> None:
    """Gradient clipping per run (Pascanu et al. 2013, as ``torch.nn.utils.clip_grad_norm_``): each
    run's gradients, run-stacked [K, ...], are scaled by min(1, max_norm_k / (||g_k|| + 1e-6)), where
    ||g_k|| is the global 2-norm of run k's slice of every gradient; ``max_norm`` [K] (inf: no
    clipping). In place.

    Each run's norm is reduced from its own slices, as for the run alone: a row-wise reduction of the
    stacked [K, n] gradient is split across threads and vectorised differently from one run's full
    reduction of its n elements (docs/DESIGN.md, "Bit-identity"). ``rows``: per run, its [1, n] view of
    each gradient, if the caller keeps them (``Runs``)."""
    K = max_norm.shape[0]
    if rows is None:
        rows = [[g[k].reshape(1, -1) for g in grads] for k in range(K)]
    norms = torch.cat([torch.stack([x.sum(1) for x in torch._foreach_pow(r, 2)]).sum(0).sqrt() for r in rows])  # [K]
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    scale = torch.where(torch.isinf(max_norm), 1.0, scale)  # clipping off: no scale, even for an overflowing norm
    torch._foreach_mul_(grads, [scale.view(K, *([1] * (g.dim() - 1))) for g in grads])


def train(cfg: RunConfig, *, init_state: dict[str, torch.Tensor] | None = None,
          resume: dict | None = None, on_checkpoint: Callable[[dict], None] | None = None,
          progress: bool = False, checkpoint_seconds: float | None = None, device=None) -> RunResult:
    """Train one run: ``train_runs`` with K = 1 (the grouped engine's own loop and step).

    init_state: weights to start from (post hoc continuation from a parent's final checkpoint).
    resume: a checkpoint dict previously passed to ``on_checkpoint``; training continues from it
        bit-identically to an uninterrupted run.
    on_checkpoint: called every ``cfg.checkpoint_every`` steps, and at the first step after every
        ``checkpoint_seconds`` of training (sweeps: ``executors``), with a dict of tensors + metadata.

    Applies ``runtime.prepare_training()`` first (the allocator setting).
    """
    return train_runs([cfg], [init_state], progress=progress, device=device, resume=resume,
                      on_checkpoint=on_checkpoint, checkpoint_seconds=checkpoint_seconds)[0]


def train_runs(cfgs: list[RunConfig], init_states: list | None = None, *, progress: bool = False, device=None,
               resume: dict | None = None, on_checkpoint: Callable[[dict], None] | None = None,
               checkpoint_seconds: float | None = None) -> list[RunResult]:
    """The training loop, for one run or a group (``engine.train_group`` checks that the configs
    may share one): ``Runs.step`` every step, ``Runs.evaluate`` every ``eval_every`` steps and at
    the end, snapshots every ``snapshot_every`` steps, checkpoints as ``train`` describes (the
    checkpoint's ``meta["run_ids"]`` names the runs in order; resuming another group's is refused)."""
    prepare_training()
    return _train_runs(cfgs, init_states, progress, device, resume, on_checkpoint, checkpoint_seconds)


def _train_runs(cfgs, init_states, progress, device, resume, on_checkpoint, checkpoint_seconds) -> list[RunResult]:
    t0 = time.perf_counter()
    if len(cfgs) > 1 and cfgs[0].snapshot_every and on_checkpoint is not None:
        raise ValueError("a group's checkpoint does not keep snapshots: train runs with snapshot_every alone "
                         "(as sweeps do) or without checkpoints")
    runs = Runs(cfgs, init_states, device)
    _announce_engine(runs.engine, runs.engine_why)
    K, c0, task, steps = runs.K, cfgs[0], runs.task, runs.steps
    run_ids = [c.run_id for c in cfgs]
    metrics: list[list[dict]] = [[] for _ in cfgs]
    snapshots: list[list[tuple[int, dict]]] = [[] for _ in cfgs]
    loss_sum, n_in_window, start = torch.zeros(K, device=runs.dev), 0, 0
    if resume is not None:
        if resume["meta"].get("run_ids") != run_ids:
            raise ValueError("this checkpoint belongs to another group of runs (or is in an older format): "
                             f"{resume['meta'].get('run_ids')} != {run_ids}")
        with torch.no_grad():
            start, metrics, loss_sum, n_in_window = restore_checkpoint(
                resume, lambda w: [runs.params[n].copy_(w[n]) for n in runs.params], runs.opt, runs.gens)
        loss_sum = loss_sum.to(runs.dev)
        if K == 1:
            snapshots = [list(resume.get("snapshots", []))]
    clock = CheckpointClock(c0.checkpoint_every, checkpoint_seconds) if on_checkpoint is not None else None
    if c0.snapshot_every and start == 0:
        snapshots = [[(0, runs.weights(k))] for k in range(K)]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        desc = f"{c0.path.name} s{c0.seed}" if K == 1 else f"group of {K}"
        bar = tqdm(total=steps, initial=start, desc=desc, unit="step", leave=False)
    try:
        with DeferredInterrupt(enabled=on_checkpoint is not None) as interrupt:
            metrics, snapshots = _loop(runs, cfgs, start, metrics, snapshots, loss_sum, n_in_window, clock,
                                       on_checkpoint, bar, interrupt)
    finally:
        if bar is not None:
            bar.close()

    seconds = round(time.perf_counter() - t0, 3)
    n_params = runs.base.n_params()
    engine = {"engine": runs.engine, "step_operator": runs.engine == "whole-step"}  # per run, not per process
    return [RunResult(c, run_summary(c, task, metrics[k][-1], steps, seconds, n_params, group_size=K, **engine,
                                     **({"resumed_at": start} if start else {})),
                      metrics[k], runs.weights(k), snapshots[k]) for k, c in enumerate(cfgs)]


_announced: set = set()


def _announce_engine(engine: str, why: str | None) -> None:
    """One line on stderr, once per process and reason, when a configuration trains off the whole-step
    operator (``fastpath.engine``), naming why."""
    if why is not None and (engine, why) not in _announced:
        _announced.add((engine, why))
        where = "the readable model" if engine == "readable" else "the fast path without the whole-step operator"
        print(f"softprior: training on {where}: {why}", file=sys.stderr, flush=True)


def _loop(runs, cfgs, start, metrics, snapshots, loss_sum, n_in_window, clock, on_checkpoint, bar, interrupt):
    """``_train_runs``'s steps from ``start``: evaluations, snapshots, checkpoints; a Ctrl-C
    (``interrupt``) ends it after the step in progress with a checkpoint (``_stop``)."""
    K, c0, task, steps, run_ids = runs.K, cfgs[0], runs.task, runs.steps, [c.run_id for c in cfgs]
    for step in range(start, steps):
        loss_sum += runs.step(step)
        n_in_window += 1
        done = step + 1
        if done % c0.eval_every == 0 or done == steps:
            train_loss = (loss_sum / n_in_window).tolist()
            evals, own = runs.evaluate(), runs.own_gate_means()
            for k, c in enumerate(cfgs):
                check_finite(train_loss[k], done, c.run_id)
                metrics[k].append(metrics_row(done, train_loss[k], runs.logged_gates(k), own[k], *evals[k]))
            loss_sum, n_in_window = torch.zeros(K, device=runs.dev), 0
            if bar is not None and K == 1:
                row = metrics[0][-1]
                bar.set_postfix(normal=f"{row['normal_' + task.metric]:.3f}", zero=f"{row['zero_' + task.metric]:.3f}")
        if c0.snapshot_every and done % c0.snapshot_every == 0:
            for k in range(K):
                snapshots[k].append((done, runs.weights(k)))
        stop = interrupt.pending
        if stop or (clock is not None and clock.due(done, steps)):
            ck = checkpoint(done, runs.params, runs.opt, runs.gens, metrics, loss_sum, n_in_window)
            ck["meta"]["run_ids"] = run_ids
            if K == 1:
                ck["snapshots"] = list(snapshots[0])
            if stop:
                ck["meta"]["interrupted"] = True  # saved whatever the schedule (``executors.job._Reporter``)
            on_checkpoint(ck)
        if bar is not None:
            bar.update(1)
        if stop:
            _stop(run_ids, done, steps)
    return metrics, snapshots


class DeferredInterrupt:
    """Ctrl-C (SIGINT) while a run with checkpoints trains: the step in progress finishes (a half-applied
    optimiser step would not resume bit-identically), the loop writes a checkpoint and stops (``_stop``).
    A second Ctrl-C interrupts at once. Only in the main thread (where Python delivers signals), and
    only with ``enabled`` (a loop without ``on_checkpoint`` has nowhere to write)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.pending, self._prev = enabled, False, None

    def __enter__(self):
        import signal
        import threading
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt("interrupted again: stopped at once, without a checkpoint")
        self.pending = True

    def __exit__(self, *exc):
        import signal
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
        return False


def _stop(run_ids: list[str], done: int, steps: int):
    """After Ctrl-C: the checkpoint at ``done`` is written; raise KeyboardInterrupt saying where the
    runs resume (a pool's worker also prints it: its exception does not reach the terminal)."""
    import multiprocessing
    import sys
    what = f"run {run_ids[0]}" if len(run_ids) == 1 else f"the group of {len(run_ids)} runs ({', '.join(run_ids)})"
    msg = (f"{what} stopped after step {done} of {steps} and wrote a checkpoint there: the same command resumes it "
           f"from step {done}")
    if multiprocessing.parent_process() is not None:
        print(f"softprior: interrupted: {msg}", file=sys.stderr, flush=True)
    raise KeyboardInterrupt(msg)


def run_summary(cfg: RunConfig, task: Task, last: dict, steps: int, seconds: float, n_params: int,
                **extra) -> dict:
    """A finished run's summary, from its final evaluation row (one per run of ``train_runs``).
    ``extra``: e.g. ``group_size``, and ``resumed_at`` (the checkpoint's step) for a resumed run;
    ``seconds`` then counts only the time since the resume."""
    m = task.metric
    return {"run_id": cfg.run_id, "task": cfg.task.name, "path": cfg.path.name, "seed": cfg.seed, "metric": m,
            f"normal_{m}": last[f"normal_{m}"], f"zero_{m}": last[f"zero_{m}"],
            "normal_loss": last["normal_loss"], "zero_loss": last["zero_loss"], "chance": task.chance,
            "steps": steps, "seconds": seconds, "n_params": n_params,
            "model_g_pos": last["model_g_pos"], "model_g_content": last["model_g_content"], **provenance(), **extra}


# ------------------------------------------------------------------------------- checkpoints
# One format for single runs and groups (``train_runs``): weights, optimiser state, every generator's
# state, the running loss sum and the metrics so far; resuming from it is bit-identical.
class CheckpointClock:
    """When a checkpoint is due: every ``every_steps`` steps (0: not by steps) and at the first step
    after every ``every_seconds`` of wall time (None: not by time); never after the last step."""

    def __init__(self, every_steps: int = 0, every_seconds: float | None = None):
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.last = time.perf_counter()

    def due(self, done: int, steps: int) -> bool:
        if done >= steps:
            return False
        now = time.perf_counter()
        if (self.every_steps and done % self.every_steps == 0) or \
                (self.every_seconds is not None and now - self.last >= self.every_seconds):
            self.last = now
            return True
        return False


def checkpoint(step: int, weights: dict[str, torch.Tensor], opt, gens: dict[str, torch.Generator], metrics: list,
               loss_sum: torch.Tensor, n_in_window: int) -> dict:
    """A resumable checkpoint as flat tensors (safetensors-ready) plus JSON-able metadata."""
    tensors = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in weights.items()}
    sd = opt.state_dict()
    for pid, st in sd["state"].items():
        for k, v in st.items():
            v = torch.as_tensor(v).detach().to("cpu", copy=True)
            tensors[f"opt.{pid}.{k}"] = v.reshape(-1) if k == "step" else v
    tensors.update({f"rng.{name}": g.get_state() for name, g in gens.items()})
    tensors["loss_sum"] = loss_sum.detach().to("cpu", copy=True).reshape(-1)
    meta = {"step": step, "n_in_window": n_in_window, "metrics": json.loads(json.dumps(metrics))}
    return {"tensors": tensors, "meta": meta}


def restore_checkpoint(ckpt: dict, load_weights: Callable[[dict], None], opt, gens: dict[str, torch.Generator]):
    """Load ``checkpoint``'s state into the weights (``load_weights``), ``opt`` and ``gens``; return
    (step, metrics, loss_sum as saved (flat), n_in_window)."""
    t, meta = ckpt["tensors"], ckpt["meta"]
    load_weights({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    sd = opt.state_dict()
    state = {}
    for pid in range(sum(len(g["params"]) for g in sd["param_groups"])):
        keys = [k for k in t if k.startswith(f"opt.{pid}.")]
        if keys:
            state[pid] = {k.split(".", 2)[2]: (t[k].reshape(()) if k.endswith(".step") else t[k]) for k in keys}
    sd["state"] = state
    opt.load_state_dict(sd)
    for name, g in gens.items():
        g.set_state(t[f"rng.{name}"])
    return meta["step"], list(meta["metrics"]), t["loss_sum"].clone(), meta["n_in_window"]


def metrics_jsonl(metrics: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in metrics)
