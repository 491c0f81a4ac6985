"""runtime: the tuned allocator keeps freed memory in the process (steps stop faulting pages in)."""

import os
import subprocess
import sys

import pytest

from softprior.training import runtime

_PROBE = r"""
import resource, torch
torch.set_num_threads(1)
from softprior.config import make_run_config
from softprior.bench import _our_step
from softprior.training.runtime import tune_allocator
applied = tune_allocator()
step = _our_step(make_run_config("assoc_recall", "unforced", 0))
for _ in range(20):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    step()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 30)
"""


def _faults_per_step(tune: str) -> tuple[bool, float]:
    # the engine without the whole-step operator (SOFTPRIOR_KERNELS=attention), as every model that
    # operator does not compute trains: its few large buffers fault no pages either way (measured 0.2-0.5
    # a step, tuned or not), while the autograd graph's many tensors fault ~1,000 a step untuned
    env = {**os.environ, "SOFTPRIOR_TUNE_MALLOC": tune, "SOFTPRIOR_KERNELS": "attention"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()[-2:]
    return applied == "True", float(faults)


def test_tune_allocator_is_idempotent():
    assert runtime.tune_allocator() == runtime.tune_allocator()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_removes_page_faults_per_step():
    applied, tuned = _faults_per_step("1")
    if not applied:
        pytest.skip("mallopt not available (not glibc)")
    off_applied, untuned = _faults_per_step("0")
    assert not off_applied  # the switch turns it off
    assert tuned < untuned / 10, (tuned, untuned)
