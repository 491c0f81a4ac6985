"""The whole-step operator (kernels/step.py, step.cpp) against the readable model (``model/transformer.py``):
logits and every gradient in float64 (layer 0 on vocabulary pairs and on rows, middle layers, several
loss positions, several runs, learned and forced gates, no content factors), gradcheck on a tiny
model, a run's bits alone and in a group and at one thread and two, where it applies, and the switch
that leaves it out."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, stack_module_state

from softprior import kernels
from softprior.model import fastpath
from softprior.kernels import step as kstep
from softprior.model.config import ModelConfig
from softprior.model.transformer import SoftPriorTransformer

needs_build = pytest.mark.skipif(not kernels.available(), reason=f"the operator did not build: {kernels.build_error()}")


def _models(cfg: ModelConfig, K: int, dtype, seed: int = 0) -> list[SoftPriorTransformer]:
    """K models of ``cfg`` with every parameter moved off its initial value (B^pos, the LayerNorms and
    the content factors included), so that no gradient is trivially zero."""
    g = torch.Generator().manual_seed(seed)
    models = []
    for k in range(K):
        torch.manual_seed(seed + k)
        m = SoftPriorTransformer(cfg).to(dtype)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=dtype))
        models.append(m)
    return models


def _run(fn, models, cfg, tokens, positions, forced=None, weights=None):
    """fn(params, g_pos, g_content) -> logits [K, B, P, V]; returns the logits and the gradients of a
    fixed random weighting of them with respect to every stacked parameter (the gate logits included
    where the gates are learned)."""
    stacked, _ = stack_module_state(models)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in stacked.items()}
    K, L, H = len(models), cfg.n_layers, cfg.n_heads
    if forced is None:
        g = torch.sigmoid(params["gate_logits"])  # [K, 2, L or 1, H or 1]
        gp, gc = g[:, 0].expand(K, L, H), g[:, 1].expand(K, L, H)
    else:
        gp, gc = (torch.full((K, L, H), v, dtype=params["embed.weight"].dtype) for v in forced)
    out = fn(params, gp, gc)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype) if weights is None else weights
    (out * w).sum().backward()
    return out.detach(), {n: p.grad for n, p in params.items() if p.grad is not None}, w


def _readable(models, cfg, tokens, positions):
    pos = torch.tensor(positions)

    def fn(params, gp, gc):
        return torch.stack([functional_call(models[0], {n: t[k] for n, t in params.items()},
                                            (tokens[k if tokens.dim() == 3 else ...], gp[k], gc[k]),
                                            {"positions": pos}) for k in range(len(models))])
    return fn


def _step(cfg, tokens, positions):
    return lambda params, gp, gc: kstep.step_logits(params, cfg, tokens, gp, gc, positions)


CASES = {  # name: (model options, K, batch, context, loss positions, tokens shared, forced gates)
    "base, vocabulary pairs": (dict(content_rank=8, gate_granularity="head"), 2, 8, 32, (31,), False, None),
    "large: middle layers": (dict(n_layers=4, d_model=128, content_rank=8), 2, 4, 32, (31,), True, None),
    "layer 0 on rows (V^2 > B T^2)": (dict(content_rank=8, gate_granularity="layer"), 1, 1, 16, (15,), False, None),
    "two loss positions, forced gates": (dict(content_rank=4), 2, 3, 12, (10, 11), False, (0.7, 0.3)),
    "no content factors, context of 33": (dict(content_rank=0, n_ctx=40), 1, 2, 33, (32,), True, None),
}


@needs_build
@pytest.mark.parametrize("case", list(CASES))
def test_the_whole_step_equals_the_readable_model_in_float64(case):
    opts, K, B, T, positions, shared, forced = CASES[case]
    cfg = ModelConfig(**opts)
    models = _models(cfg, K, torch.float64)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab, (B, T) if shared else (K, B, T), generator=g)
    assert kstep.supports(cfg, True, T, len(positions))
    want = _run(_readable(models, cfg, tokens, positions), models, cfg, tokens, positions, forced)
    got = _run(_step(cfg, tokens, positions), models, cfg, tokens, positions, forced)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10 * want[0].abs().max().item())
    assert set(got[1]) == set(want[1])
    for name, grad in want[1].items():  # float64 rounding, against each tensor's largest entry
        torch.testing.assert_close(got[1][name], grad, rtol=1e-9, atol=1e-10 * grad.abs().max().item(), msg=name)


@needs_build
@pytest.mark.parametrize("family", ["alibi", "t5", "kerple_log", "kerple_power", "fire"])
@pytest.mark.parametrize("case", ["base, vocabulary pairs", "large: middle layers"])
def test_every_prior_family_on_the_whole_step_equals_the_readable_model_in_float64(family, case):
    """A family's B^pos given to the operator as data ([K, H, T, T], ``fastpath._family_bias``): the
    logits and every gradient, the family's own parameters included, are the readable model's."""
    from softprior.model.fastpath import engine, fast_forward
    opts, K, B, T, positions, shared, forced = CASES[case]
    cfg = ModelConfig(**opts, prior_family=family, prior_layers=(0, 1))
    assert engine(cfg, True, T, len(positions))[0] == "whole-step"
    models = _models(cfg, K, torch.float64)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab, (B, T) if shared else (K, B, T), generator=g)
    want = _run(_readable(models, cfg, tokens, positions), models, cfg, tokens, positions, forced)
    got = _run(lambda p, gp, gc: fast_forward(p, cfg, tokens, gp, gc, torch.tensor(positions)), models, cfg, tokens,
               positions, forced)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10 * want[0].abs().max().item())
    assert set(got[1]) == set(want[1]) and (family == "alibi") == (not any(".prior_module." in n for n in got[1]))
    # against the largest gradient of any parameter: a constant added to every B^pos entry (FIRE's last
    # bias) cancels in each softmax row, so its gradient is zero but for rounding on either side
    scale = max(grad.abs().max().item() for grad in want[1].values())
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-9, atol=1e-10 * scale,
                                   msg=lambda m, name=name, grad=grad: f"{name} (largest {grad.abs().max():.3g}): {m}")


def test_the_operators_parameter_list_from_step_cpp_names_every_parameter_of_the_model_once():
    """``param_names`` reads step.cpp's lists: they must name each of the model's parameters exactly once,
    per layer in the order step.cpp's named indices (``layer_param``) read them."""
    cfg = ModelConfig(n_layers=3, n_heads=2, d_model=8, content_rank=2, vocab=6, n_ctx=8)
    names = kstep.param_names(cfg.n_layers)
    model_names = {n for n, _ in _models(cfg, 1, torch.float64)[0].named_parameters()}
    assert len(names) == len(set(names)) and set(names) <= model_names
    assert names[:6] == ("embed.weight", "blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.attn.in_proj.weight",
                         "blocks.0.attn.out_proj.weight", "blocks.0.attn.pos_bias")
    assert names[-2:] == ("ln_final.weight", "ln_final.bias") and len(names) == 1 + 5 * 3 + 2


@needs_build
def test_gradcheck_in_float64_for_every_parameter_and_both_gates():
    cfg = ModelConfig(n_layers=3, n_heads=2, d_model=8, content_rank=2, vocab=6, n_ctx=8)
    stacked, _ = stack_module_state(_models(cfg, 2, torch.float64))
    names = kstep.param_names(cfg.n_layers)
    tokens = torch.randint(0, cfg.vocab, (2, 3, 8), generator=torch.Generator().manual_seed(1))
    gp = torch.rand(2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    gc = torch.rand(2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    ps = [stacked[n].detach().clone().requires_grad_() for n in names]

    def f(gp, gc, *ps):
        return kstep.step_logits(dict(zip(names, ps)), cfg, tokens, gp, gc, (6, 7))
    assert torch.autograd.gradcheck(f, (gp, gc, *ps), eps=1e-6, atol=1e-6)


@needs_build
@pytest.mark.parametrize("threads", [1, 2])
def test_a_run_computes_the_same_bits_alone_and_in_a_group_of_three(threads):
    cfg = ModelConfig(content_rank=8)
    models = _models(cfg, 3, torch.float32)
    tokens = torch.randint(0, cfg.vocab, (3, 16, 32), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        group = _run(_step(cfg, tokens, (31,)), models, cfg, tokens, (31,))
        for k in range(3):
            alone = _run(_step(cfg, tokens[k:k + 1], (31,)), models[k:k + 1], cfg, tokens[k:k + 1], (31,),
                         weights=group[2][k:k + 1])
            assert torch.equal(alone[0][0], group[0][k])
            for name, grad in alone[1].items():
                assert torch.equal(grad[0], group[1][name][k]), name
    finally:
        torch.set_num_threads(before)


@needs_build
def test_one_run_gives_the_same_bits_at_one_thread_and_at_two():
    """Its blocks, LayerNorm rows and reductions each run in one thread in a fixed order, so splitting
    them across threads leaves the bits (ATen's LayerNorm backward split its weight gradients' sums)."""
    cfg = ModelConfig(content_rank=8)
    models = _models(cfg, 1, torch.float32)
    tokens = torch.randint(0, cfg.vocab, (1, 64, 32), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = _run(_step(cfg, tokens, (31,)), models, cfg, tokens, (31,))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[1][0], got[2][0])
    for name, grad in got[1][1].items():
        assert torch.equal(grad, got[2][1][name]), name


def test_where_it_applies():
    base = ModelConfig(content_rank=8)
    assert kstep.supports(base, True, 32, 1) and kstep.supports(base, True, 32, 16)
    assert not kstep.supports(base, False, 32, 1)                      # a vector task
    assert not kstep.supports(base, True, 32, 17)                      # loss on most positions (2P > T)
    assert not kstep.supports(base, True, 33, 1)                       # a context past the B^pos table
    assert not kstep.supports(ModelConfig(n_layers=1), True, 32, 1)     # one layer
    assert not kstep.supports(ModelConfig(positional="alibi"), True, 32, 1)
    assert not kstep.supports(ModelConfig(norm="none"), True, 32, 1)


@needs_build
@pytest.mark.parametrize("value", ["attention", "0"])
def test_the_switch_leaves_the_whole_step_out(value, monkeypatch):
    cfg = ModelConfig(content_rank=8)
    models = _models(cfg, 1, torch.float32)
    tokens = torch.randint(0, cfg.vocab, (4, 32), generator=torch.Generator().manual_seed(5))
    monkeypatch.setenv(kernels.ENV, value)
    assert not kstep.enabled()
    assert kernels.available() == (value == "attention")  # "attention": the attention operator alone
    monkeypatch.setattr(kstep, "step_logits", lambda *a: pytest.fail("the whole-step operator ran"))
    out, grads, _ = _run(lambda p, gp, gc: fastpath.fast_forward(p, cfg, tokens, gp, gc, torch.tensor([31])),
                      models, cfg, tokens, (31,))
    assert out.shape == (1, 4, 1, cfg.vocab) and grads["embed.weight"].abs().sum() > 0


@needs_build
def test_a_retained_graph_gives_the_same_gradients_twice():
    cfg = ModelConfig(content_rank=8)
    stacked, _ = stack_module_state(_models(cfg, 1, torch.float32))
    params = {n: t.detach().requires_grad_() for n, t in stacked.items()}
    g = torch.full((1, 2, 4), 0.5)
    out = kstep.step_logits(params, cfg, torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(6)),
                            g, g, (31,))
    first = torch.autograd.grad(out.square().sum(), list(params.values())[1:], retain_graph=True)
    second = torch.autograd.grad(out.square().sum(), list(params.values())[1:])
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and first[0].abs().sum() > 0


@needs_build
def test_a_double_backward_is_refused_rather_than_wrong():
    cfg = ModelConfig(content_rank=8)
    stacked, _ = stack_module_state(_models(cfg, 1, torch.float64))
    params = {n: t.detach().requires_grad_() for n, t in stacked.items()}
    g = torch.full((1, 2, 4), 0.5, dtype=torch.float64)
    out = kstep.step_logits(params, cfg, torch.zeros(2, 32, dtype=torch.long), g, g, (31,))
    (grad,) = torch.autograd.grad(out.square().sum(), [params["embed.weight"]], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
