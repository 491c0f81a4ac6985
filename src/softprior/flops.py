"""What the machine and a training step cost, counted without running a sweep: the machine's fp32 GEMM
rate (``gemm_rate``) and the matmul FLOPs of one training step (``train_step_flops``). The sweep's
time ledger (``executors.ledger``) and ``softprior bench`` both read them; a module of its own, below both
(``bench`` measures sweeps through ``executors``, so the ledger cannot import ``bench``)."""

from __future__ import annotations

import time

import torch

__all__ = ["gemm_rate", "scheme_flops", "train_step_flops"]


def gemm_rate(threads: int | None = None, n: int = 1024, reps: int = 10) -> float:
    """The machine's fp32 GEMM rate in GFLOP/s, as ``softprior bench`` measures it: the fastest of
    ``reps`` n^3 matmuls (after 3 warm-ups) at ``threads`` torch threads (default: every core this
    process may use, the rate of docs/PERFORMANCE.md's arithmetic floor). The matrices come from a
    generator of its own (the global RNG is left alone) and the thread count is restored."""
    import os
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n ** 3 / best / 1e9
    finally:
        torch.set_num_threads(old)


def scheme_flops(m, B: int, Tq: int, T: int) -> float:
    """Matmul FLOPs of a contextual positional scheme's own network in one layer's forward, for B
    sequences, Tq queries and T keys (model config ``m``; 0 for the other schemes, whose tables do not
    grow with the batch):
    - DAPE (Zheng et al. 2024): f = Linear(2H, w) -> LeakyReLU -> Linear(w, H) at every (i, j):
      2 B Tq T (2H w + w H), w = ``DAPE.MLP_WIDTH`` (32);
    - CoPE (Golovneva et al. 2024): z_i = q_i P per head and query, P [d_head, npos], npos = n_ctx + 1:
      2 B H Tq d_head npos.
    GPSA's positional map is per step, not per example (2 Tq T x 2 x H), and is left out."""
    if m.positional == "dape":
        from .positional.contextual import DAPE
        w, H = DAPE.MLP_WIDTH, m.n_heads
        return 2 * B * Tq * T * (2 * H * w + w * H)
    if m.positional == "cope":
        return 2 * B * m.n_heads * Tq * m.d_head * (m.n_ctx + 1)
    return 0.0


def train_step_flops(cfg) -> float:
    """Matmul FLOPs of one training step (forward x 3 for forward + backward), from the shapes.
    The last layer computes queries only at the loss positions, as the engine does; a contextual
    scheme's own network is counted in every layer (``scheme_flops``)."""
    m, B, T = cfg.model, cfg.batch_size, cfg.model.n_ctx
    d, H, r, L = m.d_model, m.n_heads, m.content_rank, m.n_layers
    dh, V = m.d_head, m.vocab
    from .tasks.generators import make_task
    P = len(make_task(cfg.task).loss_positions(T))
    fwd = 0.0
    for layer in range(L):
        Tq = P if layer == L - 1 else T
        fwd += 2 * B * T * d * (2 * d + H * r)  # K, V, content factor xV at every position
        fwd += 2 * B * Tq * d * (d + H * r)  # Q and xU at query positions
        fwd += 2 * B * H * Tq * T * (dh + r)  # scores (content folded in)
        fwd += 2 * B * H * Tq * T * dh  # pattern @ V
        fwd += 2 * B * Tq * d * d  # output projection
        fwd += scheme_flops(m, B, Tq, T)  # DAPE's MLP, CoPE's position projection
    fwd += 2 * B * P * d * V  # tied unembedding
    return 3 * fwd
