"""Where a training step's time goes, part by part: ``loop.Runs.step`` over K associative-recall runs,
each part timed in place (``time.perf_counter`` around the callables the step calls: the data draw,
the gates, the forward, the loss, zeroing, the backward, clipping, AdamW), the rest of the step left as
"other". docs/PERFORMANCE.md, section 6, quotes it.

    python benchmarks/step_parts.py [threads] [K] [steps] [model]
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from softprior.config import make_run_config
from softprior.training.loop import Runs

train_mod = sys.modules["softprior.training.loop"]  # (the package's ``train`` is the function)

PARTS = ("sample", "gates", "forward", "loss", "zero_grad", "backward", "clipping", "AdamW")


def timed(acc: dict, name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name] += time.perf_counter() - t
    return wrapper


@contextmanager
def instrumented(runs: Runs, acc: dict):
    """Within it, each part of ``runs.step`` adds its seconds to ``acc``."""
    saved = {"clip": train_mod.clip_per_run_, "backward": torch.Tensor.backward}
    task = runs.task
    runs.forward = timed(acc, "forward", runs.forward)
    runs.loss = timed(acc, "loss", runs.loss)
    runs.model_gates = timed(acc, "gates", runs.model_gates)
    runs._gate_tensor = timed(acc, "gates", runs._gate_tensor)
    runs.opt.zero_grad = timed(acc, "zero_grad", runs.opt.zero_grad)
    runs.opt.step = timed(acc, "AdamW", runs.opt.step)
    task.sample = timed(acc, "sample", task.sample)
    train_mod.clip_per_run_ = timed(acc, "clipping", saved["clip"])
    torch.Tensor.backward = timed(acc, "backward", saved["backward"])
    try:
        yield
    finally:
        train_mod.clip_per_run_ = saved["clip"]
        torch.Tensor.backward = saved["backward"]
        del task.sample


def main(threads: int = 1, K: int = 1, steps: int = 300, model: str = "base") -> dict[str, float]:
    torch.set_num_threads(threads)
    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, model=model) for k in range(K)]
    runs = Runs(cfgs)
    for _ in range(30):
        runs.step(0)
    acc = dict.fromkeys(PARTS, 0.0)
    samples = []
    with instrumented(runs, acc):
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(steps // 5):
                runs.step(0)
            samples.append(time.perf_counter() - t)
    n = (steps // 5) * 5 * K
    ms = {p: acc[p] / n * 1e3 for p in PARTS}
    ms["total"] = sum(samples) / n * 1e3
    ms["other"] = ms["total"] - sum(ms[p] for p in PARTS)
    print(f"{model}, {threads} thread(s), K = {K}, ms per run-step (each 5th of the steps: "
          f"{', '.join(f'{s / (n // 5) * 1e3:.2f}' for s in samples)}):")
    print("  " + "  ".join(f"{p} {v:.3f}" for p, v in ms.items()))
    return ms


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:3]), *args[3:4])
