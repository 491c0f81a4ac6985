"""runtime: the tuned allocator keeps freed memory in the process (steps stop faulting pages in);
flush_denormals reaches every OpenMP thread and leaves a run's numbers unchanged."""

import os
import subprocess
import sys

import pytest

from softprior import runtime

_PROBE = r"""
import resource, torch
torch.set_num_threads(1)
from softprior.config import make_run_config
from softprior.bench import _our_step
from softprior.runtime import tune_allocator
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
    env = {**os.environ, "SOFTPRIOR_TUNE_MALLOC": tune}
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


_DENORMALS = r"""
import sys, torch
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-20)
(x * 2).sum()  # start the OpenMP pool first, so its threads cannot inherit the setting
def survivors():
    return int(((x * 1e-20) != 0).sum())  # 1e-40 is denormal: 0 where flushed
if not torch.set_flush_denormal(True):
    print("unsupported"); sys.exit()
main_only = survivors()
from softprior.runtime import flush_denormals
print(main_only, flush_denormals(), survivors())
"""


def _denormal_probe(flag: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["SOFTPRIOR_FLUSH_DENORMALS"] = flag
    out = subprocess.run([sys.executable, "-c", _DENORMALS], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_flush_denormals_reaches_every_openmp_thread():
    res = _denormal_probe("1")
    if res == ["unsupported"]:
        pytest.skip("no flush-to-zero on this CPU")
    main_only, applied, after = int(res[0]), res[1], int(res[2])
    # torch.set_flush_denormal alone sets the calling thread only: the worker's half of the
    # elementwise product stays denormal. (If it did not, this probe could not tell the difference.)
    assert 0 < main_only < 1 << 22
    assert applied == "True"
    assert after == 0


def test_flush_denormals_switch_off():
    res = _denormal_probe("0")
    if res == ["unsupported"]:
        pytest.skip("no flush-to-zero on this CPU")
    assert res[1] == "False" and int(res[2]) == int(res[0]) > 0


_RUN = r"""
import hashlib, torch
from softprior.config import make_run_config
from softprior.train import train
r = train(make_run_config("assoc_recall", "unforced", 0, steps=40, eval_every=20, n_val=64))
h = hashlib.sha256()
for k, v in sorted(r.state_dict.items()):
    h.update(v.numpy().tobytes())
print(h.hexdigest(), r.summary["normal_loss"])
"""


def test_flushing_denormals_leaves_a_run_bit_identical():
    """The denormals are summed with unit-sized terms, so flushing them changes no weight bit
    (runtime docstring); stored runs from before the setting stay valid."""
    outs = []
    for flag in ("0", "1"):
        env = {**os.environ, "SOFTPRIOR_FLUSH_DENORMALS": flag}
        outs.append(subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True,
                                   check=True).stdout.split())
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ flush-to-zero is scoped to training
def _needs_ftz():
    import torch
    if not torch.set_flush_denormal(False):
        pytest.skip("no flush-to-zero on this CPU")


def test_train_restores_the_flush_to_zero_setting(monkeypatch):
    """train() used to leave flush-to-zero switched on for the whole process (notebook users too)."""
    import torch

    from softprior.engine import train_group
    from softprior.train import TrainingDiverged, train

    from conftest import tiny_config

    monkeypatch.delenv("SOFTPRIOR_FLUSH_DENORMALS", raising=False)
    _needs_ftz()
    cfg = tiny_config(checkpoint_every=10)
    seen = []
    try:
        assert not runtime.denormals_flushed()
        train(cfg, on_checkpoint=lambda ck: seen.append(runtime.denormals_flushed()))
        assert seen == [True]  # on while training
        assert not runtime.denormals_flushed()  # off again afterwards, as before the call
        train_group([tiny_config(seed=0), tiny_config(seed=1)])
        assert not runtime.denormals_flushed()
        with pytest.raises(TrainingDiverged):  # restored after an exception too
            train(tiny_config(lr=1e30, grad_clip=None))
        assert not runtime.denormals_flushed()
        torch.set_flush_denormal(True)  # a caller that had it on keeps it on
        train(tiny_config(steps=5))
        assert runtime.denormals_flushed()
    finally:
        torch.set_flush_denormal(False)


_SCOPED = r"""
import torch
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-20)
def survivors():  # computed by both OpenMP threads: each half is flushed or not by its own thread
    return int(((x * 1e-20) != 0).sum())
before = survivors()
from softprior.config import make_run_config
from softprior.train import train
train(make_run_config("assoc_recall", "unforced", 0, steps=3, eval_every=3, n_val=16, batch_size=8))
print(before, survivors())
"""


def test_flush_to_zero_is_restored_on_every_openmp_thread():
    _needs_ftz()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SOFTPRIOR_FLUSH_DENORMALS")}
    before, after = map(int, subprocess.run([sys.executable, "-c", _SCOPED], env=env, capture_output=True,
                                            text=True, check=True).stdout.split())
    assert before == 1 << 22 and after == before  # no thread left flushing
