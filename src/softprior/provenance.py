"""What produced a run: package version, git commit, torch, CPU, threads and the attention kernel
(docs/DESIGN.md, "Calibration").

Recorded in every run summary by the process that trains it (so a Ray worker records its own
machine), and read back by ``load_results`` and ``reports.experiment``, which warns when one table mixes code
versions. The calibration record a run was trained under is added by the sweep driver."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

__all__ = ["provenance", "code_version"]


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    import torch

    from . import __version__
    return {"softprior_version": __version__, "git_commit": _git_commit(), "torch_version": torch.__version__,
            "cpu": _cpu_model(), "python_version": platform.python_version()}


def provenance() -> dict:
    """``attention_backend``: the attention the fast path ran in this process, "fused-cpp" (the C++
    operator, ``kernels/attention.py``) or "torch" (its pure-PyTorch fallback); "unused" where this
    process has not run it (``kernels.attention_backend(build=False)``: recording it never builds).
    ``isa``: the vector instructions the kernels were built for and ATen dispatches to
    (``kernels.isa()``): the same code rounds differently on another ISA. Which engine trained a run
    (``engine``, ``step_operator``) is the run's own, recorded per run by ``loop.run_summary``: a
    process-wide flag said the operator ran for a run that fell back beside one that used it."""
    import torch

    from .kernels import attention_backend, isa
    return {**_static(), "threads": torch.get_num_threads(), "attention_backend": attention_backend(build=False),
            "isa": isa()}


def code_version(summary: dict) -> str:
    """The code that produced a summary, as one label (``version@commit``; '?' where unrecorded)."""
    return f"{summary.get('softprior_version', '?')}@{summary.get('git_commit') or '?'}"


def _git_commit() -> str | None:
    """HEAD of the checkout the package is imported from, '+dirty' if it has uncommitted changes to
    tracked files; None when it is not a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", str(here)], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
