"""The fused attention operator (kernels/attention.py, attention.cpp) against the pure-PyTorch
``fastpath._Attention``: the same function and gradients (gradcheck in float64 for every input,
Tq < T and several runs included), a run's numbers independent of how many runs share the call,
training that agrees with the pure-PyTorch path, and the fallback where the build is unavailable."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from softprior import kernels
from softprior.config import make_run_config
from softprior.model.fastpath import _Attention
from softprior.training.loop import train

attention_module = importlib.import_module("softprior.kernels.attention")  # (the package exports a function of that name)
needs_build = pytest.mark.skipif(not kernels.available(), reason=f"the operator did not build: {kernels.build_error()}")


def _inputs(K, H, B, Tq, T, e, dh, dtype=torch.float64, seed=0):
    """q, k, v and a bias [K, H, Tq, T] with the causal mask for queries at the last Tq positions
    (-inf above the diagonal, as ``fastpath._pos_bias`` adds it), all requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(K * H * B, n, e, generator=g, dtype=dtype) for n in (Tq, T))
    v = torch.randn(K * H * B, T, dh, generator=g, dtype=dtype)
    qpos = torch.arange(T - Tq, T)
    mask = torch.zeros(Tq, T, dtype=dtype).masked_fill_(qpos[:, None] < torch.arange(T)[None, :], float("-inf"))
    bias = torch.randn(K, H, Tq, T, generator=g, dtype=dtype) + mask
    return [t.requires_grad_() for t in (q, k, v, bias)]


SHAPES = [(1, 2, 3, 5, 5, 4, 3),     # one run, Tq = T
          (2, 2, 2, 3, 6, 5, 4),     # K > 1, Tq < T
          (3, 1, 2, 9, 9, 17, 18)]   # rows longer than one 16-lane tile, 9 queries (a group of 8 and one)


@needs_build
@pytest.mark.parametrize("shape", SHAPES)
def test_gradcheck_in_float64_for_every_input(shape):
    q, k, v, bias = _inputs(*shape)
    # the masked entries of bias stay -inf under gradcheck's perturbation: their gradient is 0 both ways
    assert torch.autograd.gradcheck(kernels.attention, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES + [(1, 4, 64, 32, 32, 24, 16), (2, 4, 8, 32, 32, 40, 32)])
def test_the_operator_equals_the_pure_pytorch_attention(shape, dtype):
    ins = _inputs(*shape, dtype=dtype, seed=3)
    z = kernels.attention(*ins)
    w = torch.randn(z.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    got = (z, *torch.autograd.grad(z, ins, w))
    ref = _Attention.apply(*ins)
    want = (ref, *torch.autograd.grad(ref, ins, w))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for name, a, b in zip(("z", "dq", "dk", "dv", "dbias"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)


@needs_build
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T", [32, 33])  # rows of whole tiles (P formed in place) and not (through buffers)
def test_a_run_computes_the_same_bits_alone_and_in_a_group_of_five(threads, T):
    """Run 2 of a K = 5 call gets bitwise what the same run gets alone (K = 1), forward and backward."""
    H, B, e, dh = 4, 8, 24, 16
    group = _inputs(5, H, B, T, T, e, dh, dtype=torch.float32, seed=5)
    one = [t.detach()[2 * H * B:3 * H * B] if t.dim() == 3 else t.detach()[2:3] for t in group]
    one = [t.clone().requires_grad_() for t in one]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        zg, zo = kernels.attention(*group), kernels.attention(*one)
        wg = torch.randn(zg.shape, generator=torch.Generator().manual_seed(6))
        wo = wg[2 * H * B:3 * H * B]
        gg, go = torch.autograd.grad(zg, group, wg), torch.autograd.grad(zo, one, wo)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(zg[2 * H * B:3 * H * B], zo)
    for a, b in zip(gg[:3], go[:3]):
        assert torch.equal(a[2 * H * B:3 * H * B], b)
    assert torch.equal(gg[3][2:3], go[3])


@needs_build
@pytest.mark.parametrize("task", ["assoc_recall", "markov", "linear_icl"])
def test_fifty_training_steps_agree_with_the_pure_pytorch_path(task, monkeypatch):
    cfg = make_run_config(task, "unforced", 1, steps=50, eval_every=25, n_val=32, batch_size=16, model="base")
    fused = train(cfg)
    assert kernels.attention_backend() == "fused-cpp" and fused.summary["attention_backend"] == "fused-cpp"
    monkeypatch.setenv(kernels.ENV, "0")
    plain = train(cfg)
    assert plain.summary["attention_backend"] == "torch"
    keys = ("train_loss", "normal_loss", "zero_loss", "g_pos", "g_content")
    assert [r["step"] for r in fused.metrics] == [r["step"] for r in plain.metrics] == [25, 50]
    np.testing.assert_allclose([[r[k] for k in keys] for r in fused.metrics],
                               [[r[k] for k in keys] for r in plain.metrics], rtol=1e-5)  # measured: <= 1.4e-7
    # the weights: AdamW divides each gradient by its running RMS, so where a gradient is near zero a
    # last-bit difference moves the update by up to ~lr; measured up to 3.2e-5 of a tensor's largest entry
    for name, t in plain.state_dict.items():
        torch.testing.assert_close(fused.state_dict[name], t, rtol=0, atol=1e-4 * t.abs().max().item(), msg=name)


def test_the_pure_pytorch_path_runs_where_the_build_fails(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension 'softprior_attention': c++: not found")
    monkeypatch.setattr(attention_module, "_build", no_compiler)
    monkeypatch.setitem(attention_module._state, "loaded", None)
    monkeypatch.setitem(attention_module._state, "error", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch attention runs"):
        assert not kernels.available()
    assert kernels.attention_backend() == "torch"
    assert "c++: not found" in kernels.build_error()
    used = []
    real = _Attention.apply
    monkeypatch.setattr(_Attention, "apply", lambda *a: used.append(1) or real(*a))
    cfg = make_run_config("assoc_recall", "unforced", 0, steps=2, eval_every=2, n_val=8, batch_size=4)
    res = train(cfg)
    assert used and res.summary["attention_backend"] == "torch"
    assert np.isfinite(res.summary["normal_loss"])


def test_the_environment_switch_forces_the_pure_pytorch_path(monkeypatch):
    from softprior.model import fastpath
    used = []
    real = _Attention.apply
    monkeypatch.setattr(_Attention, "apply", lambda *a: used.append(1) or real(*a))
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.available() and kernels.attention_backend() == "torch"
    ins = _inputs(1, 4, 2, 32, 32, 24, 16, dtype=torch.float32)
    fastpath._attention(*ins)
    assert used == [1]


def test_the_ninja_package_is_found_where_ninja_is_not_on_the_path(monkeypatch):
    """cpp_extension runs ``ninja`` from PATH; a venv used without activation has the ninja package's
    binary off the PATH, so the loader appends the package's bin directory."""
    from softprior.kernels import build
    ninja = pytest.importorskip("ninja")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    build._ensure_ninja()
    assert build.os.environ["PATH"].split(build.os.pathsep) == ["/nonexistent", ninja.BIN_DIR]
