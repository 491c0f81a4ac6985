"""Relative speed of the hand-written backward (issue 16) against the autograd one: a training
step's forward + loss + backward (no optimiser), alternating the two in one process so that load
from other processes hits both alike. Usage: python benchmarks/hand_backward.py [reps] [steps] [cases]
(cases: comma-separated keys of CASES). Runs inside the training settings (``prepare_training``:
allocator and flush-to-zero), one thread. The fastest block of each mode is the least disturbed by
other load; the per-alternation ratios show the spread."""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.func import stack_module_state, vmap

from softprior.config import make_run_config
from softprior.fastpath import fast_forward
from softprior.runtime import prepare_training
from softprior.tasks import make_task
from softprior.train import build_model


def setup(task_name, preset, K):
    task_name, _, variant = task_name.partition("-")
    opts = dict(loss_on=variant) if variant else None
    cfgs = [make_run_config(task_name, "unforced", s, model=preset, calibrated=False, task_options=opts)
            for s in range(K)]
    task = make_task(cfgs[0].task)
    params, _ = stack_module_state([build_model(c) for c in cfgs])
    params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    T = cfgs[0].model.n_ctx
    g = torch.Generator().manual_seed(0)
    batches = [task.sample(cfgs[0].batch_size, T, g) for _ in range(K)]
    inputs = torch.stack([b.inputs for b in batches])
    targets = torch.stack([b.targets for b in batches])
    return cfgs[0], task, params, inputs, targets, task.loss_positions(T)


def step(c, task, params, inputs, targets, pos, mode):
    L, H, K = c.model.n_layers, c.model.n_heads, inputs.shape[0]
    g = torch.sigmoid(params["gate_logits"])
    gp, gc = g[:, 0].expand(K, L, H), g[:, 1].expand(K, L, H)
    out = fast_forward(params, c.model, inputs, gp, gc, pos, backward=mode)
    vmap(task.loss)(out, targets).sum().backward()
    for p in params.values():
        p.grad = None


CASES = {"base1": ("assoc_recall", "base", 1), "base8": ("assoc_recall", "base", 8),
         "large1": ("assoc_recall", "large", 1), "large8": ("assoc_recall", "large", 8),
         "markov1": ("markov", "base", 1), "markovdet4": ("markov-determined", "base", 4),
         "linear8": ("linear_icl", "base", 8)}


def main(reps=5, steps=30, cases="base1,base8,large1,large8"):
    torch.set_num_threads(1)
    prepare_training()  # the allocator and flush-to-zero settings training runs with (runtime.py)
    for case in cases.split(","):
        task_name, preset, K = CASES[case]
        setup_ = setup(task_name, preset, K)
        times = {"autograd": [], "hand": []}
        for mode in times:  # warm-up
            for _ in range(5):
                step(*setup_, mode)
        for _ in range(reps):
            for mode in times:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(*setup_, mode)
                times[mode].append((time.perf_counter() - t0) / steps * 1e3)
        a, h = min(times["autograd"]), min(times["hand"])
        ratios = [x / y for x, y in zip(times["autograd"], times["hand"])]
        print(f"{task_name:12s} {preset:5s} K={K}: fastest block autograd {a:6.2f} ms/step, hand {h:6.2f} ms/step, "
              f"ratio {a / h:.2f}; per-alternation ratios median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(*(int(x) for x in a[:2]), *a[2:])
