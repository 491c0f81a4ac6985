"""Train K independent runs at once in one process (for sweeps).

The parameters of K models built by ``train.build_model`` (each from its own seed) are stacked on a
leading run dimension (``torch.func.stack_module_state``). The soft-prior model without a static
positional scheme (every path, and the NoPE/soft_* baselines) then runs through
``fastpath.fast_forward``, which is written for a run dimension (batched matmuls over the K runs,
LayerNorm folded into the weights, queries only at the loss positions); a test holds it equal to the
readable model in logits and gradients. The static schemes apply the readable model itself with
``torch.func.vmap(functional_call(...))``. Either way every op runs once per step for all K runs, so
the per-op overhead that dominates a tiny model is paid once, not K times. On a GPU the same code
path trains a whole sweep in a few kernels per op.

What stays per run, exactly as in ``train.train`` (the per-step rules are train.py's own functions:
``step_gates``, ``prior_dropped``, ``with_dual_loss``, ``metrics_row``, ``check_finite``):
- data: each run draws its batch from its own seeded generator;
- gate trajectories: each run's gate values come from its own path (learned gates use the run's own
  logit; prior dropout uses the run's own generator; the dual loss is a per-run flag);
- gradient clipping: the global norm is computed per run over that run's slice of every parameter;
- AdamW is elementwise, so one optimiser over the stacked tensors equals K separate optimisers
  (a forced gate's logit gets a zero gradient here instead of none; with zero weight decay on gate
  logits both leave it unchanged).

Runs in a group must share everything that fixes tensor shapes and the optimiser: task, model,
batch size, step budget, learning rate, weight decay, eval interval and validation set
(``group_key``). A group checkpoints and resumes as a single run does (``train.checkpoint``: the
stacked weights, the optimiser state, every run's generators), bit-identically; the checkpoint names
its runs, and resuming it into another group is refused.
"""

from __future__ import annotations

import math
import os
import time

import torch
from torch.func import functional_call, stack_module_state, vmap

from . import fastpath
from .config import RunConfig
from .optim import AdamW
from .runtime import training_settings
from .train import (CheckpointClock, RunResult, build_model, check_finite, checkpoint, metrics_row, param_groups,
                    prior_dropped, restore_checkpoint, run_summary, seeded_generator, step_gates, with_dual_loss)
from .tasks import make_task

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
    import json
    return json.dumps(d, sort_keys=True)


def train_group(cfgs: list[RunConfig], init_states: list[dict] | None = None, progress: bool = False,
                device: str | torch.device | None = None, *, resume: dict | None = None,
                on_checkpoint=None, checkpoint_seconds: float | None = None) -> list[RunResult]:
    """Train ``cfgs`` together. ``device``: where the stacked parameters and batches live (default
    ``$SOFTPRIOR_DEVICE`` or ``cpu``; e.g. ``cuda``). Data is drawn on the CPU from each run's own
    generator and copied over, so a run's numbers depend only on its config, not on the device's RNG.
    Results (weights, metrics) come back on the CPU. Runs inside ``runtime.training_settings()``
    (flush-to-zero on while training, restored afterwards).

    resume / on_checkpoint / checkpoint_seconds: as in ``train.train``, for the whole group (the
    first config's ``checkpoint_every``); the checkpoint's ``meta["run_ids"]`` names the runs, in order."""
    if not cfgs:
        return []
    keys = {group_key(c) for c in cfgs}
    if len(keys) != 1:
        raise ValueError("train_group needs configs that differ only in path, seed, grad_clip and initialisation")
    with training_settings():
        return _train_group(cfgs, init_states, progress, device, resume, on_checkpoint, checkpoint_seconds)


def _train_group(cfgs, init_states, progress, device, resume, on_checkpoint, checkpoint_seconds) -> list[RunResult]:
    t0 = time.perf_counter()
    dev = torch.device(device or os.environ.get("SOFTPRIOR_DEVICE") or "cpu")
    K, c0 = len(cfgs), cfgs[0]
    task = make_task(c0.task)
    T, steps, L, H = c0.model.n_ctx, c0.total_steps, c0.model.n_layers, c0.model.n_heads
    models = [build_model(c) for c in cfgs]
    if init_states is not None:
        for m, s in zip(models, init_states):
            if s is not None:
                m.load_state_dict(s)
    base = models[0].to(dev)
    params, _ = stack_module_state(models)
    params = {k: v.detach().to(dev).requires_grad_(True) for k, v in params.items()}
    names = list(params)
    opt = AdamW(param_groups(params.items(), c0.weight_decay), lr=c0.lr)
    clip = torch.tensor([c.grad_clip if c.grad_clip is not None else math.inf for c in cfgs], device=dev)
    data_gens = [seeded_generator(c.seed, 0) for c in cfgs]
    drop_gens = [seeded_generator(c.seed, 1) for c in cfgs]
    val = c0.validation_batch(task)
    val_inputs, val_targets = val.inputs.to(dev), val.targets.to(dev)
    loss_pos = task.loss_positions(T)
    dual = torch.tensor([float(c.path.dual_loss) for c in cfgs], device=dev)

    if fastpath.supports(c0.model):  # hand-fused and run-stacked already (fastpath.py)
        def batched(p, inputs, gp, gc):
            return fastpath.fast_forward(p, c0.model, inputs, gp, gc, loss_pos)
        batched_val = batched
    else:  # static positional schemes: the readable model, vmapped over the runs
        def fwd(p, inputs, gp, gc):
            return functional_call(base, p, (inputs, gp, gc), {"positions": loss_pos})

        batched = vmap(fwd, in_dims=(0, 0, 0, 0))
        batched_val = vmap(fwd, in_dims=(0, None, 0, 0))

    def per_run_loss(out, targets):  # out [K, B, P, ...], targets [K, B, ...] -> [K]
        return vmap(task.loss)(out, targets)

    def per_run_score(out, targets):
        return vmap(task.score, in_dims=(0, None))(out, targets)

    def per_run_val_loss(out, targets):
        return vmap(task.loss, in_dims=(0, None))(out, targets)

    def model_gates():  # as SoftPriorTransformer.gates: a model without a prior has gates 0
        if not c0.model.prior:
            return zeros, zeros
        g = torch.sigmoid(params["gate_logits"])  # [K, 2, a, b]
        return g[:, 0].expand(K, L, H), g[:, 1].expand(K, L, H)

    def gate_tensor(applied, i, own):  # [K, L, H]: run k's own gate where kind i is learned this step, else forced
        learned = torch.tensor([a[i] is None for a in applied], device=dev)
        forced = torch.tensor([0.0 if a[i] is None else a[i] for a in applied]).to(dev)
        return torch.where(learned[:, None, None], own, forced[:, None, None].expand(K, L, H))

    metrics: list[list[dict]] = [[] for _ in cfgs]
    loss_sum = torch.zeros(K, device=dev)
    n_in_window = 0
    start = 0
    run_ids = [c.run_id for c in cfgs]
    gens = {**{f"data.{k}": g for k, g in enumerate(data_gens)}, **{f"drop.{k}": g for k, g in enumerate(drop_gens)}}
    if resume is not None:
        if resume["meta"].get("run_ids") != run_ids:
            raise ValueError("this checkpoint belongs to another group of runs: "
                             f"{resume['meta'].get('run_ids')} != {run_ids}")
        with torch.no_grad():
            start, metrics, loss_sum, n_in_window = restore_checkpoint(
                resume, lambda w: [params[n].copy_(w[n]) for n in names], opt, gens)
        loss_sum = loss_sum.to(dev)
    clock = CheckpointClock(c0.checkpoint_every, checkpoint_seconds) if on_checkpoint is not None else None
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start, desc=f"group of {K}", unit="step", leave=False)
    zeros = torch.zeros(K, L, H, device=dev)
    for step in range(start, steps):
        # each run's gates for this step, by the single-run rules (train.step_gates, train.prior_dropped)
        applied = [step_gates(c.path, step, steps, prior_dropped(c.path, g)) for c, g in zip(cfgs, drop_gens)]
        mp, mc = model_gates()
        gp, gc = gate_tensor(applied, 0, mp), gate_tensor(applied, 1, mc)
        batches = [task.sample(c0.batch_size, T, g) for g in data_gens]
        inputs = torch.stack([b.inputs for b in batches]).to(dev)
        targets = torch.stack([b.targets for b in batches]).to(dev)
        loss_k = per_run_loss(batched(params, inputs, gp, gc), targets)
        if bool(dual.any()):
            loss_k = with_dual_loss(loss_k, lambda: per_run_loss(batched(params, inputs, zeros, zeros), targets), dual)
        opt.zero_grad(set_to_none=False)
        loss_k.sum().backward()
        grads = [params[n].grad for n in names if params[n].grad is not None]
        norms = torch.stack([g.reshape(K, -1).pow(2).sum(1) for g in grads]).sum(0).sqrt()  # [K]
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, [scale.view(K, *([1] * (g.dim() - 1))) for g in grads])
        opt.step()
        loss_sum += loss_k.detach()
        n_in_window += 1
        done = step + 1
        if done % c0.eval_every == 0 or done == steps:
            train_loss = (loss_sum / n_in_window).tolist()
            with torch.no_grad():
                mp, mc = model_gates()
                out_n = batched_val(params, val_inputs, mp, mc)
                out_z = batched_val(params, val_inputs, zeros, zeros)
                score_n, score_z = per_run_score(out_n, val_targets).tolist(), per_run_score(out_z, val_targets).tolist()
                loss_n, loss_z = per_run_val_loss(out_n, val_targets).tolist(), per_run_val_loss(out_z, val_targets).tolist()
                g_all = torch.sigmoid(params["gate_logits"]).reshape(K, 2, -1).mean(-1)
            for k, c in enumerate(cfgs):
                check_finite(train_loss[k], done, c.run_id)
                # forced gates are logged as applied (the float32 value the run trained with)
                logged = tuple(None if applied[k][i] is None else float(g[k].detach().mean())
                               for i, g in ((0, gp), (1, gc)))
                metrics[k].append(metrics_row(done, train_loss[k], logged, (float(g_all[k, 0]), float(g_all[k, 1])),
                                              {task.metric: score_n[k], "loss": loss_n[k]},
                                              {task.metric: score_z[k], "loss": loss_z[k]}))
            loss_sum = torch.zeros(K, device=dev)
            n_in_window = 0
        if clock is not None and clock.due(done, steps):
            ck = checkpoint(done, params, opt, gens, metrics, loss_sum, n_in_window)
            ck["meta"]["run_ids"] = run_ids
            on_checkpoint(ck)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    seconds = round(time.perf_counter() - t0, 3)
    results = []
    n_params = base.n_params()
    for k, c in enumerate(cfgs):
        summary = run_summary(c, task, metrics[k][-1], steps, seconds, n_params, group_size=K,
                              **({"resumed_at": start} if start else {}))
        state = {n: params[n][k].detach().to("cpu", copy=True) for n in names}
        results.append(RunResult(c, summary, metrics[k], state))
    return results
