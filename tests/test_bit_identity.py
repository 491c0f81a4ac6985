"""Bit-identity of runs across refactors of the training loop (issue 15: "one training step").

``REFERENCE`` holds, for the base and large presets, all three tasks and four paths that exercise
every per-step rule (learned gates, a scheduled gate, prior dropout, the dual loss), a digest of
each run's final weights and logged metric rows, trained by ``engine.train_group`` with the four
paths in one group ("group"), with tiny step counts; ``SINGLE`` the same for ``train.train``.

How the reference was obtained: the digest procedure below (``_digest`` over ``_configs``) was run
as a script on the code of commit c5ab45a (before any change of issue 15), with one torch thread,
torch 2.13.0+cpu, on an x86_64 CPU with AVX512 (``SIGNATURE``), and its output pasted here. The
numbers are the machine's: another CPU type or torch version may round differently (it is the same
code either way), so there the test is skipped with that reason; on the recording machine it fails
on any change of a single bit.
"""

from __future__ import annotations

import hashlib
import json
import platform

import pytest
import torch

from softprior.config import make_run_config
from softprior.engine import train_group
from softprior.train import train

SIGNATURE = ("2.13.0+cpu", "AVX512", "x86_64")
KW = dict(steps=4, eval_every=2, n_val=16, batch_size=8, calibrated=False)  # the digests predate the calibration
PATHS = ["unforced", "prior_dropout", "dual_loss", "linear0.5->0"]

REFERENCE = {
    "group/base/assoc_recall/dual_loss": "ee3941d61f440951",
    "group/base/assoc_recall/linear0.5->0": "132e52e18f590c6a",
    "group/base/assoc_recall/prior_dropout": "451ea3108881df60",
    "group/base/assoc_recall/unforced": "6f036a6fb1facf7e",
    "group/base/linear_icl/dual_loss": "2b8bb0c900ecff03",
    "group/base/linear_icl/linear0.5->0": "49ebb001ebdf6c15",
    "group/base/linear_icl/prior_dropout": "34e3ad6a375cc22f",
    "group/base/linear_icl/unforced": "c50824839f4150ea",
    "group/base/markov/dual_loss": "12f7d30a23824f88",
    "group/base/markov/linear0.5->0": "20234e586311f6d0",
    "group/base/markov/prior_dropout": "9118cffa81a0b46e",
    "group/base/markov/unforced": "29a4684332923d40",
    "group/large/assoc_recall/dual_loss": "0773fa2e0746ba6a",
    "group/large/assoc_recall/linear0.5->0": "cc792327a9abb32e",
    "group/large/assoc_recall/prior_dropout": "d6ea9f0c94b24d9f",
    "group/large/assoc_recall/unforced": "c47a72102a4d8b04",
    "group/large/linear_icl/dual_loss": "854ec5c52fa43fb9",
    "group/large/linear_icl/linear0.5->0": "b8e9231527ec5c18",
    "group/large/linear_icl/prior_dropout": "e995b6906a3c8187",
    "group/large/linear_icl/unforced": "1cb456ebe09829ad",
    "group/large/markov/dual_loss": "9833f50dff18b714",
    "group/large/markov/linear0.5->0": "1d3204bce9c83be3",
    "group/large/markov/prior_dropout": "e86d0fd94c0ccd8a",
    "group/large/markov/unforced": "8777e78c0682dfe2",
}

# ``train.train`` is now ``train.train_runs`` with K = 1 (issue 15, "one training step"), so a single
# run takes the grouped engine's clipping, dual-loss graph and evaluation reductions, and its bits
# changed once: these digests were recorded at 1b0743b, with that change (the group digests above did
# not move).
# Measured before re-recording (30 steps, both presets, three tasks, five paths, old vs new code):
# with clipping off the final weights were bit-identical except on the dual-loss path (autograd
# accumulates the two losses' gradients in another order); with clipping on they differ wherever
# clipping acts (the old loop took the norm of per-tensor norms, the shared step one sum of squares
# per run); the logged metrics differ in float32 rounding of the training-loss mean and of the
# validation loss (one vmapped reduction for every K).
SINGLE = {
    "single/base/assoc_recall/dual_loss": "4f4d6b59ecd0329c",
    "single/base/assoc_recall/linear0.5->0": "cc783a91ae3cbeda",
    "single/base/assoc_recall/prior_dropout": "dfbfb472f24a5861",
    "single/base/assoc_recall/unforced": "24754b4f3c95724b",
    "single/base/linear_icl/dual_loss": "d91ab1de23a4dd45",
    "single/base/linear_icl/linear0.5->0": "1fbc9e5b57f49e06",
    "single/base/linear_icl/prior_dropout": "37e23cee9054a02d",
    "single/base/linear_icl/unforced": "32438cf5106eb51d",
    "single/base/markov/dual_loss": "64a4276b57cebd18",
    "single/base/markov/linear0.5->0": "4ddf2f4c96b18bf1",
    "single/base/markov/prior_dropout": "4ab6d16c0086d783",
    "single/base/markov/unforced": "7853819375cf6631",
    "single/large/assoc_recall/dual_loss": "675f5842f5d0f42a",
    "single/large/assoc_recall/linear0.5->0": "35d1d2af10dc435f",
    "single/large/assoc_recall/prior_dropout": "5434273897cf4f8b",
    "single/large/assoc_recall/unforced": "8bf4bc6b1a82203a",
    "single/large/linear_icl/dual_loss": "236e25f1f995df87",
    "single/large/linear_icl/linear0.5->0": "4993c3cf1dc1d865",
    "single/large/linear_icl/prior_dropout": "772d6c02e182e0c8",
    "single/large/linear_icl/unforced": "24a214577ac4e6c8",
    "single/large/markov/dual_loss": "28834e3573947e12",
    "single/large/markov/linear0.5->0": "525c8a0ba17b8bc6",
    "single/large/markov/prior_dropout": "ac2b1ae6b5e84983",
    "single/large/markov/unforced": "0e113c74f7c7b7d7",
}


def _signature():
    return torch.__version__, torch.backends.cpu.get_cpu_capability(), platform.machine()


def _configs(preset, task):
    return [make_run_config(task, p, seed=i, model=preset, **KW) for i, p in enumerate(PATHS)]


def _digest(res) -> str:
    h = hashlib.sha256()
    for k in sorted(res.state_dict):
        t = res.state_dict[k].detach().contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(t.numpy().tobytes())
    h.update(json.dumps(res.metrics, sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("task", ["assoc_recall", "markov", "linear_icl"])
@pytest.mark.parametrize("preset", ["base", "large"])
def test_runs_are_bit_identical_to_the_recorded_reference(preset, task):
    if _signature() != SIGNATURE:
        pytest.skip(f"reference digests were recorded on {SIGNATURE}, this is {_signature()}")
    assert torch.get_num_threads() == 1  # (conftest) as when the reference was recorded
    cfgs = _configs(preset, task)
    got = {f"single/{preset}/{task}/{c.path.name}": _digest(train(c)) for c in cfgs}
    got.update({f"group/{preset}/{task}/{c.path.name}": _digest(r) for c, r in zip(cfgs, train_group(cfgs))})
    want = {k: v for k, v in {**REFERENCE, **SINGLE}.items() if k.split("/")[1:3] == [preset, task]}
    assert len(want) == 8
    assert got == want
