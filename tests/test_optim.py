"""softprior.optim.AdamW against torch.optim.AdamW(fused=True), and against the update by hand."""

import copy
import pytest
import torch

from softprior.optim import AdamW


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 3, generator=g)
    b = torch.randn(3, generator=g)
    x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
    return w, b, x, y


def _train(opt_cls, steps=25, state=None, **kw):
    w0, b0, x, y = _problem()
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    opt = opt_cls([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-2, **kw)
    if state is not None:  # state_dicts hold references to live state (as torch's do): load a copy
        opt.load_state_dict(copy.deepcopy(state))
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w + b - y) ** 2).mean().backward()
        opt.step()
    return w.detach(), b.detach(), opt


def test_bit_equal_to_torch_fused_adamw():
    w1, b1, ours = _train(AdamW)
    w2, b2, theirs = _train(torch.optim.AdamW, fused=True)
    assert torch.equal(w1, w2) and torch.equal(b1, b2)
    so, st = ours.state_dict(), theirs.state_dict()
    assert so["state"].keys() == st["state"].keys()
    for i in st["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(so["state"][i][k], st["state"][i][k]), (i, k)
    assert [g["params"] for g in so["param_groups"]] == [g["params"] for g in st["param_groups"]]


def test_one_step_by_hand():
    """Step 1 from zero state: m = (1-b1) g, v = (1-b2) g^2, bias-corrected m/sqrt(v) = sign(g)."""
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    p.grad = torch.tensor([0.5, -4.0])
    lr, wd, eps = 0.1, 0.2, 1e-8
    AdamW([p], lr=lr, weight_decay=wd, eps=eps).step()
    expect = [(1.0 * (1 - lr * wd)) - lr * 0.5 / (0.5 + eps), (-2.0 * (1 - lr * wd)) - lr * (-4.0) / (4.0 + eps)]
    assert p.detach().tolist() == pytest.approx(expect, rel=1e-6)


def test_state_dict_loads_into_torch_and_back():
    """A checkpoint of ours resumes in torch's optimiser (and vice versa) with the same result."""
    _, _, ours = _train(AdamW, steps=10)
    w_a, _, _ = _train(torch.optim.AdamW, steps=5, state=ours.state_dict(), fused=True)
    w_b, _, _ = _train(AdamW, steps=5, state=ours.state_dict())
    assert torch.equal(w_a, w_b)
    _, _, theirs = _train(torch.optim.AdamW, steps=10, fused=True)
    w_c, _, _ = _train(AdamW, steps=5, state=theirs.state_dict())
    w_d, _, _ = _train(torch.optim.AdamW, steps=5, state=theirs.state_dict(), fused=True)
    assert torch.equal(w_c, w_d)


def test_rejects_bad_hyperparameters():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="betas"):
        AdamW([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="parameter groups"):
        AdamW([p]).load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


def test_no_dynamo_import_in_a_training_run():
    import subprocess
    import sys
    code = ("import sys; from softprior.config import make_run_config; from softprior.train import train; "
            "train(make_run_config('assoc_recall', 'unforced', 0, steps=3, eval_every=3, n_val=8)); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


# ------------------------------------------------------------------ fallback where the fused kernel is missing
@pytest.fixture
def no_fused_kernel(monkeypatch):
    """torch without ``_fused_adamw_`` (or with it, but no CPU kernel: torch 2.2/2.3)."""
    import softprior.optim as optim
    monkeypatch.setattr(optim, "_FUSED_OK", {}, raising=False)
    monkeypatch.delattr(torch, "_fused_adamw_")
    return optim


def test_fallback_to_torch_adamw_when_the_fused_kernel_is_missing(no_fused_kernel):
    assert not no_fused_kernel.fused_available("cpu")
    w1, b1, ours = _train(AdamW)
    w2, b2, theirs = _train(torch.optim.AdamW, fused=False, foreach=False)
    assert torch.equal(w1, w2) and torch.equal(b1, b2)  # it is torch's non-fused AdamW
    so, st = ours.state_dict(), theirs.state_dict()
    for i in st["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(so["state"][i][k], st["state"][i][k]), (i, k)
    assert float(so["state"][0]["step"]) == 25.0  # counted once per step, not twice


def test_fallback_when_the_kernel_has_no_cpu_backend(monkeypatch):
    import softprior.optim as optim

    def no_cpu_kernel(*a, **kw):  # what torch 2.2 raises on CPU tensors
        raise NotImplementedError("Could not run 'aten::_fused_adamw_' with arguments from the 'CPU' backend.")
    monkeypatch.setattr(optim, "_FUSED_OK", {}, raising=False)
    monkeypatch.setattr(torch, "_fused_adamw_", no_cpu_kernel)
    assert not optim.fused_available("cpu")
    w1, _, _ = _train(AdamW, steps=5)
    w2, _, _ = _train(torch.optim.AdamW, steps=5, fused=False, foreach=False)
    assert torch.equal(w1, w2)


def test_fallback_result_matches_the_fused_update_and_resumes_from_its_state(no_fused_kernel, monkeypatch):
    w_fb, b_fb, fb = _train(AdamW, steps=10)
    monkeypatch.undo()  # the fused kernel is back
    w_f, b_f, fused = _train(AdamW, steps=10)
    torch.testing.assert_close(w_fb, w_f, rtol=1e-6, atol=1e-6)  # same algorithm; rounding may differ
    # a checkpoint written by the fallback resumes with the fused kernel, and vice versa
    w_a, _, _ = _train(AdamW, steps=5, state=fb.state_dict())
    w_b, _, _ = _train(AdamW, steps=5, state=fused.state_dict())
    torch.testing.assert_close(w_a, w_b, rtol=1e-6, atol=1e-6)


def test_training_run_without_the_fused_kernel(no_fused_kernel):
    from softprior.train import train

    from conftest import tiny_config
    r = train(tiny_config(steps=10))
    assert r.summary["steps"] == 10 and all(torch.isfinite(v).all() for v in r.state_dict.values())
