"""Where a base training step's time goes: a ``torch.profiler`` table and the fraction of the GEMM rate.

    python benchmarks/profile_step.py [THREADS] [STEPS] > profile.md

For K = 1 (a single run) and K = 8 (a group), base model, batch 64, T = 32, assoc recall, unforced:
the step of ``loop.Runs`` (what ``train`` and ``engine.train_group`` run), timed over STEPS steps
(default 40, after 10 warm-ups) and then profiled over the same number. Prints per K the ms per
run-step, the achieved GFLOP/s (``flops.train_step_flops``: what the fast path computes), its
fraction of the machine's fp32 GEMM rate at the same thread count (``flops.gemm_rate``), and the
profiler's 15 costliest operators by self CPU time. Run it on a quiet machine, inside the training
setting (``runtime.prepare_training``, as a sweep worker trains).

Then the step's fixed cost: the same step at batch 1 (per run-step), which is all that does not grow
with the batch (Python, dispatch, autograd's graph, the optimiser, the gates), and the bound it sets:
even if every batch-proportional FLOP ran at the GEMM rate, a batch-64 step would take floor + fixed,
so its fraction of the GEMM rate is at most floor / (floor + fixed).

Then ms per 64 examples for K runs of batch B: whether a group's per-example work runs slower than a
single run's at the same number of examples in flight.

Last, the step's own matrix products (``mm``, ``bmm``, ``addmm``, ``baddbmm``, per input shapes and
strides): the FLOP the step performs in them (against the FLOP the floor counts), their time in the
step, and the same calls alone on fresh tensors with the caches warm and with the caches flushed.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from softprior.config import make_run_config
from softprior.flops import gemm_rate, train_step_flops
from softprior.training.runtime import prepare_training
from softprior.training.loop import Runs


def _time(runs: Runs, steps: int) -> float:
    t = time.perf_counter()
    for s in range(steps):
        runs.step(s)
    return (time.perf_counter() - t) / steps * 1000


def _best(runs: Runs, steps: int, warm: int = 10) -> float:
    """ms per step, the best of 3 timings of ``steps`` steps after ``warm`` warm-up steps."""
    _time(runs, warm)
    return min(_time(runs, steps) for _ in range(3))


_MATMULS = {torch.ops.aten.bmm: torch.bmm, torch.ops.aten.baddbmm: torch.baddbmm, torch.ops.aten.mm: torch.mm,
            torch.ops.aten.addmm: torch.addmm}  # the operators the probe times, and how to call each alone


class _MatmulProbe(TorchDispatchMode):
    """Times every matmul of the steps run under it, per (operator, input shapes and strides)."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}  # key -> [count, seconds, the inputs of one call]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        if op not in _MATMULS:
            return func(*args, **(kwargs or {}))
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        key = (op, tuple((tuple(a.shape), a.stride()) for a in tensors))
        c = self.calls.setdefault(key, [0, 0.0, tensors])
        c[0], c[1] = c[0] + 1, c[1] + dt
        return out


def _matmul_flop(shapes: list) -> float:
    """2 m k n (x the batch) of one call, from its input shapes (``addmm``/``baddbmm``: the bias first)."""
    a, b = shapes[-2:]
    return 2.0 * (a[0] if len(a) == 3 else 1) * a[-2] * a[-1] * b[-1]


_FLUSH = torch.empty(16 << 20)  # 64 MiB written before a call: the caches hold none of its inputs


def _alone_ms(op, inputs: list, cold: bool, reps: int = 20) -> float:
    """ms per call of ``op`` alone on fresh tensors with the shapes and strides of ``inputs``: with the
    caches warm (the same call repeated) or ``cold`` (64 MiB written before each call); best of 3."""
    args = [torch.empty_strided(a.shape, a.stride()).normal_() for a in inputs]
    fn = _MATMULS[op]
    for _ in range(3):
        fn(*args)
    best = float("inf")
    for _ in range(3):
        total = 0.0
        for _ in range(reps):
            if cold:
                _FLUSH.add_(1.0)
            t = time.perf_counter()
            fn(*args)
            total += time.perf_counter() - t
        best = min(best, total / reps * 1000)
    return best


def matmul_table(runs: Runs, rate: float, steps: int = 10) -> None:
    """Every matmul of a step of ``runs``: its time in the step (``_MatmulProbe`` over ``steps`` steps)
    and alone, warm and cold (``_alone_ms``), and the FLOP the step performs in them."""
    probe = _MatmulProbe()
    with probe:
        _time(runs, steps)
    rows = []
    for (op, sig), (n, sec, inputs) in probe.calls.items():
        calls, f = n / steps, _matmul_flop([s for s, _ in sig])
        rows.append((sec / steps * 1000, op.__name__, [list(s) for s, _ in sig], calls, f * calls,
                     _alone_ms(op, inputs, False) * calls, _alone_ms(op, inputs, True) * calls))
    rows.sort(key=lambda r: -r[0])
    print("| operator | input shapes | calls per step | GFLOP per step | ms in the step | ms alone, warm | "
          "ms alone, cold |\n|---|---|---|---|---|---|---|")
    for ms, name, shapes, calls, fl, warm, cold in rows[:12]:
        print(f"| {name} | {' x '.join(map(str, shapes))} | {calls:g} | {fl / 1e9:.3f} | {ms:.3f} | {warm:.3f} | {cold:.3f} |")
    flop, ms, warm, cold = (sum(r[i] for r in rows) for i in (4, 0, 5, 6))
    nominal = train_step_flops(runs.cfgs[0]) * runs.K
    print(f"\nAll {len(rows)} of them: {flop / 1e9:.3f} GFLOP a step ({flop / nominal:.0%} of the {nominal / 1e9:.3f} "
          f"the floor counts); {ms:.2f} ms in the step, {warm:.2f} ms alone warm ({flop / warm / 1e6 / rate:.0%} of "
          f"GEMM), {cold:.2f} ms alone cold\n", flush=True)


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
    for K in (1, 8):
        print(f"\n## The step's matmuls alone, K = {K}\n")
        matmul_table(Runs([make_run_config("assoc_recall", "unforced", k) for k in range(K)]), rate)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
