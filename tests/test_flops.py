"""The floor's FLOP count (``flops.train_step_flops``): a contextual scheme's own network is part of
a training step's matmuls. Checked against a case worked out by hand and against torch's own FLOP
counter run on the readable scheme (``positional.contextual``), which shares no code with the count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from softprior.flops import scheme_flops, train_step_flops
from softprior.positional import make_scheme
from softprior.tasks.generators import make_task

from conftest import tiny_config


def _cfg(scheme: str):
    return tiny_config(model_options={"prior": False, "positional": scheme})


def test_dape_and_cope_by_hand():
    """H = 4 heads of d_head 16 (d_model 64), n_ctx 32, B = 2 sequences, Tq = 3 queries, T = 5 keys.
    DAPE's MLP, 2H = 8 -> 32 -> 4 at each of B Tq T = 30 (i, j) cells: 2 (8 x 32 + 32 x 4) = 768 FLOP a
    cell, 23,040 in all. CoPE's z = q P per head and query, [16] x [16, 33]: 2 x 16 x 33 = 1,056 FLOP,
    x B H Tq = 24: 25,344."""
    for scheme, expected in (("dape", 23_040), ("cope", 25_344), ("gpsa", 0), ("alibi", 0)):
        m = _cfg(scheme).model.model_copy(update={"n_heads": 4, "d_model": 64, "n_ctx": 32})
        assert m.d_head == 16
        assert scheme_flops(m, 2, 3, 5) == expected, scheme


@pytest.mark.parametrize("scheme", ["dape", "cope"])
def test_scheme_flops_match_torch_counter_on_the_readable_scheme(scheme):
    """torch's FLOP counter on the readable scheme's ``adjust_logits`` (one layer's forward) counts what
    ``scheme_flops`` says; a training step adds it per layer, at the queries that layer computes."""
    cfg = _cfg(scheme)
    m = cfg.model
    B, T = 3, m.n_ctx
    sch = make_scheme(scheme, n_heads=m.n_heads, d_head=m.d_head, d_model=m.d_model, n_ctx=m.n_ctx, layer=0,
                      n_layers=m.n_layers)
    for Tq in (T, 2):
        qpos, kpos = torch.arange(T - Tq, T), torch.arange(T)
        logits = torch.randn(B, m.n_heads, Tq, T)
        q, k = torch.randn(B, m.n_heads, Tq, m.d_head), torch.randn(B, m.n_heads, T, m.d_head)
        with FlopCounterMode(display=False) as counter:
            sch.adjust_logits(logits, q, k, qpos, kpos)
        assert counter.get_total_flops() == scheme_flops(m, B, Tq, T) > 0
    # the step: the plain model's count plus the scheme's in every layer (the last at the loss positions)
    P = len(make_task(cfg.task).loss_positions(T))
    plain = train_step_flops(_cfg("nope"))
    extra = sum(scheme_flops(m, cfg.batch_size, P if layer == m.n_layers - 1 else T, T)
                for layer in range(m.n_layers))
    assert train_step_flops(cfg) == plain + 3 * extra
