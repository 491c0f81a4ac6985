"""The optimiser training uses (``loop.make_optimizer``): torch's AdamW, checked against one step
worked by hand, and its non-fused fallback where the fused kernel has no implementation."""

import pytest
import torch

from softprior.training.loop import make_optimizer

from conftest import tiny_config


def _one_step(cfg):
    """One step from zero state on a decayed matrix and an undecayed bias (``loop.is_decayed``)."""
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    b = torch.tensor([0.5, 3.0], requires_grad=True)
    opt = make_optimizer([("blocks.0.attn.in_proj.weight", w), ("blocks.0.ln.bias", b)], cfg)
    w.grad, b.grad = torch.tensor([0.5, -4.0]), torch.tensor([-0.25, 2.0])
    opt.step()
    return opt, w.detach().tolist(), b.detach().tolist()


def test_one_step_by_hand():
    """Step 1: m = (1-b1) g, v = (1-b2) g^2, so the bias-corrected m / sqrt(v) is g / |g|; the
    decoupled decay p (1 - lr wd) applies to the decayed group only."""
    cfg = tiny_config()
    lr, wd, eps = cfg.lr, cfg.weight_decay, 1e-8
    opt, w, b = _one_step(cfg)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["fused"]
    assert [g["weight_decay"] for g in opt.param_groups] == [wd, 0.0]
    assert w == pytest.approx([1.0 * (1 - lr * wd) - lr * 0.5 / (0.5 + eps),
                               -2.0 * (1 - lr * wd) + lr * 4.0 / (4.0 + eps)], rel=1e-6)
    assert b == pytest.approx([0.5 + lr * 0.25 / (0.25 + eps), 3.0 - lr * 2.0 / (2.0 + eps)], rel=1e-6)


def test_non_fused_where_the_fused_kernel_is_missing(monkeypatch):
    """torch 2.2/2.3 refuse ``fused=True`` on the CPU in the constructor (after writing its defaults
    into the groups): the fallback builds fresh groups, non-fused, with the same update."""
    real = torch.optim.AdamW

    class NoFusedKernel(real):
        def __init__(self, params, fused=None, **kw):
            super().__init__(params, fused=fused, **kw)
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                                   "supported devices: ['cuda']")

    monkeypatch.setattr(torch.optim, "AdamW", NoFusedKernel)
    cfg = tiny_config()
    opt, w, b = _one_step(cfg)
    assert not any(g["fused"] for g in opt.param_groups)
    monkeypatch.setattr(torch.optim, "AdamW", real)
    _, w_fused, b_fused = _one_step(cfg)
    assert w == pytest.approx(w_fused, rel=1e-6) and b == pytest.approx(b_fused, rel=1e-6)


def test_run_stacked_parameters_step_as_each_run_alone():
    """``make_optimizer(runs=K)`` over [K, ...] tensors updates every run's slice bit-identically to the
    same run's optimiser alone, for a tensor of a few elements (the gate logits: a stacked tensor puts a
    run's elements in the kernel's vector or scalar part by their place) and a larger one."""
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    K, steps = 8, 100
    shapes = {"gate_logits": (2, 2, 1), "blocks.0.ln.bias": (3,), "blocks.0.attn.in_proj.weight": (7, 9)}
    init = {n: torch.randn(K, *s, generator=g) for n, s in shapes.items()}
    grads = [{n: torch.randn(K, *s, generator=g) * 1e-3 for n, s in shapes.items()} for _ in range(steps)]

    def run(ks):
        params = {n: init[n][ks].clone().requires_grad_(True) for n in shapes}
        opt = make_optimizer(params.items(), cfg, runs=len(ks))
        for gr in grads:
            for n, p in params.items():
                p.grad = gr[n][ks].clone()
            opt.step()
        return {n: p.detach() for n, p in params.items()}

    together = run(list(range(K)))
    for k in range(K):
        alone = run([k])
        for n in shapes:
            assert torch.equal(together[n][k], alone[n][0]), (k, n)
