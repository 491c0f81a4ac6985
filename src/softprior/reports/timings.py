"""``softprior report timings``: a store's time ledger (``RunStore.ledger``, the rows the sweeps write:
``executors.ledger``), or the one a results bundle carries, summed up (``ledger_summary``) and said
as text (``format_timings``): the paper's wall time, its FLOP, the floor at the GEMM rate, where the
time goes per kind of job, and the costliest jobs.
"""

from __future__ import annotations

import datetime

from ..flops import gemm_rate

__all__ = ["ledger_summary", "format_timings", "job_kind"]


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The wall time covered by (start, seconds) intervals: overlapping ones (concurrent jobs) count
    once, disjoint ones (pieces on different days) add; a lone interval counts its own seconds."""
    total, cluster = 0.0, None  # [start, end, seconds if alone else None]
    for start, sec in sorted(intervals):
        if cluster is not None and start < cluster[1]:
            cluster = [cluster[0], max(cluster[1], start + sec), None]
            continue
        if cluster is not None:
            total += cluster[2] if cluster[2] is not None else cluster[1] - cluster[0]
        cluster = [start, start + sec, sec]
    if cluster is not None:
        total += cluster[2] if cluster[2] is not None else cluster[1] - cluster[0]
    return total


def job_kind(row: dict) -> str:
    """A job's kind for ``ledger_summary``'s breakdown: its name's first word ("assoc_recall/large")."""
    return row["name"].split(" ", 1)[0]


def ledger_summary(rows: list[dict], code_version: str | None = None, rate: float | None = None,
                   top: int = 10, kind_of=job_kind) -> dict:
    """What ``softprior report timings`` prints, from a store's time ledger (``RunStore.ledger``).

    ``code_version``: count only the rows of that code (``provenance.code_version``; None: all).
    The paper's time (``wall_seconds``) is the wall time the counted rows cover: the union of every
    job's pieces, report and sweep, so pieces run on different days add up and jobs that ran at once
    (``--workers 2``) count once; ``job_seconds`` is their plain sum (worker-seconds). The floor is
    the FLOP trained at the GEMM rate ``rate`` (GFLOP/s; default: the fastest the ledger's sweeps
    measured, else ``gemm_rate()`` now), and ``ratio`` = wall_seconds / floor_seconds.

    ``kinds``: where the time goes, per kind of job (``kind_of(row)``; by default task/size): jobs, runs,
    worker-seconds and their share, FLOP, GFLOP/s per worker, and ``x_floor``, its worker-seconds
    against its FLOP at a worker's share of the GEMM rate (``rate`` / the sweep's workers).
    ``other_versions``: the code versions left out; ``busiest_version`` the one of them with the most
    job seconds (what to pass as ``code_version`` to read a ledger other code wrote)."""
    counted = [r for r in rows if code_version is None or r.get("code_version") == code_version]
    others = sorted({r.get("code_version") or "?" for r in rows
                     if code_version is not None and r.get("code_version") != code_version})
    busiest = max(others, key=lambda v: sum(r["seconds"] for r in rows if r["kind"] == "job"
                                            and (r.get("code_version") or "?") == v), default=None)
    jobs = [r for r in counted if r["kind"] == "job"]
    intervals = []
    for r in counted:
        pieces = r["detail"].get("pieces") if r["kind"] == "job" else None
        intervals += [(float(a), float(b)) for a, b in pieces] if pieces else [(r["started_at"], r["seconds"])]
    flop = sum(r["flop"] for r in jobs)
    if rate is not None:
        source = "given (--gemm-rate)"
    elif any(r.get("gemm_gflops") for r in counted):
        rate, source = max(r["gemm_gflops"] for r in counted if r.get("gemm_gflops")), \
            "the fastest the sweeps measured (recorded in the ledger)"
    elif flop > 0:
        rate, source = gemm_rate(), "measured now (the ledger records none)"
    else:
        source = "none needed (nothing trained)"
    wall = _union_seconds(intervals)
    floor = flop / (rate * 1e9) if rate else 0.0
    per_kind = {k: float(sum(r["seconds"] for r in counted if r["kind"] == k)) for k in ("job", "report", "sweep")}
    cells = [{"name": r["name"], "runs": r["runs"], "steps": r["detail"].get("steps"), "seconds": r["seconds"],
              "flop": r["flop"], "gflops": r["flop"] / r["seconds"] / 1e9 if r["seconds"] > 0 else None,
              "pieces": len(r["detail"].get("pieces") or [()]), "status": r["detail"].get("status", "ok"),
              "host": r["host"], "started_at": r["started_at"], "code_version": r.get("code_version")}
             for r in sorted(jobs, key=lambda r: r["seconds"], reverse=True)[:top]]
    kinds: dict[str, dict] = {}
    for r in jobs:
        k = kinds.setdefault(kind_of(r), {"jobs": 0, "runs": 0, "seconds": 0.0, "flop": 0.0, "floor_seconds": 0.0})
        k["jobs"] += 1
        k["runs"] += r["runs"]
        k["seconds"] += r["seconds"]
        k["flop"] += r["flop"]
        if rate:
            k["floor_seconds"] += r["flop"] / (rate * 1e9 / max(1, int(r["detail"].get("workers") or 1)))
    for k in kinds.values():
        k["share"] = k["seconds"] / per_kind["job"] if per_kind["job"] > 0 else None
        k["gflops"] = k["flop"] / k["seconds"] / 1e9 if k["seconds"] > 0 else None
        k["x_floor"] = k["seconds"] / k["floor_seconds"] if k["floor_seconds"] > 0 else None
    kinds = dict(sorted(kinds.items(), key=lambda kv: -kv[1]["seconds"]))
    return {"code_version": code_version or "all", "rows": len(counted), "rows_other_versions": len(rows) - len(counted),
            "other_versions": others, "busiest_version": busiest, "jobs": len(jobs),
            "reports": sum(r["kind"] == "report" for r in counted),
            "sweeps": sum(r["kind"] == "sweep" for r in counted), "runs": sum(r["runs"] for r in jobs),
            "run_steps": sum(r["detail"].get("steps") or 0 for r in jobs), "wall_seconds": wall,
            "job_seconds": per_kind["job"], "report_seconds": per_kind["report"], "sweep_seconds": per_kind["sweep"],
            "flop": flop, "gemm_gflops": rate, "gemm_source": source, "floor_seconds": floor,
            "ratio": wall / floor if floor > 0 else None, "costliest": cells, "kinds": kinds}


def _secs(x: float) -> str:
    """Seconds as '3.21 s', '95.0 s (1m35s)', '5012 s (1h23m32s)'."""
    text = f"{x:.3g} s" if x < 10 else f"{x:,.1f} s" if x < 1e4 else f"{x:,.0f} s"
    s = int(round(x))
    if s < 60:
        return text
    return text + (f" ({s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s)" if s >= 3600 else f" ({s // 60}m{s % 60:02d}s)")


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def format_timings(t: dict) -> str:
    """``ledger_summary``'s dict as the text of ``softprior report timings``."""
    if not t["rows"]:
        extra = (f"; {t['rows_other_versions']} rows of other code versions ({', '.join(t['other_versions'])}): "
                 f"--code-version counts one (the most job time: {t['busiest_version']}), --all-versions all"
                 ) if t["rows_other_versions"] else ""
        later = (f"; --until left out the {t['rows_after_until']} rows started after it"
                 if t.get("rows_after_until") else "")
        return f"the time ledger has no rows of code version {t['code_version']}{extra}{later}"
    head = (f"code version {t['code_version']}" + (f" ({t['rows_other_versions']} rows of other versions left out: "
                                                   "--all-versions counts them)" if t["rows_other_versions"] else ""))
    if t.get("until") is not None:
        when = datetime.datetime.fromtimestamp(t["until"], datetime.timezone.utc)
        head += f", rows started before {when.strftime('%Y-%m-%d %H:%M:%S')} UTC (--until)"
    ratio = f"{t['ratio']:.2f}x the floor" if t["ratio"] is not None else "no FLOP trained"
    lines = [f"time ledger, {head}",
             f"paper's time: {_secs(t['wall_seconds'])} wall, {ratio}: the time covered by {_n(t['jobs'], 'job')}, "
             f"{_n(t['reports'], 'report')} and {_n(t['sweeps'], 'sweep')} (pieces on different days add, jobs that "
             "ran at once count once)",
             f"  sums: jobs {_secs(t['job_seconds'])} ({t['runs']} runs, {t['run_steps']:,} run-steps; worker-seconds), "
             f"reports {_secs(t['report_seconds'])}, sweeps {_secs(t['sweep_seconds'])}",
             f"training: {t['flop'] / 1e12:.4g} TFLOP (flops.train_step_flops x steps)"]
    if t["gemm_gflops"]:
        lines.append(f"floor: {_secs(t['floor_seconds'])}: that FLOP at {t['gemm_gflops']:.1f} GFLOP/s, "
                     f"{t['gemm_source']}")
    if t.get("kinds"):
        lines += ["", "where the time goes (x floor: a kind's worker-seconds against its FLOP at one worker's share "
                  "of the GEMM rate):", "| kind | jobs | runs | worker-seconds | share | TFLOP | GFLOP/s per worker | "
                  "x floor |", "|---|---|---|---|---|---|---|---|"]
        for name, k in t["kinds"].items():
            lines.append(f"| {name} | {k['jobs']} | {k['runs']} | {k['seconds']:,.0f} | "
                         f"{'-' if k['share'] is None else format(k['share'], '.1%')} | {k['flop'] / 1e12:,.1f} | "
                         f"{'-' if k['gflops'] is None else format(k['gflops'], '.1f')} | "
                         f"{'-' if k['x_floor'] is None else format(k['x_floor'], '.2f')} |")
    if t["costliest"]:
        lines += ["", f"the {len(t['costliest'])} costliest jobs:", "| job | runs | run-steps | seconds | GFLOP | "
                  "GFLOP/s | pieces |", "|---|---|---|---|---|---|---|"]
        for c in t["costliest"]:
            name = c["name"] if len(c["name"]) <= 70 else c["name"][:67] + "..."
            rate = f"{c['gflops']:.1f}" if c["gflops"] is not None else "-"
            lines.append(f"| {name}{'' if c['status'] == 'ok' else ' (' + c['status'] + ')'} | {c['runs']} | "
                         f"{c['steps'] or 0:,} | {c['seconds']:.1f} | {c['flop'] / 1e9:,.1f} | {rate} | {c['pieces']} |")
    return "\n".join(lines)
