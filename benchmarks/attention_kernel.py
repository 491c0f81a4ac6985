"""The fused attention operator (src/softprior/kernels/) against the pure-PyTorch ``fastpath._Attention``
on one call's shapes, forward and forward + backward, alternating, median CPU time of this thread.

    python benchmarks/attention_kernel.py [THREADS] [REPS]

Shapes: the base model's layer (K*H*B = 1*4*64 blocks of 32 x 32, e = d_head + r = 24, d_head = 16),
the same for a group of K = 8, and the large model's (e = 40, d_head = 32); the causal mask in the bias.
A benchmark: the numbers go to stdout, never into assertions."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from softprior import kernels
from softprior.model.fastpath import _Attention


def _inputs(K, H, B, T, e, dh):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(K * H * B, T, e, generator=g) for _ in range(2))
    v = torch.randn(K * H * B, T, dh, generator=g)
    mask = torch.zeros(T, T).masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    bias = torch.randn(K, H, T, T, generator=g) + mask
    return [t.requires_grad_() for t in (q, k, v, bias)]


def _cpu_us(f, n):
    t = time.thread_time()
    for _ in range(n):
        f()
    return (time.thread_time() - t) / n * 1e6


def main(threads: int = 1, reps: int = 7) -> None:
    torch.set_num_threads(threads)
    if not kernels.available():
        raise SystemExit(f"the fused operator did not build: {kernels.build_error()}")
    for label, shape in (("base, K = 1", (1, 4, 64, 32, 24, 16)), ("base, K = 8", (8, 4, 64, 32, 24, 16)),
                         ("large, K = 1", (1, 4, 64, 32, 40, 32))):
        ins = _inputs(*shape)
        w = torch.randn(shape[0] * shape[1] * shape[2], shape[3], shape[5])
        res = {}
        for name, op in (("fused", kernels.attention), ("torch", _Attention.apply)):
            res[name] = ([], [])
        n = max(2, 40 // shape[0])
        for _ in range(reps):
            for name, op in (("fused", kernels.attention), ("torch", _Attention.apply)):
                res[name][0].append(_cpu_us(lambda: op(*ins), n))
                res[name][1].append(_cpu_us(lambda: torch.autograd.grad(op(*ins), ins, w), n))
        med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in res.items()}
        print(f"{label} ({threads} thread(s)): forward fused {med['fused'][0]:.0f} / torch {med['torch'][0]:.0f} us "
              f"({med['torch'][0] / med['fused'][0]:.2f}x); forward + backward fused {med['fused'][1]:.0f} / torch "
              f"{med['torch'][1]:.0f} us ({med['torch'][1] / med['fused'][1]:.2f}x)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
