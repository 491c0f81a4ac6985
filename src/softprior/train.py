"""The training loop: one run config in, one result out (pure; the run store does the I/O).

Evaluation semantics (SPEC section 1):
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
and validation use their own ``torch.Generator`` objects. Same config + seed + machine -> same bits.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .config import RunConfig
from .fastpath import model_forward
from .model import SoftPriorTransformer, build_model  # noqa: F401 - build_model: re-exported (train.build_model)
from .optim import AdamW
from .paths import PathConfig
from .provenance import provenance
from .runtime import training_settings
from .tasks import Task, make_task

__all__ = ["train", "RunResult", "build_model", "evaluate", "TrainingDiverged", "seeded_generator", "prior_dropped",
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


def make_optimizer(model, cfg: RunConfig) -> AdamW:
    return AdamW(param_groups(model.named_parameters(), cfg.weight_decay), lr=cfg.lr)


@torch.no_grad()
def evaluate(model: SoftPriorTransformer, task: Task, inputs, targets, gate_pos=None, gate_content=None,
             length: int | None = None) -> dict:
    """Metric and loss of ``model`` on a batch under a gate override (None = the model's gates)."""
    T = inputs.shape[1] if length is None else length
    pos = task.loss_positions(T)
    out = model_forward(model, inputs, gate_pos, gate_content, positions=pos)
    return {task.metric: float(task.score(out, targets)), "loss": float(task.loss(out, targets))}


def _gate_means(model) -> tuple[float, float]:
    """The model's own (position, content) gates, each averaged over layers and heads."""
    g = torch.sigmoid(model.gate_logits.detach())
    return float(g[0].mean()), float(g[1].mean())


# ------------------------------------------------------------------- the per-step rules
# One definition each, used by the single-run loop below and by the grouped engine (engine.py).
def prior_dropped(path: PathConfig, drop_gen: torch.Generator) -> bool:
    """Prior dropout (SPEC section 3): whether this step trains with both gates at 0. One draw from
    the run's own dropout generator per step on paths with dropout, none on the others."""
    return path.prior_dropout > 0 and float(torch.rand((), generator=drop_gen)) < path.prior_dropout


def step_gates(path: PathConfig, step: int, total_steps: int, dropped: bool) -> tuple[float | None, float | None]:
    """The (position, content) gates a training step applies (SPEC sections 2-3): the path's forced
    value of each kind at ``step`` (fixed or scheduled), None where the gate is learned (the model's
    own sigmoid(logit)), and 0 for both on a step whose prior is dropped."""
    if dropped:
        return 0.0, 0.0
    return path.pos.value_at(step, total_steps), path.content.value_at(step, total_steps)


def with_dual_loss(loss: torch.Tensor, zero_gate_loss: Callable[[], torch.Tensor], weight=1.0) -> torch.Tensor:
    """The dual condition loss (SPEC section 3): loss(normal gates) + loss(zero gates).
    ``weight``: 1 for a run with the dual loss; in the grouped engine a per-run 0/1 vector [K]."""
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


def train(cfg: RunConfig, *, init_state: dict[str, torch.Tensor] | None = None,
          resume: dict | None = None, on_checkpoint: Callable[[dict], None] | None = None,
          progress: bool = False, checkpoint_seconds: float | None = None) -> RunResult:
    """Train one run.

    init_state: weights to start from (post hoc continuation from a parent's final checkpoint).
    resume: a checkpoint dict previously passed to ``on_checkpoint``; training continues from it
        bit-identically to an uninterrupted run.
    on_checkpoint: called every ``cfg.checkpoint_every`` steps, and at the first step after every
        ``checkpoint_seconds`` of training (sweeps: ``executors``), with a dict of tensors + metadata.

    Runs inside ``runtime.training_settings()``: flush-to-zero is on while training and restored
    afterwards (the caller's float behaviour is unchanged by a run).
    """
    with training_settings():
        return _train(cfg, init_state=init_state, resume=resume, on_checkpoint=on_checkpoint, progress=progress,
                      checkpoint_seconds=checkpoint_seconds)


def _train(cfg: RunConfig, *, init_state, resume, on_checkpoint, progress, checkpoint_seconds) -> RunResult:
    t0 = time.perf_counter()
    task = make_task(cfg.task)
    T, steps = cfg.model.n_ctx, cfg.total_steps
    model = build_model(cfg)
    if init_state is not None:
        model.load_state_dict(init_state)
    opt = make_optimizer(model, cfg)
    params = [p for p in model.parameters()]
    for p in params:  # zero (not None) grads for unused params, e.g. a forced gate's logit: AdamW then
        p.grad = torch.zeros_like(p)  # treats them exactly as the grouped engine does (engine.py)
    data_gen, drop_gen = seeded_generator(cfg.seed, 0), seeded_generator(cfg.seed, 1)
    val = cfg.validation_batch(task)
    loss_pos = task.loss_positions(T)
    metrics: list[dict] = []
    snapshots: list[tuple[int, dict]] = []
    start = 0
    loss_sum = torch.zeros(())
    n_in_window = 0
    gens = {"data": data_gen, "drop": drop_gen}
    if resume is not None:
        start, metrics, loss_sum, n_in_window = restore_checkpoint(resume, model.load_state_dict, opt, gens)
        loss_sum = loss_sum.reshape(())
        snapshots = list(resume.get("snapshots", []))
    clock = CheckpointClock(cfg.checkpoint_every, checkpoint_seconds) if on_checkpoint is not None else None

    def _weights():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    if cfg.snapshot_every and start == 0:
        snapshots.append((0, _weights()))

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start, desc=f"{cfg.path.name} s{cfg.seed}", unit="step", leave=False)
    path = cfg.path
    for step in range(start, steps):
        gp, gc = step_gates(path, step, steps, prior_dropped(path, drop_gen))
        batch = task.sample(cfg.batch_size, T, data_gen)
        loss = task.loss(model_forward(model, batch.inputs, gp, gc, loss_pos), batch.targets)
        if path.dual_loss:
            loss = with_dual_loss(
                loss, lambda: task.loss(model_forward(model, batch.inputs, 0.0, 0.0, loss_pos), batch.targets))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        opt.step()
        loss_sum += loss.detach()
        n_in_window += 1
        done = step + 1
        if done % cfg.eval_every == 0 or done == steps:
            train_loss = float(loss_sum) / n_in_window
            check_finite(train_loss, done, cfg.run_id)
            normal = evaluate(model, task, val.inputs, val.targets)
            zero = evaluate(model, task, val.inputs, val.targets, 0.0, 0.0)
            row = metrics_row(done, train_loss, (gp, gc), _gate_means(model), normal, zero)
            metrics.append(row)
            loss_sum, n_in_window = torch.zeros(()), 0
            if bar is not None:
                bar.set_postfix(normal=f"{row['normal_' + task.metric]:.3f}", zero=f"{row['zero_' + task.metric]:.3f}")
        if cfg.snapshot_every and done % cfg.snapshot_every == 0:
            snapshots.append((done, _weights()))
        if clock is not None and clock.due(done, steps):
            ck = checkpoint(done, model.state_dict(), opt, gens, metrics, loss_sum, n_in_window)
            ck["snapshots"] = list(snapshots)
            on_checkpoint(ck)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    summary = run_summary(cfg, task, metrics[-1], steps, round(time.perf_counter() - t0, 3), model.n_params(),
                          **({"resumed_at": start} if start else {}))
    return RunResult(cfg, summary, metrics, _weights(), snapshots)


def run_summary(cfg: RunConfig, task: Task, last: dict, steps: int, seconds: float, n_params: int,
                **extra) -> dict:
    """A finished run's summary, from its final evaluation row (shared by train and engine).
    ``extra``: e.g. ``group_size``, and ``resumed_at`` (the checkpoint's step) for a resumed run;
    ``seconds`` then counts only the time since the resume."""
    m = task.metric
    return {"run_id": cfg.run_id, "task": cfg.task.name, "path": cfg.path.name, "seed": cfg.seed, "metric": m,
            f"normal_{m}": last[f"normal_{m}"], f"zero_{m}": last[f"zero_{m}"],
            "normal_loss": last["normal_loss"], "zero_loss": last["zero_loss"], "chance": task.chance,
            "steps": steps, "seconds": seconds, "n_params": n_params,
            "model_g_pos": last["model_g_pos"], "model_g_content": last["model_g_content"], **provenance(), **extra}


# ------------------------------------------------------------------------------- checkpoints
# One format for single runs and groups (engine.py): weights, optimiser state, every generator's
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
