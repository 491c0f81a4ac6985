"""Reports of the mechanism experiments (mechanism traces and the continuation trace): tables,
verdict paragraphs and figures computed from a run store's snapshots. They sit beside the measures
they report (``softprior.analysis``) and take the store and cells as plain objects, so the
experiment registry can name them without an import cycle through ``softprior.reports.experiment``. The store
may be any source (``softprior.bundle``): what needs weights (a trace, a circuit) is asked through
``bundle.ask``, which a results bundle answers from the files it recorded."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..bundle import ask, ask_many
from .continuation.core import MAX_ITER, REL_DAMPING, TOL

if TYPE_CHECKING:  # type names only (the cells live below the experiment registry, which imports this module)
    from ..cells import Cell
    from ..store import RunStore

__all__ = ["mechanism_report", "continuation_report", "spearman"]


def mechanism_report(store: RunStore, cells: list[Cell], out: Path, mass_threshold: float = 0.25,
                     ablation_threshold: float = 0.03) -> str:
    """Per seed: trace successor-value mass and zero-gate ablation importance from stored snapshots,
    summarise, and draw heatmaps (step x layer.head) with the fade window marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .mechanism import summarise_trace, trace, trace_matrix
    from ..schedules import Fade
    done = [c for c in cells if store.is_done(c.cfg.run_id)]
    if not done:
        return ""
    lines = ["| seed | top successor head (final mass) | first step mass ≥ %.2f | top ablation head (final drop) "
             "| first step ablation ≥ %.2f + 2 SE |"
             % (mass_threshold, ablation_threshold), "|---|---|---|---|---|"]
    fig, axes = plt.subplots(len(done), 2, figsize=(9, 2.6 * len(done)), squeeze=False)
    for i, c in enumerate(done):
        df = ask(store, "mechanism_trace", {"run": c.cfg.run_id},
                 lambda c=c: trace(store.load_snapshots(c.cfg.run_id), c.cfg), frame=True)
        df.to_csv(out / f"trace_seed{c.cfg.seed}.csv", index=False, float_format="%.6g")
        s = summarise_trace(df, mass_threshold, ablation_threshold, n_examples=c.cfg.n_val)
        def head(h):
            return f"L{h[0]}H{h[1]}" if h is not None else "–"

        def step(v):
            return "never" if v is None else str(v)
        lines.append(f"| {c.cfg.seed} | {head(s['top_successor_head'])} ({s['top_successor_mass']:.2f}) | "
                     f"{step(s['successor_first_step'])} | {head(s['top_ablation_head'])} "
                     f"({s['top_ablation_importance']:.3f}) | {step(s['ablation_first_step'])} |")
        sched = c.cfg.path.pos.schedule
        for j, col in enumerate(("successor_mass", "ablation_importance")):
            mat = trace_matrix(df, col)
            ax = axes[i, j]
            im = ax.imshow(mat.T.values, aspect="auto", cmap="viridis", origin="lower",
                           extent=(mat.index.min(), mat.index.max(), -0.5, mat.shape[1] - 0.5))
            ax.set_yticks(range(mat.shape[1]), list(mat.columns), fontsize=6)
            if isinstance(sched, Fade):
                for x in (sched.start_step, sched.end_step):
                    ax.axvline(x, color="white", ls="--", lw=1)
            ax.set_title(f"seed {c.cfg.seed}: {col}", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.04)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "heatmaps.png", dpi=100)
    plt.close(fig)
    return "\n".join(lines) + ("\n\nAn ablation drop counts above noise: the threshold plus two standard errors of the "
                               "accuracy it drops from, sqrt(p (1 - p) / n) on the n traced examples. "
                               "Heatmaps: heatmaps.png (dashed lines: fade window).\n")


# ------------------------------------------------------------------------------------ continuation trace
def _ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0
        i = j + 1
    return r


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (Pearson's r of the average ranks; Spearman 1904). NaN for < 3
    points or a constant series."""
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3:
        return float("nan")
    rx, ry = _ranks([p[0] for p in pairs]), _ranks([p[1] for p in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def _mean_std(vals) -> tuple[float, float]:
    v = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    return m, (math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0)


def _ms(vals, digits=3) -> str:
    m, s = _mean_std(vals)
    return "–" if not math.isfinite(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def continuation_report(store: RunStore, cells: list[Cell], out: Path, n_examples: int = 256,
                        max_iter: int = MAX_ITER, damping: float | None = None, method: str = "cg",
                        threshold: float = 0.03, threads: int | None = 1, workers: int = 1, tol: float = TOL,
                        curvature: str = "ggn", rel_damping: float = REL_DAMPING) -> str:
    """The paper's continuation quantities (``softprior.analysis.continuation``) over every stored
    snapshot of each finished run, a summary table, a verdict paragraph and a figure.

    The circuit C of a (task, model, seed) is the heads of ``circuit_heads`` (zero-gate ablation
    importance >= ``threshold``) at the final weights of the fade600->0 run of that task, model and
    seed (the path that forms a zero-gate circuit in the paper), or of the run itself when there is no
    such run; every path of that seed is measured on the same C (the same seed: the same
    initialisation). Writes ``continuation_<task>_<path>_seed<s>.csv`` per run and
    ``continuation.png`` (per task and path, means over seeds: recovery share, its two controls,
    tracking and solution cosines against the step, the gate on a second axis).

    The tangents (``continuation.model.optimum_tangent``): the ``curvature`` ("ggn": damped Gauss-Newton),
    damped by ``rel_damping`` x each snapshot's curvature scale (or by ``damping`` when given), solved by
    ``method`` to the relative residual ``tol`` in at most ``max_iter`` products.
    A tracking cosine is a claim's number only where every tangent behind it converged: otherwise the
    claims table leaves it empty and records the converged fraction, and the verdict says
    "inconclusive" (``continuation_claims_table``, ``_continuation_verdict``).

    ``threads``: torch threads for the measurements (restored after; None leaves them). One, like a
    sweep's workers: on a loaded machine two threads made a tangent snapshot many times slower than one
    (docs/PERFORMANCE.md, section 4, "Continuation traces on both cores").
    ``workers`` > 1: spawned processes (one thread each) that measure the traces not yet in the store's
    cache, snapshot by snapshot (``continuation.traces.continuation_traces``; the same numbers). A script that
    asks for them needs the ``if __name__ == "__main__":`` guard that spawning processes needs; the
    experiments' analysis (``reproduce``) takes one per core."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _continuation_report(store, cells, out, n_examples, max_iter, damping, method, threshold, workers,
                                    tol, curvature, rel_damping)
    finally:
        torch.set_num_threads(old_threads)


# the modules whose code decides a continuation trace's numbers: a change to any of them recomputes it
_TRACE_SOURCES = ("analysis/continuation/core.py", "analysis/continuation/model.py", "analysis/continuation/traces.py",
                  "analysis/mechanism.py", "model/transformer.py", "tasks/generators.py")


def _cached_traces(store, jobs: list[tuple], workers: int = 1) -> list:
    """``continuation.traces.continuation_trace`` of stored runs (``jobs``: (cfg, heads, settings) each), cached
    in ``STORE/analysis_cache/`` (one CSV per run, written atomically by the store's own writer) under a
    key of the run and its files' checksums, the circuit, the settings, torch's version and the source
    of ``_TRACE_SOURCES``: a second report of the same store reads the numbers back exactly (round-trip
    floats) instead of recomputing them (docs/PERFORMANCE.md, section 4: a snapshot's cost). The runs it must compute are
    measured together (``continuation.traces.continuation_traces``: with ``workers`` > 1, every snapshot one task
    of a process pool). The ``seconds`` column keeps the time the measurement took when it was made."""
    from .continuation.traces import continuation_traces
    files = [_trace_file(store, cfg, heads, kw) for cfg, heads, kw in jobs]
    out = [_read_trace(f) for f in files]
    todo = [k for k, df in enumerate(out) if df is None]

    def spec(k):
        cfg, heads, kw = jobs[k]
        return dict(snapshots=store.load_snapshots(cfg.run_id), cfg=cfg, circuit=heads, **kw)

    def keep(k, df):  # cached as soon as it is complete: an interrupted report keeps what it finished
        if not df.empty:  # through the store (skipped where it cannot be written)
            store.write_cache(files[k].name, df.to_csv(index=False).encode())
        out[k] = df
    if workers <= 1:  # one run's snapshots in memory at a time
        for k in todo:
            continuation_traces([spec(k)], on_trace=lambda _, df, k=k: keep(k, df))
    elif todo:
        continuation_traces([spec(k) for k in todo], workers=workers, on_trace=lambda j, df: keep(todo[j], df))
    return out


def _trace_file(store, cfg, heads, kw) -> Path:
    import hashlib
    import json
    root = Path(__file__).resolve().parents[1]
    # the run's files as recorded when it was saved (their SHA-256): a retrained run (another engine,
    # ``store verify --repair``) keeps its run id but not its weights, so it misses the cache
    h = hashlib.sha256(json.dumps({"run": cfg.run_id, "heads": [list(map(int, x)) for x in heads], **kw,
                                   "torch": torch.__version__, "files": store.file_checksums(cfg.run_id)},
                                  sort_keys=True).encode())
    for name in _TRACE_SOURCES:
        h.update((root / name).read_bytes())
    return Path(store.root) / "analysis_cache" / f"continuation_{cfg.run_id[:16]}_{h.hexdigest()[:16]}.csv"


def _read_trace(f: Path):
    """A cached trace, or None (absent or unreadable: computed again)."""
    import pandas as pd
    if not f.exists():
        return None
    try:
        # pandas >= 3 parses floats round-trip by default (and deprecates asking for it)
        exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
        return pd.read_csv(f, **exact)
    except (OSError, ValueError, pd.errors.ParserError):
        return None


def _continuation_report(store, cells, out, n_examples, max_iter, damping, method, threshold, workers,
                         tol=TOL, curvature="ggn", rel_damping=REL_DAMPING) -> str:
    """``continuation_report``'s work: the circuits (``_circuits``), the traces (``_continuation_frames``),
    their values at removal (``_removal_rows``), the text (``_continuation_text``), claims.csv and the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in cells if store.is_done(c.cfg.run_id)]
    if not done:
        return ""
    circuits = _circuits(store, done, n_examples, threshold)
    settings = dict(n_examples=n_examples, damping=damping, max_iter=max_iter, method=method, tol=tol,
                    curvature=curvature, rel_damping=rel_damping)
    all_ = _continuation_frames(store, done, circuits, settings, out, workers)
    if all_ is None:
        return ""
    rows = _removal_rows(all_)
    lines = _continuation_text(rows, circuits, all_, threshold, **settings)
    continuation_claims_table(rows).to_csv(out / "claims.csv", index=False, float_format="%.6g")
    _plot_continuation(all_, out / "continuation.png", plt)
    lines += ["", "Figure: continuation.png (per task and path, means over seeds; gate g_pos dashed, right axis)."]
    return "\n".join(lines) + "\n"


def _trace_key(c) -> tuple:
    """The runs that share one circuit: same task, width and seed."""
    return (c.cfg.task.name, c.cfg.model.d_model, c.cfg.seed)


def _circuits(store, done, n_examples: int, threshold: float) -> dict[tuple, tuple[list, str]]:
    """(task, d_model, seed) -> (circuit heads, the row they were read from): ``circuit_heads`` at the
    final weights of that seed's fade600 run (any run of it where there is none), asked of the source."""
    from .continuation.model import circuit_heads
    from ..tasks.generators import make_task
    circuits: dict[tuple, tuple[list, str]] = {}
    for c in done:
        if _trace_key(c) in circuits:
            continue
        refs = [r for r in done if _trace_key(r) == _trace_key(c) and r.cfg.path.name.startswith("fade600")]
        ref = refs[0] if refs else c

        def heads(ref=ref):
            _, model = store.load_model(ref.cfg.run_id)
            task = make_task(ref.cfg.task)
            return circuit_heads(model, task, ref.cfg.validation_batch(task, n=n_examples), threshold)
        circuits[_trace_key(c)] = (ask(store, "circuit", {"run": ref.cfg.run_id, "n_examples": n_examples,
                                                          "threshold": threshold}, heads,
                                       encode=lambda hs: [list(map(int, h)) for h in hs],
                                       decode=lambda hs: [tuple(h) for h in hs]), ref.row)
    return circuits


def _step_offset(c) -> int:
    """A derived run's steps start after its parent's."""
    parent = c.cfg.parent()
    return parent.total_steps if parent is not None else 0


def _continuation_frames(store, done, circuits, settings: dict, out, workers: int):
    """Every run's continuation trace (``_cached_traces``, asked of the source), each written to
    ``out/continuation_COL_ROW_seedS.csv``, concatenated with the run's labels, removal step and final
    zero-gate metric; None if no run has one."""
    import pandas as pd

    from .continuation.traces import removal_step
    jobs = [(c.cfg, circuits[_trace_key(c)][0], dict(settings, step_offset=_step_offset(c))) for c in done]
    keys = [{"run": cfg.run_id, "heads": [list(map(int, h)) for h in heads], **kw} for cfg, heads, kw in jobs]
    traces = ask_many(store, "continuation_trace", keys, lambda: _cached_traces(store, jobs, workers), frame=True)
    frames = []
    for c, df in zip(done, traces):
        if df.empty:
            continue
        df.to_csv(out / f"continuation_{c.col or c.cfg.task.name}_{c.row}_seed{c.cfg.seed}.csv".replace("/", "_"),
                  index=False, float_format="%.6g")
        summary = store.summary(c.cfg.run_id)
        df = df.assign(task=c.cfg.task.name, col=c.col or c.cfg.task.name, row=c.row, seed=c.cfg.seed,
                       model=c.cfg.model.d_model,
                       removal=_step_offset(c) + removal_step(c.cfg.path, c.cfg.total_steps),
                       zero_metric=summary[f"zero_{summary['metric']}"], metric=summary["metric"])
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else None


def _removal_rows(all_) -> list[dict]:
    """Per (task column, path): the values at removal (the last snapshot before it) and the tangents'
    statistics, over seeds."""
    rows = []
    for (col, row), g in all_.groupby(["col", "row"], sort=False):
        at, track, res, tsec, conv, dcos = [], [], [], [], [], []
        for _, run in g.groupby("seed"):
            run = run.sort_values("step")
            before = run[run["step"] <= run["removal"].iloc[0]]
            at.append((before if len(before) else run).iloc[-1])
            moving = run[run["tracking_cos"].notna()]
            track.append(float(moving["tracking_cos"].mean()) if len(moving) else float("nan"))
            res += list(moving["rel_residual"])
            tsec += list(moving["seconds"])
            conv += [bool(x) for x in moving["converged"]] if "converged" in moving else [False] * len(moving)
            dcos += list(moving["damping_cos"]) if "damping_cos" in moving else []
        rows.append({"col": col, "row": row, "n": len(at), "metric": g["metric"].iloc[0],
                     "removal_step": int(at[0]["step"]),
                     "share": [float(r["share"]) for r in at], "control": [float(r["control_share"]) for r in at],
                     "other": [float(r["other_heads_share"]) for r in at],
                     "solution_cos": [float(r["solution_cos"]) for r in at], "tracking": track,
                     "rel_residual": res, "seconds": tsec, "converged": conv, "damping_cos": dcos,
                     "zero": [float(v) for v in g.groupby("seed")["zero_metric"].first()]})
    return rows


def _continuation_text(rows, circuits, all_, threshold, *, n_examples, damping, max_iter, method, tol, curvature,
                       rel_damping) -> list[str]:
    """The report's lines: what is measured, the table of ``rows``, the circuits, the cost, the verdict."""
    lines = ["Continuation quantities (paper Section 3.3; `softprior.analysis.continuation`), at the last snapshot "
             "before the path removes the prior (fade S: S; hard switch at s: before s; forced_zero: init; posthoc: "
             "the unforced end; unforced: its end), mean ± std over seeds. share = ‖P_C ∇L(θ, 0)‖ / ‖∇L(θ, 0)‖ "
             "on the circuit's Q/K/V/O; controls: random coordinates of the same dimension, and as many heads "
             "outside the circuit. solution cos = cos(−∇L(θ, 0), θ_final − θ). tracking cos = cos(tangent × Δg, Δθ) "
             "between snapshots, averaged over the intervals where the gate changes (– where it never does); the "
             f"tangent solves ({'G' if curvature == 'ggn' else 'H'} + λI) t = −A_g, "
             f"{'G the Gauss-Newton matrix' if curvature == 'ggn' else 'H the Hessian'}, "
             + (f"λ = {damping:g}" if damping is not None else
                f"λ = {rel_damping:g} × the snapshot's largest curvature on the Krylov space of A_g") + ", by "
             f"{method.upper()} to a relative residual ≤ {tol:g} in ≤ {max_iter} products (docs/CONTINUATION.md); "
             "converged = tangents that met it; damping cos = cos(t(λ), t(10λ)).", "",
             "| task | path | removal step | share | random control | other heads | solution cos | tracking cos "
             f"| {method.upper()} rel. residual (median) | tangents converged | damping cos (median) "
             "| final zero-gate metric |", "|" + "---|" * 12]
    for r in rows:
        med = sorted(x for x in r["rel_residual"] if math.isfinite(x))
        dmed = sorted(x for x in r["damping_cos"] if math.isfinite(x))
        cells_ = [r["col"], r["row"], str(r["removal_step"]), _ms(r["share"]), _ms(r["control"]), _ms(r["other"]),
                  _ms(r["solution_cos"]), _ms(r["tracking"]), f"{med[len(med) // 2]:.2g}" if med else "–",
                  f"{sum(r['converged'])} of {len(r['converged'])}" if r["converged"] else "–",
                  f"{dmed[len(dmed) // 2]:.3f}" if dmed else "–", _ms(r["zero"])]
        lines.append("| " + " | ".join(cells_) + " |")
    circ = sorted({(k[0], k[1], k[2], ", ".join(f"L{l}H{h}" for l, h in v[0]), v[1]) for k, v in circuits.items()})
    lines += ["", "Circuit heads C (zero-gate mean-ablation importance ≥ %.2f at the final weights of the run named):"
              % threshold, ""]
    lines += [f"- {t} (d_model {d}), seed {s}: {h} (from {src})" for t, d, s, h, src in circ]
    secs = [x for r in rows for x in r["seconds"]]
    if secs:
        lines += ["", f"Cost: {sum(secs) / len(secs):.2f} s per snapshot with a tangent ({len(secs)} snapshots; "
                  f"{n_examples} examples, ≤ {max_iter} curvature-vector products), "
                  f"{float(all_[all_['tracking_cos'].isna()]['seconds'].mean()):.2f} s without."]
    lines += ["", _continuation_verdict(rows)]
    return lines


def continuation_claims_table(rows: list[dict]):
    """The continuation quantities the paper's claims read (``claims.CLAIMS``), as (row, column, mean,
    std) like an experiment's table.csv: per path, "<task> share", "<task> solution cos", "<task>
    tracking cos" (at removal, over seeds); per accuracy task, row "all paths", column "<task>
    spearman(share, zero)": the rank correlation between the circuit share at removal and the final
    zero-gate accuracy over the paths.

    Where a row carries its tangents' ``converged`` flags: per path, "<task> tangents converged", the
    fraction of the path's tangents (all seeds) that met the tolerance (empty without a tangent), and
    "<task> tracking cos" is left empty (not measured) unless that fraction is 1: a cosine computed
    from an unconverged tangent is no evidence either way, so a claim reading it is inconclusive."""
    import pandas as pd
    out = []
    for r in rows:
        conv = r.get("converged")
        for key, col in (("share", "share"), ("solution_cos", "solution cos"), ("tracking", "tracking cos")):
            m, s = _mean_std(r[key])
            if key == "tracking" and conv is not None and not all(conv):  # no evidence: empty
                m = s = float("nan")
            vals = [x for x in r[key] if isinstance(x, (int, float)) and math.isfinite(x) and math.isfinite(m)]
            out.append({"row": r["row"], "column": f"{r['col']} {col}", "mean": m, "std": s, "n": len(vals),
                        "values": ";".join(f"{x:.6g}" for x in vals)})
        if conv is not None:
            out.append({"row": r["row"], "column": f"{r['col']} tangents converged",
                        "mean": sum(map(bool, conv)) / len(conv) if conv else float("nan"), "std": 0.0,
                        "n": len(conv), "values": ""})
    for col in dict.fromkeys(r["col"] for r in rows if r["metric"] == "acc"):
        rs = [r for r in rows if r["col"] == col]
        rho = spearman([_mean_std(r["share"])[0] for r in rs], [_mean_std(r["zero"])[0] for r in rs])
        # one statistic over the paths, not a mean over seeds: no seed values, no interval (paper.py)
        out.append({"row": "all paths", "column": f"{col} spearman(share, zero)", "mean": rho, "std": 0.0,
                    "n": 1, "values": ""})
    return pd.DataFrame(out, columns=["row", "column", "mean", "std", "n", "values"])


def _continuation_verdict(rows: list[dict]) -> str:
    """The two questions of the issue, answered from the table's numbers (generated, not written)."""
    def mean(v):
        return _mean_std(v)[0]
    out = ["**Verdict (generated from the table above).**"]
    acc_cols = list(dict.fromkeys(r["col"] for r in rows if r["metric"] == "acc"))
    for col in acc_cols:
        rs = [r for r in rows if r["col"] == col]
        sh, z = [mean(r["share"]) for r in rs], [mean(r["zero"]) for r in rs]
        rho = spearman(sh, z)
        if not math.isfinite(rho):
            out.append(f"{col}: Spearman ρ undefined over {len(rs)} paths (it needs two paths with a recovery share, "
                       "and a spread in both the share and the final zero-gate accuracy).")
            continue
        order = sorted(rs, key=lambda r: -mean(r["share"]))
        ans = "yes" if rho >= 0.5 else ("no, the opposite" if rho <= -0.5 else "not clearly")
        above = sum(mean(r["share"]) > mean(r["control"]) for r in rs)
        out.append(f"{col}: is the recovery signal at removal larger on the paths whose zero-gate circuit later forms? "
                   f"**{ans}** (Spearman ρ = {rho:.2f} between the circuit share at removal and the final zero-gate "
                   f"accuracy over {len(rs)} paths; by share: "
                   + ", ".join(f"{r['row']} {mean(r['share']):.3f} (zero acc {mean(r['zero']):.3f})" for r in order)
                   + f"). The circuit's share exceeds the random-coordinate control on {above} of {len(rs)} paths.")
        tr = {r["row"]: r for r in rs if math.isfinite(mean(r["tracking"]))}
        fade = [r for k, r in tr.items() if k.startswith("fade")]
        hard = [r for k, r in tr.items() if k.startswith("hard_switch")]
        if fade and hard:
            f, h = mean(fade[0]["tracking"]), mean(hard[0]["tracking"])
            conv = [bool(x) for r in (fade[0], hard[0]) for x in r.get("converged", [])]
            bad = conv.count(False)
            ans = (f"**inconclusive**: {bad} of {len(conv)} tangents did not converge to the solver's tolerance"
                   if bad else f"**{'yes' if f > h else 'no'}**")
            out.append(f"Tracking: mean cosine between the optimum's tangent and the actual change over the gate's "
                       f"move: fade {f:.3f}, hard switch {h:.3f} (a fade tracks the optimum more closely: {ans}).")
    fz = {r["col"]: r for r in rows if r["row"] == "forced_zero"}
    lin = [r for c, r in fz.items() if r["metric"] == "mse"]
    ref = [r for c, r in fz.items() if r["metric"] == "acc"]
    if lin:
        x = mean(lin[0]["solution_cos"])
        msg = (f"{lin[0]['col']}: forced_zero's zero-gate gradient at initialisation has cosine {x:.3f} with the "
               f"displacement to its final solution (share on its circuit {mean(lin[0]['share']):.3f}, control "
               f"{mean(lin[0]['control']):.3f})")
        if ref:
            y = mean(ref[0]["solution_cos"])
            msg += (f"; in {ref[0]['col']} it is {y:.3f}. Already better aligned with its solution than in discrete "
                    f"retrieval: **{'yes' if x > y else 'no'}**.")
        out.append(msg + ("" if ref else "."))
    return " ".join(out) if len(out) > 1 else ""


def _plot_continuation(df, path: Path, plt) -> None:
    panels = list(dict.fromkeys(zip(df["col"], df["row"])))
    cols = list(dict.fromkeys(df["col"]))
    ncols = max(sum(1 for c, _ in panels if c == col) for col in cols)
    fig, axes = plt.subplots(len(cols), ncols, figsize=(3.6 * ncols, 2.9 * len(cols)), squeeze=False)
    used = set()
    for i, col in enumerate(cols):
        for j, (_, row) in enumerate(p for p in panels if p[0] == col):
            ax = axes[i, j]
            used.add((i, j))
            g = df[(df["col"] == col) & (df["row"] == row)]
            m = g.groupby("step").mean(numeric_only=True).sort_index()
            x = m.index.values
            ax.plot(x, m["share"], color="tab:blue", marker=".", label="circuit share")
            ax.plot(x, m["control_share"], color="tab:blue", ls=":", label="random coordinates")
            if m["other_heads_share"].notna().any():
                ax.plot(x, m["other_heads_share"], color="tab:cyan", ls="-.", label="other heads")
            ax.plot(x, m["solution_cos"], color="tab:green", ls="--", label="solution cos")
            tc = m["tracking_cos"]
            if tc.notna().any():
                ax.plot(x[tc.notna().values], tc.dropna(), color="tab:red", marker="o", ls="-", label="tracking cos")
            ax.axhline(0, color="gray", lw=0.5)
            ax.set_ylim(-1.02, 1.02)
            ax2 = ax.twinx()
            ax2.plot(x, m["g_pos"], color="black", ls="--", lw=1)
            ax2.set_ylim(-0.02, 1.02)
            ax2.set_ylabel("gate", fontsize=7)
            ax.set_title(f"{col}: {row} (n={g['seed'].nunique()})", fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.tick_params(labelsize=7)
            ax2.tick_params(labelsize=7)
    for i in range(len(cols)):
        for j in range(ncols):
            if (i, j) not in used:
                axes[i, j].axis("off")
    legend = [("circuit share", dict(color="tab:blue", marker=".")), ("random coordinates", dict(color="tab:blue", ls=":")),
              ("other heads", dict(color="tab:cyan", ls="-.")), ("solution cos", dict(color="tab:green", ls="--")),
              ("tracking cos", dict(color="tab:red", marker="o")), ("g_pos (right axis)", dict(color="black", ls="--"))]
    fig.legend([plt.Line2D([], [], **kw) for _, kw in legend], [n for n, _ in legend], loc="lower center", ncol=6,
               fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.subplots_adjust(wspace=0.5)
    fig.savefig(path, dpi=100)
    plt.close(fig)
