"""Runs that differ only in initialisation share a group (the calibration search's init axes) and
train as they would apart."""

import pytest
import torch

from softprior.config import make_run_config
from softprior.engine import group_key, train_group


def _cfg(path="unforced", **m):
    return make_run_config("assoc_recall", path, 1, steps=10, eval_every=5, n_val=64, model_options=m)


def test_init_only_differences_share_a_group_and_train_as_apart():
    a = _cfg(embed_init_std=0.3, prior_init="bounded", prior_scale=2.0, prior_cap=3.0)
    b = _cfg("fade600", embed_init_std=1.0, prior_init="alibi", prior_layers=(0, 1))
    assert group_key(a) == group_key(b)
    assert group_key(a) != group_key(_cfg(content_rank=4))  # shapes differ: no
    together = train_group([a, b])
    for cfg, res in zip((a, b), together):
        alone = train_group([cfg])[0]
        for k in ("normal_acc", "zero_acc"):
            assert res.summary[k] == pytest.approx(alone.summary[k], abs=1e-5)
        for n, t in alone.state_dict.items():
            torch.testing.assert_close(res.state_dict[n], t, rtol=1e-4, atol=1e-5)
    # the two runs really started from different initialisations
    assert not torch.allclose(together[0].state_dict["embed.weight"], together[1].state_dict["embed.weight"], atol=0.1)
