"""Cost of ``runtime.one_thread`` (clipping and AdamW in one thread, so a run's bits do not depend on the
thread count) at 2 threads: ``Runs.step`` with it and with a no-op in its place, alternating, medians
of 7 samples of n steps, ms per run-step (docs/PERFORMANCE.md, section 6). Usage: python benchmarks/one_thread_cost.py"""
import contextlib
import importlib
import json
import statistics
import time

import torch

from softprior.config import make_run_config
from softprior.training.runtime import prepare_training

T = importlib.import_module("softprior.training.loop")  # the module (softprior.training.loop is also the function)
prepare_training()
torch.set_num_threads(2)
real = T.one_thread
out = {}
for model, K, n in (("base", 1, 40), ("base", 8, 10), ("large", 1, 6), ("large", 8, 2)):
    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, model=model) for k in range(K)]
    runs = T.Runs(cfgs)
    step = [0]

    def go(ctx):
        T.one_thread = ctx
        t = time.perf_counter()
        for _ in range(n):
            runs.step(step[0]); step[0] += 1
        return (time.perf_counter() - t) / n / K * 1e3
    go(real); go(contextlib.nullcontext)
    a, b = [], []
    for _ in range(7):
        a.append(go(real)); b.append(go(contextlib.nullcontext))
    ma, mb = statistics.median(a), statistics.median(b)
    out[f"{model} K={K}"] = {"one_thread_ms": round(ma, 3), "without_ms": round(mb, 3), "cost": round(ma / mb - 1, 4)}
    print(model, K, out[f"{model} K={K}"], flush=True)
T.one_thread = real
print(json.dumps(out))
