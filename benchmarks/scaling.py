"""Step-time scaling of the training engine: batch size, context length, width, and K (runs per group).

    python benchmarks/scaling.py [THREADS] > table.md

Prints a markdown table (ms per training step, or per run-step for groups) at THREADS torch threads
(default 1: the engine's fastest on a small machine, and what each sweep worker uses).
A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from softprior.bench import _our_step
from softprior.config import make_run_config
from softprior.flops import train_step_flops
from softprior.training.engine import train_group
from softprior.training.runtime import prepare_training


def _ms(step, n=20, reps=2):
    for _ in range(5):
        step()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            step()
        out.append((time.perf_counter() - t) / n * 1000)
    return statistics.median(out)


def main():
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    prepare_training()  # as train / train_group do
    rows = []
    for model, B, T in [("base", 16, 32), ("base", 32, 32), ("base", 64, 32), ("base", 128, 32),
                        ("base", 64, 64), ("base", 64, 120), ("large", 64, 32)]:
        cfg = make_run_config("assoc_recall", "unforced", 0, model=model, batch_size=B,
                              model_options={"n_ctx": T})
        ms = _ms(_our_step(cfg))
        rows.append((f"single, {model}, B={B}, T={T}", ms, train_step_flops(cfg) / ms / 1e6))
        print(f"{rows[-1][0]}: {ms:.2f} ms", file=sys.stderr)
    # warm-up: one-time start-up costs would otherwise land on the K=1 row
    train_group([make_run_config("assoc_recall", "unforced", 0, steps=5, eval_every=10 ** 6, n_val=64)])
    for K in (1, 2, 4, 8, 16):
        steps = 30
        cfgs = [make_run_config("assoc_recall", "unforced", k, steps=steps, eval_every=10 ** 6, n_val=64)
                for k in range(K)]
        t = time.perf_counter()
        train_group(cfgs)
        ms = (time.perf_counter() - t) * 1000 / (steps * K)
        rows.append((f"group, base, B=64, T=32, K={K} (per run-step)", ms, train_step_flops(cfgs[0]) / ms / 1e6))
        print(f"{rows[-1][0]}: {ms:.2f} ms", file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| configuration | ms / step | achieved GFLOP/s |\n|---|---|---|")
    for name, ms, gf in rows:
        print(f"| {name} | {ms:.2f} | {gf:.1f} |")


if __name__ == "__main__":
    main()
