"""``softprior bench``: the training engine against a plain reference, in one process.

Reports the fp32 GEMM rate measured now, the model FLOPs per training step counted from the
shapes, ms per step of a single base run (and its model-FLOP utilisation, achieved / GEMM), ms per
run-step when K runs train together (``engine.train_group``), and the same for the plain nn.Module
reference in ``benchmarks/reference.py`` (measured alternately with ours, so machine noise hits both).
A benchmark, not a test: the numbers go to stdout, never into assertions.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["run_bench", "train_step_flops"]


def _gemm_gflops(n: int = 1024, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def train_step_flops(cfg) -> float:
    """Matmul FLOPs of one training step (forward x 3 for forward + backward), from the shapes.
    The last layer computes queries only at the loss positions, as the engine does."""
    m, B, T = cfg.model, cfg.batch_size, cfg.model.n_ctx
    d, H, r, L = m.d_model, m.n_heads, m.content_rank, m.n_layers
    dh, V = m.d_head, m.vocab
    from .tasks import make_task
    P = len(make_task(cfg.task).loss_positions(T))
    fwd = 0.0
    for layer in range(L):
        Tq = P if layer == L - 1 else T
        fwd += 2 * B * T * d * (2 * d + H * r)  # K, V, content factor xV at every position
        fwd += 2 * B * Tq * d * (d + H * r)  # Q and xU at query positions
        fwd += 2 * B * H * Tq * T * (dh + r)  # scores (content folded in)
        fwd += 2 * B * H * Tq * T * dh  # pattern @ V
        fwd += 2 * B * Tq * d * d  # output projection
    fwd += 2 * B * P * d * V  # tied unembedding
    return 3 * fwd


def _our_step(cfg):
    from .tasks import make_task
    from .train import build_model, make_optimizer
    model = build_model(cfg)
    opt = make_optimizer(model, cfg)
    task = make_task(cfg.task)
    gen = torch.Generator().manual_seed(0)
    pos = task.loss_positions(cfg.model.n_ctx)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)

    def step():  # exactly the body of train.train's loop for a learned-gate run
        b = task.sample(cfg.batch_size, cfg.model.n_ctx, gen)
        loss = task.loss(model(b.inputs, None, None, positions=pos), b.targets)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        opt.step()
    return step


def _time(step, n):
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1000


def run_bench(quick: bool = False, group_size: int = 8, log=print) -> dict:
    from .config import make_run_config
    from .engine import train_group
    ref_mod = _load_reference()
    cfg = make_run_config("assoc_recall", "unforced", 0)
    threads = torch.get_num_threads()
    log(f"torch {torch.__version__}, {threads} threads")
    gemm = _gemm_gflops()
    flops = train_step_flops(cfg)
    log(f"fp32 GEMM (1024^3): {gemm:.1f} GFLOP/s;  model: {flops / 1e9:.3f} GFLOP per training step")
    ours, (ref, _) = _our_step(cfg), ref_mod.make_reference_step()
    n, reps = (20, 3) if quick else (60, 7)
    for f in (ours, ref):
        _time(f, 10)
    o_ms, r_ms = [], []
    for _ in range(reps):  # alternate, so noise hits both
        o_ms.append(_time(ours, n))
        r_ms.append(_time(ref, n))
    single, reference = statistics.median(o_ms), statistics.median(r_ms)
    log(f"single base run: {single:.2f} ms/step (MFU {flops / (single / 1e3) / (gemm * 1e9):.1%});  "
        f"plain reference: {reference:.2f} ms/step;  speed-up {reference / single:.2f}x")
    steps = 30 if quick else 100
    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, steps=steps, eval_every=10 ** 6,
                            n_val=64) for k in range(group_size)]
    train_group(cfgs[:2], progress=False) if not quick else None  # warm-up
    t = time.perf_counter()
    train_group(cfgs)
    group = (time.perf_counter() - t) * 1000 / (steps * group_size)
    log(f"group of K={group_size}: {group:.2f} ms per run-step;  vs single {single / group:.2f}x, "
        f"vs reference {reference / group:.2f}x (a sweep of K runs takes {group / reference:.2f} of the time "
        f"of K sequential reference runs)")
    return {"gemm_gflops": round(gemm, 2), "model_gflop_per_step": round(flops / 1e9, 4),
            "single_ms_per_step": round(single, 3), "reference_ms_per_step": round(reference, 3),
            "group_ms_per_run_step": round(group, 3), "group_size": group_size,
            "mfu": round(flops / (single / 1e3) / (gemm * 1e9), 4),
            "reference_mfu": round(flops / (reference / 1e3) / (gemm * 1e9), 4),
            "speedup_single": round(reference / single, 3), "speedup_group": round(reference / group, 3),
            "threads": threads, "single_ms_samples": [round(x, 3) for x in o_ms],
            "reference_ms_samples": [round(x, 3) for x in r_ms]}


def _load_reference():
    """benchmarks/reference.py of the source checkout (the package is installed editable)."""
    import importlib.util
    from pathlib import Path
    f = Path(__file__).resolve().parents[2] / "benchmarks" / "reference.py"
    if not f.exists():
        raise RuntimeError(f"the plain reference model {f} is missing: run bench from a source checkout "
                           "(pip install -e .)")
    spec = importlib.util.spec_from_file_location("softprior_bench_reference", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
