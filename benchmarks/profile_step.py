"""Where a base training step's time goes: a ``torch.profiler`` table and the fraction of the GEMM rate.

    python benchmarks/profile_step.py [THREADS] [STEPS] > profile.md

For K = 1 (a single run) and K = 8 (a group), base model, batch 64, T = 32, assoc recall, unforced:
the step of ``train.Runs`` (what ``train`` and ``engine.train_group`` run), timed over STEPS steps
(default 40, after 10 warm-ups) and then profiled over the same number. Prints per K the ms per
run-step, the achieved GFLOP/s (``flops.train_step_flops``: what the fast path computes), its
fraction of the machine's fp32 GEMM rate at the same thread count (``flops.gemm_rate``), and the
profiler's 15 costliest operators by self CPU time. Run it on a quiet machine, inside the training
setting (``runtime.prepare_training``, as a sweep worker trains).

Then the step's fixed cost: the same step at batch 1 (per run-step), which is all that does not grow
with the batch (Python, dispatch, autograd's graph, the optimiser, the gates), and the bound it sets:
even if every batch-proportional FLOP ran at the GEMM rate, a batch-64 step would take floor + fixed,
so its fraction of the GEMM rate is at most floor / (floor + fixed).

Last, ms per 64 examples for K runs of batch B: whether a group's per-example work runs slower than a
single run's at the same number of examples in flight.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from softprior.config import make_run_config
from softprior.flops import gemm_rate, train_step_flops
from softprior.runtime import prepare_training
from softprior.train import Runs


def _time(runs: Runs, steps: int) -> float:
    t = time.perf_counter()
    for s in range(steps):
        runs.step(s)
    return (time.perf_counter() - t) / steps * 1000


def _best(runs: Runs, steps: int, warm: int = 10) -> float:
    """ms per step, the best of 3 timings of ``steps`` steps after ``warm`` warm-up steps."""
    _time(runs, warm)
    return min(_time(runs, steps) for _ in range(3))


def main(threads: int = 1, steps: int = 40) -> None:
    torch.set_num_threads(threads)
    rate = gemm_rate(threads)
    print(f"torch {torch.__version__}, {threads} thread(s), fp32 GEMM 1024^3: {rate:.1f} GFLOP/s\n")
    prepare_training()
    for K in (1, 8):
        cfgs = [make_run_config("assoc_recall", "unforced", k) for k in range(K)]
        runs = Runs(cfgs)
        ms = _best(runs, steps) / K  # per run-step
        gflops = train_step_flops(cfgs[0]) / ms / 1e6
        print(f"## K = {K}: {ms:.2f} ms per run-step, {gflops:.1f} GFLOP/s, {gflops / rate:.0%} of GEMM\n")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _time(runs, steps)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40)
        print("```\n" + table + "```\n", flush=True)
    print("## The fixed cost: the same step at batch 1\n\n| K | ms per run-step at B = 1 | floor at B = 64, ms | "
          "bound on the fraction of GEMM at B = 64 |\n|---|---|---|---|")
    floor = train_step_flops(make_run_config("assoc_recall", "unforced", 0)) / rate / 1e6  # ms at B = 64
    for K in (1, 8):
        fixed = _best(Runs([make_run_config("assoc_recall", "unforced", k, batch_size=1) for k in range(K)]), steps) / K
        print(f"| {K} | {fixed:.2f} | {floor:.2f} | {floor / (floor + fixed):.0%} |", flush=True)
    print("\n## Per 64 examples\n\n| K | B | ms per step | ms per 64 examples |\n|---|---|---|---|")
    for K, B in ((1, 64), (1, 128), (1, 256), (1, 512), (2, 64), (4, 64), (8, 64)):
        runs = Runs([make_run_config("assoc_recall", "unforced", k, batch_size=B) for k in range(K)])
        ms = _best(runs, max(5, steps * 64 // (K * B)), warm=5)
        print(f"| {K} | {B} | {ms:.2f} | {ms * 64 / (K * B):.2f} |", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
