"""The time ledger: each job returns its wall time (``JobResult.timing``; a resumed job's earlier pieces
ride in its checkpoint's metadata), and the driver appends a row per job, with the FLOP it trained
(``flops.train_step_flops`` x steps), and one per sweep to the store's ledger (``RunStore.record_timing``;
``softprior report timings`` reads it). Timing only: no run's numbers change.
"""

from __future__ import annotations

import os
import sys

from ..config import RunConfig
from ..store.errors import StoreError
from .job import JobResult


def _ledger_gemm_rate() -> float | None:
    """The GEMM rate (GFLOP/s) a sweep records in the ledger beside its jobs: ``$SOFTPRIOR_GEMM_GFLOPS``
    if set, else ``flops.gemm_rate()`` measured once per process, before the sweep's workers start."""
    global _GEMM_RATE
    env = os.environ.get("SOFTPRIOR_GEMM_GFLOPS")
    if env:
        return float(env)
    if _GEMM_RATE is None:
        from ..flops import gemm_rate
        _GEMM_RATE = gemm_rate()
    return _GEMM_RATE


_GEMM_RATE: float | None = None


class _Ledger:
    """Writes a sweep's rows to the store's time ledger (``RunStore.record_timing``), from the driver
    alone: each job's wall time (``JobResult.timing``, measured where it ran), the FLOP it trained
    (``flops.train_step_flops`` x the steps its pieces trained, over the runs that finished), the code
    version (``provenance.code_version``) and the sweep's GEMM rate. Timing only: a row that cannot be
    written is reported on stderr, and the sweep goes on."""

    def __init__(self, store, executor: str, workers: int, gemm: float | None):
        self.store, self.executor, self.workers, self.gemm, self.jobs = store, executor, workers, gemm, 0
        self._version = None

    def version(self, summary: dict | None = None) -> str:
        from ..provenance import code_version, provenance
        if summary and "softprior_version" in summary:
            return code_version(summary)
        if self._version is None:
            self._version = code_version(provenance())
        return self._version

    def job(self, cfgs: list[RunConfig], job: JobResult) -> None:
        if job.timing is None:  # a worker that crashed (or an older worker) returned no timing
            return
        from ..flops import train_step_flops
        from ..model.config import size_label
        t = job.timing
        steps = {c.run_id: c.total_steps - t["from_step"] for c in cfgs}
        ok = [c for c, (res, _) in zip(cfgs, job.outs) if res is not None]
        flop = sum(train_step_flops(c) * steps[c.run_id] for c in ok)
        status = "engine_error" if job.engine_error is not None else "ok" if len(ok) == len(cfgs) else "failed"
        c0 = cfgs[0]
        name = f"{c0.task.name}/{size_label(c0.model)} " + (f"{c0.path.name} s{c0.seed}" if len(cfgs) == 1 else
                                                          f"x{len(cfgs)}: " + ", ".join(f"{c.path.name} s{c.seed}" for c in cfgs))
        summary = next((res.summary for res, _ in job.outs if res is not None), None)
        self.jobs += 1
        self.write("job", name, sum(sec for _, sec in t["pieces"]), flop, len(ok), t["pieces"][0][0], t.get("host"),
                   self.version(summary), {"run_ids": [c.run_id for c in cfgs], "pieces": t["pieces"],
                                           "steps": sum(steps[c.run_id] for c in ok), "from_step": t["from_step"],
                                           "status": status, "threads": t.get("threads"), "executor": self.executor,
                                           "workers": self.workers})

    def write(self, kind: str, name: str, seconds: float, flop: float = 0.0, runs: int = 0,
              started_at: float | None = None, host: str | None = None, version: str | None = None,
              detail: dict | None = None) -> None:
        try:
            self.store.record_timing(kind, name, seconds, flop, runs, started_at, host, version or self.version(),
                                     self.gemm, detail)
        except StoreError as e:
            print(f"softprior: the time ledger could not record {kind} {name!r}: {e}", file=sys.stderr)
