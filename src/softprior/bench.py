"""``softprior bench``: the training engine against a plain reference, in one process.

Reports the fp32 GEMM rate measured now, the model FLOPs per training step counted from the
shapes, ms per step of a single base run (and its model-FLOP utilisation, achieved / GEMM), ms per
run-step when K runs train together (``engine.train_group``), and the same for the plain nn.Module
reference in ``softprior/reference.py`` (measured alternately with ours, so machine noise hits both), and
the fused operators (``kernels/``: the whole step and the attention) against the engine with the
attention operator alone, without either, and the reference, for both presets, K = 1 and 8, 1 and 2 threads (``engine_table``; alone: ``--engines-only``).
A benchmark, not a test: the numbers go to stdout, never into assertions.
"""

from __future__ import annotations

import statistics
import time

import torch

from .flops import gemm_rate, train_step_flops

__all__ = ["run_bench", "run_engines", "engine_table"]


def _our_step(cfg):
    """One training step of ``loop.train`` (its ``Runs.step``, K = 1), as a callable."""
    from .training.loop import Runs
    runs = Runs([cfg])
    return lambda: runs.step(0)


def _time(step, n):
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1000


def _at_best_threads(samples: dict) -> tuple[dict, tuple[float, int], tuple[float, int]]:
    """From ``_alternate``'s samples: the medians per thread count, and (ms/step, threads) of ours and of
    the reference, each at its own faster thread count."""
    med = {th: (statistics.median(o), statistics.median(r)) for th, (o, r) in samples.items()}
    o_th, r_th = min(med, key=lambda th: med[th][0]), min(med, key=lambda th: med[th][1])
    return med, (med[o_th][0], o_th), (med[r_th][1], r_th)


def _alternate(ours, ref, n: int, reps: int, thread_counts) -> dict:
    """ms/step medians of ``reps`` alternating samples of ``n`` steps, per thread count."""
    out = {}
    for th in thread_counts:
        torch.set_num_threads(th)
        for f in (ours, ref):
            _time(f, 10)
        o_ms, r_ms = [], []
        for _ in range(reps):  # alternate, so noise hits both
            o_ms.append(_time(ours, n))
            r_ms.append(_time(ref, n))
        out[th] = (o_ms, r_ms)
    return out


def sweep_bench(n_runs: int, reference_ms: float, steps: int = 3600, workers: int | None = None,
                log=print) -> dict:
    """Wall time of a sweep of ``n_runs`` base runs (associative recall, alternately unforced and
    fade600, seeds 0..n-1) through the same driver as ``softprior reproduce`` (``executors.sweep.execute``,
    ``workers`` processes, groups of ceil(n / workers)), into a throw-away store; against ``n_runs``
    sequential reference runs at ``reference_ms`` per step."""
    import math
    import os
    import tempfile
    from .config import make_run_config
    from .executors.sweep import execute
    from .store import RunStore
    workers = workers or os.cpu_count() or 1
    group = math.ceil(n_runs / workers)
    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, steps=steps)
            for k in range(n_runs)]
    with tempfile.TemporaryDirectory(prefix="softprior-bench-") as d:
        t = time.perf_counter()
        rep = execute(cfgs, RunStore(d), workers=workers, group_size=group, progress=False)
        wall = time.perf_counter() - t
    if not rep.ok:
        raise RuntimeError(f"bench sweep failed: {rep.line()}")
    ref_s = n_runs * steps * reference_ms / 1e3
    log(f"sweep of {n_runs} base runs x {steps} steps ({workers} workers, groups of {group}): {wall:.1f} s wall;  "
        f"{n_runs} sequential reference runs: {ref_s:.1f} s ({n_runs} x {steps} x {reference_ms:.2f} ms);  "
        f"ratio {wall / ref_s:.3f}")
    return {"sweep_runs": n_runs, "sweep_steps": steps, "sweep_workers": workers, "sweep_group": group,
            "sweep_seconds": round(wall, 2), "sweep_reference_seconds": round(ref_s, 2),
            "sweep_ratio": round(wall / ref_s, 4)}


def measure_group_scaling(ks=(1, 2, 4, 8, 16), steps: int = 30, threads: int = 1, log=print,
                          model: str = "base") -> dict[int, float]:
    """ms per run-step of ``engine.train_group`` for a group of each K in ``ks`` of ``model`` (a
    preset), at ``threads`` torch threads (a sweep worker's setting): the table ``--group auto``
    chooses from for that model size (``executors.grouping.group_sizes``)."""
    from .config import make_run_config
    from .training.engine import train_group
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train_group([make_run_config("assoc_recall", "unforced", 0, steps=5, eval_every=10 ** 6, n_val=64,
                                     model=model)])  # warm-up
        out = {}
        for K in ks:
            cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, steps=steps,
                                    eval_every=10 ** 6, n_val=64, model=model) for k in range(K)]
            t = time.perf_counter()
            train_group(cfgs)
            out[K] = round((time.perf_counter() - t) * 1000 / (steps * K), 3)
            log(f"  {model} group of K={K} ({threads} thread): {out[K]:.2f} ms per run-step")
        return out
    finally:
        torch.set_num_threads(old)


def run_bench(quick: bool = False, group_size: int = 8, log=print) -> dict:
    """Each implementation is timed at 1 thread and at the machine's thread count and reported at its
    faster one (the thread count tuned to the machine); the per-count figures are in the JSON.
    The runtime setting (``runtime.prepare_training``) applies to the whole benchmark, the reference
    included (the conservative ratio)."""
    from .training.runtime import prepare_training
    return _run_bench(quick, group_size, log, prepare_training())


def _run_bench(quick: bool, group_size: int, log, settings: dict) -> dict:
    from .config import make_run_config
    from .training.engine import train_group
    ref_mod = _load_reference()
    cfg = make_run_config("assoc_recall", "unforced", 0)
    max_threads = torch.get_num_threads()
    thread_counts = sorted({1, max_threads})
    log(f"torch {torch.__version__}, timing at {thread_counts} threads; runtime settings (softprior.training.runtime, "
        f"applied to both implementations): {settings}")
    gemm = gemm_rate(threads=max_threads)
    flops = train_step_flops(cfg)
    log(f"fp32 GEMM (1024^3, {max_threads} threads): {gemm:.1f} GFLOP/s;  model: {flops / 1e9:.3f} GFLOP per "
        "training step")
    ours, (ref, _) = _our_step(cfg), ref_mod.make_reference_step()
    n, reps = (20, 3) if quick else (60, 7)
    samples = _alternate(ours, ref, n, reps, thread_counts)
    med, (single, o_th), (reference, r_th) = _at_best_threads(samples)
    for th, (o, r) in med.items():
        log(f"  {th} thread(s): ours {o:.2f} ms/step, reference {r:.2f} ms/step ({r / o:.2f}x)")
    mfu = flops / (single / 1e3) / (gemm * 1e9)
    log(f"single base run: {single:.2f} ms/step at {o_th} thread(s) (MFU {mfu:.1%});  plain reference: "
        f"{reference:.2f} ms/step at {r_th} thread(s);  speed-up {reference / single:.2f}x")
    large_single, large_ref, large_th = _large_line(ref_mod, quick, thread_counts, log)
    steps = 30 if quick else 100
    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, steps=steps, eval_every=10 ** 6,
                            n_val=64) for k in range(group_size)]
    torch.set_num_threads(o_th)
    train_group(cfgs[:2], progress=False) if not quick else None  # warm-up
    t = time.perf_counter()
    train_group(cfgs)
    group = (time.perf_counter() - t) * 1000 / (steps * group_size)
    torch.set_num_threads(max_threads)
    log(f"group of K={group_size} ({o_th} thread(s)): {group:.2f} ms per run-step;  vs single {single / group:.2f}x, "
        f"vs reference {reference / group:.2f}x (a sweep of K runs in one process takes {group / reference:.2f} of "
        f"the time of K sequential reference runs; `--workers 2` runs two such groups at once)")
    log("group scaling (the table `--group auto` chooses from):")
    scaling = measure_group_scaling((1, 2, 4, 8) if quick else (1, 2, 4, 8, 16), steps=steps if quick else 50, log=log)
    large = measure_group_scaling((1, 2) if quick else (1, 2, 4, 6), steps=3 if quick else 12, log=log, model="large")
    from .executors.grouping import choose_group_size, save_group_scaling
    # a --quick large-model table (3 steps: mostly set-up and the final evaluation) is shown, not saved
    for m, table in (("base", scaling),) + ((("large", large),) if not quick else ()):
        log(f"  saved to {save_group_scaling(table, m)}; --group auto picks K={choose_group_size(10 ** 6, 1, table)} "
            f"for a large sweep of the {m} model")
    log(f"attention kernel: {_attention_label()}; the fused operator against the engine without it and the "
        "plain reference:")
    # --quick (a smoke run): the base model at K = 1 and 2, one thread
    engines = engine_table(ref_mod, quick=quick, log=log, **(dict(models=("base",), ks=(1, 2), thread_counts=(1,))
                                                              if quick else {}))
    log("every prior family's base step against the soft prior's (1 thread):")
    families = family_table(quick=quick, log=log)
    start = startup_seconds()
    log("start-up, fresh interpreter (median of 3): " + ", ".join(f"softprior {k} {v:.2f} s" for k, v in start.items()))
    return {"engines": engines, "attention_backend": engines["attention_backend"], "startup_s": start,
            "families": families,
            "group_scaling_ms": {str(k): v for k, v in scaling.items()},
            "group_scaling_large_ms": {str(k): v for k, v in large.items()},
            "gemm_gflops": round(gemm, 2), "model_gflop_per_step": round(flops / 1e9, 4),
            "single_ms_per_step": round(single, 3), "reference_ms_per_step": round(reference, 3),
            "group_ms_per_run_step": round(group, 3), "group_size": group_size,
            "mfu": round(mfu, 4), "reference_mfu": round(flops / (reference / 1e3) / (gemm * 1e9), 4),
            "speedup_single": round(reference / single, 3), "speedup_group": round(reference / group, 3),
            "threads": o_th, "reference_threads": r_th, **settings,
            "large_single_ms_per_step": round(large_single, 3), "large_reference_ms_per_step": round(large_ref, 3),
            "speedup_large": round(large_ref / large_single, 3), "large_threads": large_th,
            "by_threads": {str(th): {"single_ms": round(o, 3), "reference_ms": round(r, 3),
                                     "single_ms_samples": [round(x, 3) for x in samples[th][0]],
                                     "reference_ms_samples": [round(x, 3) for x in samples[th][1]]}
                           for th, (o, r) in med.items()}}


def _runs_step(cfgs):
    """One training step of ``loop.Runs`` over ``cfgs`` (K = len(cfgs) runs at once), as a callable."""
    from .training.loop import Runs
    runs = Runs(cfgs)
    return lambda: runs.step(0)


_ENGINES = {"fused": None, "attention": "attention", "torch": "0"}  # name: SOFTPRIOR_KERNELS within it


class _engine:
    """Within it, the fast path runs as engine ``name``: "fused" (both operators where they build: the
    whole step, ``kernels/step.py``, and the attention, ``kernels/attention.py``), "attention" (the
    attention operator alone: ``SOFTPRIOR_KERNELS=attention``) or "torch" (neither: ``SOFTPRIOR_KERNELS=0``,
    the engine before the fused operators)."""

    def __init__(self, name: str):
        self.value = _ENGINES[name]

    def __enter__(self):
        import os
        from .kernels import ENV
        self.old = os.environ.get(ENV)
        if self.value is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.value

    def __exit__(self, *exc):
        import os
        from .kernels import ENV
        os.environ.pop(ENV, None)
        if self.old is not None:
            os.environ[ENV] = self.old


def engine_table(ref_mod, models=("base", "large"), ks=(1, 8), thread_counts=(1, 2), quick: bool = False,
                 log=print) -> dict:
    """The fused engine (the whole-step operator where it applies, the attention operator elsewhere)
    against the attention operator alone, the engine without either (the pure-PyTorch path,
    ``fastpath._Attention``) and the plain reference (``softprior/reference.py`` at the same size), per
    model preset, thread count and K: ms per run-step of one training step (``loop.Runs.step`` over K
    associative-recall runs; the reference trains one run, and K sequential runs cost K times one), the
    four alternating so that machine noise hits all, medians of ``reps`` samples; and the fused step's
    fraction of the GEMM rate at that thread count (model FLOP per run-step, ``flops.train_step_flops``,
    over its time, over the faster of ``gemm_rate(threads)`` before and after the table)."""
    from .config import make_run_config
    from .kernels import attention_backend, step
    out: dict = {"attention_backend": attention_backend(), "step_operator": step.enabled(), "gemm_gflops_by_threads": {}}
    old = torch.get_num_threads()
    try:
        for th in thread_counts:
            out["gemm_gflops_by_threads"][str(th)] = round(gemm_rate(threads=th), 2)
        rows = []
        for model in models:
            cfg = make_run_config("assoc_recall", "unforced", 0, model=model)
            m, flops = cfg.model, train_step_flops(cfg)
            ref, _ = ref_mod.make_reference_step(d=m.d_model, H=m.n_heads, L=m.n_layers, batch=cfg.batch_size,
                                                 T=m.n_ctx, vocab=m.vocab)
            for th in thread_counts:
                torch.set_num_threads(th)
                gemm = out["gemm_gflops_by_threads"][str(th)]
                ref_ms = None
                for K in ks:
                    cfgs = [make_run_config("assoc_recall", "fade600" if k % 2 else "unforced", k, model=model)
                            for k in range(K)]
                    steps = {name: _runs_step(cfgs) for name in _ENGINES}
                    n = max(2, (4 if quick else 16) // K) if model == "base" else max(1, (2 if quick else 6) // K)
                    reps = 2 if quick else 5
                    samples: dict[str, list[float]] = {**{name: [] for name in _ENGINES}, "reference": []}
                    for rep in range(reps + 1):  # the first round warms up
                        for name in _ENGINES:
                            with _engine(name):
                                ms = _time(steps[name], n) / K
                            samples[name].append(ms)
                        if K == ks[0]:
                            samples["reference"].append(_time(ref, n))
                    med = {k: statistics.median(v[1:]) for k, v in samples.items() if v}
                    ref_ms = med.get("reference", ref_ms)
                    row = {"fused_ms": round(med["fused"], 3), "attention_ms": round(med["attention"], 3),
                           "torch_ms": round(med["torch"], 3), "reference_ms": round(ref_ms, 3),
                           "fused_vs_torch": round(med["torch"] / med["fused"], 3),
                           "fused_vs_attention": round(med["attention"] / med["fused"], 3),
                           "fused_vs_reference": round(ref_ms / med["fused"], 3),
                           "fused_gemm_fraction": round(flops / (med["fused"] / 1e3) / (gemm * 1e9), 4),
                           "torch_gemm_fraction": round(flops / (med["torch"] / 1e3) / (gemm * 1e9), 4)}
                    out.setdefault(model, {}).setdefault(str(th), {})[f"K{K}"] = row
                    rows.append((row, flops, th))
                    log(f"  {model}, {th} thread(s), K = {K}: fused {row['fused_ms']:.2f}, attention operator alone "
                        f"{row['attention_ms']:.2f}, without either {row['torch_ms']:.2f}, reference {row['reference_ms']:.2f} ms per run-step;  fused "
                        f"{row['fused_vs_torch']:.2f}x the engine without them, {row['fused_vs_reference']:.2f}x the "
                        f"reference, {row['fused_gemm_fraction']:.1%} of the GEMM rate read before ({gemm:.0f} GFLOP/s)")
        # the GEMM rate again after the table, the faster of the two kept (a busy moment reads low), and
        # the fractions taken against it
        for th in thread_counts:
            out["gemm_gflops_by_threads"][str(th)] = round(max(out["gemm_gflops_by_threads"][str(th)],
                                                               gemm_rate(threads=th)), 2)
        for row, flops, th in rows:
            gemm = out["gemm_gflops_by_threads"][str(th)] * 1e9
            for name in ("fused", "torch"):
                row[f"{name}_gemm_fraction"] = round(flops / (row[f"{name}_ms"] / 1e3) / gemm, 4)
        log(f"  GEMM rate, the faster of before and after: {out['gemm_gflops_by_threads']} GFLOP/s by threads")
    finally:
        torch.set_num_threads(old)
    return out


def family_table(quick: bool = False, threads: int = 1, log=print) -> dict:
    """Per registered prior family (``model.priors.PRIORS``), the base model's training step
    (``training.loop.Runs.step`` of one associative-recall run, unforced) at ``threads`` threads: ms per step, the
    engine that trains it (``fastpath.engine``, with why it is not the fastest) and the ratio to the soft
    prior's step, the soft prior and each family timed in turn so that machine noise hits both; medians
    of ``reps`` samples."""
    from .config import make_run_config
    from .model.fastpath import engine
    from .model.priors import PRIORS
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def step_of(family):
            cfg = make_run_config("assoc_recall", "unforced", 0,
                                  model_options={} if family == "soft" else {"prior_family": family})
            return cfg, _runs_step([cfg])
        soft_cfg, soft = step_of("soft")
        n, reps = (2, 2) if quick else (10, 5)
        out = {}
        for family in PRIORS:
            cfg, step = (soft_cfg, soft) if family == "soft" else step_of(family)
            samples = {"soft": [], family: []}
            for _ in range(reps + 1):  # the first round warms up
                samples["soft"].append(_time(soft, n))
                samples[family].append(_time(step, n))
            soft_ms, ms = (statistics.median(samples[k][1:]) for k in ("soft", family))
            kind, why = engine(cfg.model, True, cfg.model.n_ctx, 1)
            out[family] = {"ms": round(ms, 3), "soft_ms": round(soft_ms, 3), "vs_soft": round(ms / soft_ms, 3),
                           "engine": kind, "why": why}
            log(f"  prior {family}: {ms:.2f} ms per step, {ms / soft_ms:.2f}x the soft prior's {soft_ms:.2f} "
                f"({kind}{': ' + why if why else ''})")
    finally:
        torch.set_num_threads(old)
    return out


def startup_seconds(commands=("--help", "paths", "tasks", "experiments"), reps: int = 3) -> dict[str, float]:
    """Wall time of ``softprior COMMAND`` in a fresh interpreter (the median of ``reps``): the listings
    and --help import no torch, so they answer in a fraction of a second."""
    import statistics
    import subprocess
    import sys
    out = {}
    for c in commands:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import sys; from softprior.cli import main; sys.exit(main(sys.argv[1:]))", c],
                           capture_output=True, check=False)
            ts.append(time.perf_counter() - t)
        out[c] = round(statistics.median(ts), 3)
    return out


def _large_line(ref_mod, quick: bool, thread_counts, log) -> tuple[float, float, dict]:
    """The large preset (4 layers, d_model 128) against the plain reference built at the same size,
    alternating, each at its faster thread count: (ours ms/step, reference ms/step, threads of each)."""
    from .config import make_run_config
    cfg = make_run_config("assoc_recall", "unforced", 0, model="large")
    m = cfg.model
    ref, _ = ref_mod.make_reference_step(d=m.d_model, H=m.n_heads, L=m.n_layers, batch=cfg.batch_size, T=m.n_ctx,
                                         vocab=m.vocab)
    _, (ours, o_th), (ref_ms, r_th) = _at_best_threads(
        _alternate(_our_step(cfg), ref, 5 if quick else 20, 2 if quick else 5, thread_counts))
    log(f"single large run: {ours:.2f} ms/step at {o_th} thread(s);  plain reference at the large size: "
        f"{ref_ms:.2f} ms/step at {r_th} thread(s);  speed-up {ref_ms / ours:.2f}x")
    return ours, ref_ms, {"ours": o_th, "reference": r_th}


def _attention_label() -> str:
    from .kernels import attention_backend, build_error
    b = attention_backend()
    return (b + " (the attention and the whole-step operators)" if b == "fused-cpp"
            else f"{b} (the fused operators did not build: {build_error() or 'switched off'})")


# a process run as an AVX2 machine: the kernels built for x86-64-v3, ATen's kernels and MKL's restricted to AVX2
AVX2_ENV = {"SOFTPRIOR_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
_TWIN_ENV = "SOFTPRIOR_BENCH_TWIN"  # set in the twin's own process: it times its ISA alone


def twin_isas() -> list[str]:
    """The ISAs ``run_engines`` times beside the native one: AVX2 on an AVX-512 host (an AVX2 build runs
    there), so every figure has its AVX2 twin from one machine; none elsewhere, or inside a twin."""
    import os

    from .kernels.build import ISA_ENV, native_isa
    if os.environ.get(_TWIN_ENV) or os.environ.get(ISA_ENV, "native").strip().lower() not in ("", "native"):
        return []
    return ["avx2"] if native_isa() == "avx512" else []


def run_engines(quick: bool = False, log=print, twins: bool = True) -> dict:
    """Only ``engine_table`` (``softprior bench --engines-only``), after ``runtime.prepare_training()``;
    then the same table for each ISA of ``twin_isas()`` in a fresh process (``AVX2_ENV``: its kernels,
    ATen's and MKL's held to that ISA), under ``isas``. ``isa``: what the native table ran on."""
    import json
    import os
    import subprocess
    import sys

    from .kernels import isa
    from .training.runtime import prepare_training
    settings = prepare_training()
    log(f"attention kernel: {_attention_label()}")
    out = {**engine_table(_load_reference(), quick=quick, log=log), **settings, "isa": isa()}
    log("every prior family's base step against the soft prior's (1 thread):")
    out["families"] = family_table(quick=quick, log=log)
    for name in (twin_isas() if twins else []):
        log(f"the same table as an {name.upper()} machine (a fresh process: {AVX2_ENV})")
        cmd = [sys.executable, "-c", "import sys; from softprior.cli import main; sys.exit(main(sys.argv[1:]))",
               "bench", "--engines-only", "--json", *(["--quick"] if quick else [])]
        res = subprocess.run(cmd, env={**os.environ, **AVX2_ENV, _TWIN_ENV: "1"}, capture_output=True, text=True)
        for line in res.stderr.splitlines():
            log(f"  [{name}] {line}")
        if res.returncode != 0:
            out.setdefault("isas", {})[name] = {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        out.setdefault("isas", {})[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def _load_reference():
    """The plain reference model (``softprior.reference``: shipped in the package, so the bench runs from a
    wheel as from a checkout)."""
    from . import reference
    return reference
