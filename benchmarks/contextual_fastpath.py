"""One training step of the contextual schemes (CoPE, DAPE, GPSA) through the readable model (``vmap``
of ``functional_call``, the way they trained before they joined the fast path) against the fast path
(``fastpath.fast_forward``, point 6), alternating the two in one process so that load from other
processes hits both alike.

    python benchmarks/contextual_fastpath.py [reps] [steps] [schemes] [tasks] [Ks] > table.md

Defaults: 3 reps x 20 steps per mode, cope,dape,gpsa, assoc_recall,markov, K = 1,4. A step is
``loop.Runs.step`` (batch sampling, forward, loss, backward, clipping, AdamW) of K runs of the
paper's configuration for that baseline (the calibrated defaults), one torch thread, inside the
training settings (``prepare_training``: the allocator). Each mode's figure is its
fastest block (the least disturbed by other load), in ms per run-step. A third mode, NoPE on the
fast path (the same shapes, no scheme), is timed in the same alternation as a reference: the column
"fast / nope" is the factor a contextual step still costs over a static fast-path step.
A benchmark, not a test.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.func import functional_call, vmap

from softprior.config import make_run_config
from softprior.training.runtime import prepare_training
from softprior.training.loop import Runs


def make_runs(baseline: str, task: str, K: int, readable: bool) -> Runs:
    """K runs of ``baseline`` on ``task``; ``readable``: their step through the readable model, vmapped
    over the runs (``Runs.__init__``'s branch for a model the fast path does not support)."""
    runs = Runs([make_run_config(task, seed=s, baseline=baseline) for s in range(K)])
    if readable:
        base, pos = runs.base, runs.loss_pos

        def fwd(p, inputs, gp, gc):
            return functional_call(base, p, (inputs, gp, gc), {"positions": pos})
        runs.forward = vmap(fwd, in_dims=(0, 0, 0, 0))
        runs.forward_val = vmap(fwd, in_dims=(0, None, 0, 0))
        runs.shared_inputs = False
    return runs


def ms_per_run_step(runs: Runs, steps: int, start: int) -> float:
    t = time.perf_counter()
    for i in range(start, start + steps):
        runs.step(i)
    return (time.perf_counter() - t) * 1000 / (steps * runs.K)


def main(reps: int = 3, steps: int = 20, schemes: str = "cope,dape,gpsa", tasks: str = "assoc_recall,markov",
         Ks: str = "1,4") -> None:
    torch.set_num_threads(1)
    prepare_training()
    rows = []
    for task in tasks.split(","):
        for K in (int(k) for k in Ks.split(",")):
            for scheme in schemes.split(","):
                modes = {"readable": make_runs(scheme, task, K, True), "fast": make_runs(scheme, task, K, False),
                         "nope": make_runs("nope", task, K, False)}
                best = {m: float("inf") for m in modes}
                for m, r in modes.items():  # warm-up: first-call costs (allocations, vmap tracing) off the clock
                    ms_per_run_step(r, 3, 0)
                for rep in range(reps):
                    for m, r in modes.items():
                        best[m] = min(best[m], ms_per_run_step(r, steps, 3 + rep * steps))
                rows.append((scheme, task, K, best["readable"], best["fast"], best["nope"]))
                print(f"{scheme} {task} K={K}: readable {best['readable']:.2f}, fast {best['fast']:.2f}, "
                      f"nope fast {best['nope']:.2f} ms per run-step", file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), best of {reps} x {steps} steps per mode, "
          "ms per run-step\n")
    print("| scheme | task | K | readable (vmap) | fast path | readable / fast | nope fast | fast / nope |")
    print("|---|---|---|---|---|---|---|---|")
    for scheme, task, K, r, f, n in rows:
        print(f"| {scheme} | {task} | {K} | {r:.2f} | {f:.2f} | {r / f:.2f} | {n:.2f} | {f / n:.2f} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *args[2:5])
