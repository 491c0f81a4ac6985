"""Tests of softprior.analysis.continuation: the paper's Section 3.3 continuation quantities.

The core is checked on hand-built quadratics whose tangent and projections are worked out by hand
below; the model wrappers against finite differences of gradients the tests compute themselves
(plain autograd through the model, float64); the trace on planted snapshots whose tracking and
solution cosines are known in sign and size (the last tests)."""

import math

import pandas as pd
import pytest
import torch

from softprior.analysis.continuation.core import optimum_tangent_fn, recovery_signal_fn
from softprior.analysis.continuation.model import (ParamLayout, circuit_mask, model_second_order, optimum_tangent,
                                                   recovery_signal, tracking_cosine, zero_gate_mask)
from softprior.analysis.continuation.traces import continuation_trace, continuation_traces, path_gates, removal_step
from softprior.config import make_run_config
from softprior.tasks.generators import make_task
from softprior.model.transformer import build_model

# ------------------------------------------------------------------------------------ hand-built quadratics
# L(theta, g) = 1/2 theta^T H theta + g a^T theta:  grad = H theta + g a,  A = d/dg grad = a,
# dtheta*/dg = -H^{-1} a.
H3 = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
A3 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


def quadratic(H, a):
    def loss(theta, g):
        return 0.5 * theta @ H @ theta + g * (a @ theta)
    return loss


def test_tangent_of_a_quadratic_is_minus_h_inverse_a():
    # H x = a by hand: 4x1 + x2 = 1, x1 + 3x2 + x3 = 2, x2 + 2x3 = 3  ->  x = (2/9, 1/9, 13/9)
    want = -torch.tensor([2 / 9, 1 / 9, 13 / 9], dtype=torch.float64)
    for method in ("cg", "minres"):
        t = optimum_tangent_fn(quadratic(H3, A3), torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64), g=0.7,
                                 damping=0.0, max_iter=10, method=method)
        assert torch.allclose(t.tangent, want, atol=1e-5), method
        assert t.residual < 1e-8 and t.iterations <= 3 and t.a_norm == pytest.approx(math.sqrt(14))


def test_damping_solves_the_shifted_system():
    # (H + I) x = a by hand: 5x1 + x2 = 1, x1 + 4x2 + x3 = 2, x2 + 3x3 = 3  ->  x = (2/13, 3/13, 12/13)
    t = optimum_tangent_fn(quadratic(H3, A3), torch.zeros(3, dtype=torch.float64), damping=1.0, max_iter=10)
    assert torch.allclose(t.tangent, -torch.tensor([2 / 13, 3 / 13, 12 / 13], dtype=torch.float64), atol=1e-5)
    assert t.damping == 1.0 and t.residual < 1e-8


def test_indefinite_hessian_minres_and_cg_flag():
    # H = [[1, 2, 0], [2, 1, 0], [0, 0, 3]] has eigenvalues 3, -1, 3 (indefinite).
    Hi = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    # H x = (1, 0, 3): x1 + 2x2 = 1, 2x1 + x2 = 0 -> x = (-1/3, 2/3, 1); t = -x
    t = optimum_tangent_fn(quadratic(Hi, torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)),
                             torch.zeros(3, dtype=torch.float64), damping=0.0, max_iter=10, method="minres")
    assert torch.allclose(t.tangent, torch.tensor([1 / 3, -2 / 3, -1.0], dtype=torch.float64), atol=1e-5)
    # a = (1, -1, 0) is an eigenvector of eigenvalue -1 (H a = -a), so H t = -a gives t = a. CG's first
    # direction p = -a has p^T H p = -2 < 0: it flags the negative curvature and still solves in one step.
    a = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    t = optimum_tangent_fn(quadratic(Hi, a), torch.zeros(3, dtype=torch.float64), damping=0.0, max_iter=10,
                             method="cg")
    assert t.negative_curvature and torch.allclose(t.tangent, a, atol=1e-10)


def test_recovery_signal_of_a_quadratic_is_the_hand_projection():
    theta = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    # grad at g = 0: H theta = (4 - 0, 1 - 1, -2) = (4, 0, -2), norm sqrt(20)
    fn = quadratic(H3, A3)
    r = recovery_signal_fn(fn, theta, torch.tensor([True, False, False]))
    assert r.signal == pytest.approx(4.0) and r.grad_norm == pytest.approx(math.sqrt(20))
    assert r.share == pytest.approx(4 / math.sqrt(20)) and r.dim == 1
    # span{(1, 1, 0)}: P grad = (4/2)(1, 1, 0), norm 2 sqrt(2)
    r = recovery_signal_fn(fn, theta, torch.tensor([[1.0], [1.0], [0.0]], dtype=torch.float64))
    assert r.signal == pytest.approx(2 * math.sqrt(2)) and r.dim == 1
    # a non-orthonormal basis of span{e1, e3}: (1, 0, 1), (0, 0, 1) -> the whole gradient, share 1
    r = recovery_signal_fn(fn, theta, torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert r.signal == pytest.approx(math.sqrt(20)) and r.share == pytest.approx(1.0) and r.dim == 2
    # control: 1 random coordinate out of the eligible {e3} only -> |grad_3| = 2 every draw
    r = recovery_signal_fn(fn, theta, torch.tensor([True, False, False]),
                             eligible=torch.tensor([False, False, True]))
    assert r.control_signal == pytest.approx(2.0) and r.control_share == pytest.approx(2 / math.sqrt(20))
    # over all three coordinates the draws average |grad_i| = (4 + 0 + 2)/3 = 2 in expectation
    r = recovery_signal_fn(fn, theta, torch.tensor([True, False, False]), n_control=600, seed=3)
    assert r.control_signal == pytest.approx(2.0, abs=0.3)


def test_tracking_cosine_by_hand():
    t = torch.tensor([1.0, 0.0, 0.0])
    assert tracking_cosine(t, torch.zeros(3), torch.tensor([1.0, 1.0, 0.0])) == pytest.approx(1 / math.sqrt(2))
    # a gate decrease (dg < 0) flips the predicted move
    assert tracking_cosine(t, torch.zeros(3), torch.tensor([1.0, 1.0, 0.0]), dg=-0.5) == pytest.approx(
        -1 / math.sqrt(2))
    assert math.isnan(tracking_cosine(t, torch.zeros(3), torch.zeros(3)))


# ------------------------------------------------------------------------------------ the real (tiny) model
def _model64(gate_init=None):
    cfg = make_run_config("assoc_recall", "unforced", steps=20)
    model = build_model(cfg).double()
    task = make_task(cfg.task)
    batch = task.sample(16, cfg.model.n_ctx, torch.Generator().manual_seed(5))
    return cfg, model, task, batch


def _grad(model, task, batch, gp, gc):
    """grad_theta L by plain autograd through the model (theta: every parameter but the gate logits)."""
    params = [p for n, p in model.named_parameters() if n != "gate_logits"]
    pos = task.loss_positions(batch.inputs.shape[1])
    loss = task.loss(model(batch.inputs, gp, gc, positions=pos), batch.targets)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _shifted(model, v, eps):
    """A copy of the model with theta + eps v."""
    import copy
    m = copy.deepcopy(model)
    o = 0
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n == "gate_logits":
                continue
            p.add_(eps * v[o:o + p.numel()].view_as(p))
            o += p.numel()
    return m


def test_mixed_derivative_and_hvp_match_finite_differences():
    cfg, model, task, batch = _model64()
    g0, eps = 0.5, 1e-5
    so = model_second_order(model, task, batch, gate=g0)  # direction (1, 1): both gates move
    # A_g = d/dg grad_theta L, central difference in g applied to both gates
    fd = (_grad(model, task, batch, g0 + eps, g0 + eps) - _grad(model, task, batch, g0 - eps, g0 - eps)) / (2 * eps)
    assert torch.linalg.vector_norm(so.mixed) > 1e-3  # the prior matters at g = 0.5
    assert torch.allclose(so.mixed, fd, rtol=1e-5, atol=1e-7 * float(fd.abs().max()))
    # only the position gate moving
    so_p = model_second_order(model, task, batch, gate=g0, direction=(1.0, 0.0))
    fd_p = (_grad(model, task, batch, g0 + eps, g0) - _grad(model, task, batch, g0 - eps, g0)) / (2 * eps)
    assert torch.allclose(so_p.mixed, fd_p, rtol=1e-5, atol=1e-7 * float(fd_p.abs().max()))
    # H v against a central difference of the gradient along v, for several random directions
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        v = torch.randn(so.theta.numel(), generator=gen, dtype=torch.float64)
        hv = so.hvp(v)
        fd = (_grad(_shifted(model, v, eps), task, batch, g0, g0)
              - _grad(_shifted(model, v, -eps), task, batch, g0, g0)) / (2 * eps)
        assert torch.linalg.vector_norm(hv - fd) <= 1e-6 * torch.linalg.vector_norm(fd)


def test_tangent_residual_is_reported_honestly():
    cfg, model, task, batch = _model64()
    g0, eps, lam = 0.5, 1e-5, 1e-2
    for method in ("cg", "minres"):
        t = optimum_tangent(model, task, batch, gate=g0, damping=lam, max_iter=15, method=method, curvature="hessian")
        assert t.iterations >= 1 and t.tangent.shape == (sum(p.numel() for n, p in model.named_parameters()
                                                              if n != "gate_logits"),)
        # H t by a finite difference of the gradient, A by a finite difference in g: both independent
        ht = (_grad(_shifted(model, t.tangent, eps), task, batch, g0, g0)
              - _grad(_shifted(model, t.tangent, -eps), task, batch, g0, g0)) / (2 * eps)
        a = (_grad(model, task, batch, g0 + eps, g0 + eps) - _grad(model, task, batch, g0 - eps, g0 - eps)) / (2 * eps)
        res = float(torch.linalg.vector_norm(ht + lam * t.tangent + a))
        assert res <= t.residual + 1e-6 * float(torch.linalg.vector_norm(a)), method
        if method == "minres":  # MINRES's residual never grows; CG may stay at t = 0 on an indefinite H
            assert t.rel_residual < 1.0 and t.residual < t.a_norm
    d = t.as_dict()
    assert set(d) == {n for n, _ in model.named_parameters()} - {"gate_logits"}


def test_circuit_mask_selects_exactly_one_heads_qkvo():
    cfg, model, task, batch = _model64()
    layout = ParamLayout.from_model(model)
    l, h, dh = 1, 2, cfg.model.d_head
    mask = circuit_mask(layout, cfg.model, [(l, h)])
    assert int(mask.sum()) == 4 * cfg.model.d_model * dh
    # zero those coordinates: head h's output vanishes, every other head of the layer is untouched
    theta = layout.flatten(dict(model.named_parameters())).clone()
    theta[mask] = 0.0
    cut = _shifted(model, theta - layout.flatten(dict(model.named_parameters())), 1.0)
    name_z, name_r = f"blocks.{l}.attn.hook_z", f"blocks.{l}.attn.hook_result"
    _, c0 = model.run_with_cache(batch.inputs, 0.0, 0.0, names_filter=[name_z, name_r])
    _, c1 = cut.run_with_cache(batch.inputs, 0.0, 0.0, names_filter=[name_z, name_r])
    others = [k for k in range(cfg.model.n_heads) if k != h]
    assert torch.allclose(c1[name_z][:, :, others], c0[name_z][:, :, others])
    assert c1[name_r][:, :, h].abs().max() == 0 and c0[name_r][:, :, h].abs().max() > 0
    # only the out_proj part (W_O^h): head h's output vanishes, the other heads' outputs are untouched
    only_o = mask.clone()
    only_o[:layout.slice(f"blocks.{l}.attn.out_proj.weight").start] = False
    theta = layout.flatten(dict(model.named_parameters())).clone()
    theta[only_o] = 0.0
    cut = _shifted(model, theta - layout.flatten(dict(model.named_parameters())), 1.0)
    _, c2 = cut.run_with_cache(batch.inputs, 0.0, 0.0, names_filter=[name_z, name_r])
    assert int(only_o.sum()) == cfg.model.d_model * dh
    assert torch.allclose(c2[name_r][:, :, others], c0[name_r][:, :, others])
    assert c2[name_r][:, :, h].abs().max() == 0
    # names and masks
    names = circuit_mask(layout, cfg.model, ["embed.weight"])
    assert int(names.sum()) == model.embed.weight.numel()
    with pytest.raises(KeyError, match="unknown parameter"):
        circuit_mask(layout, cfg.model, ["nope"])
    with pytest.raises(IndexError):
        circuit_mask(layout, cfg.model, [(5, 0)])


def test_zero_gate_gradient_lives_on_the_zero_gate_mask():
    cfg, model, task, batch = _model64()
    layout = ParamLayout.from_model(model)
    elig = zero_gate_mask(layout, cfg.model)
    g = _grad(model, task, batch, 0.0, 0.0)
    assert g[~elig].abs().max() == 0 and g[elig].abs().max() > 0
    r = recovery_signal(model, task, batch, [(0, 0), (1, 0)])
    assert r.grad_norm == pytest.approx(float(torch.linalg.vector_norm(g)), rel=1e-9)
    mask = circuit_mask(layout, cfg.model, [(0, 0), (1, 0)])
    assert r.signal == pytest.approx(float(torch.linalg.vector_norm(g[mask])), rel=1e-9)
    assert r.n_eligible == int(elig.sum()) and r.dim == int(mask.sum())
    assert 0 < r.control_share < 1


def test_removal_step_and_path_gates():
    from softprior.paths import get_path
    assert removal_step(get_path("fade600"), 3600) == 600
    assert removal_step(get_path("hard_switch1050"), 3600) == 1049
    assert removal_step(get_path("forced_zero"), 3600) == 0
    assert removal_step(get_path("unforced"), 3600) == 3600
    # fade600: 0.5 until 600, linear to 0 over 450 steps: at 900, 0.5 * (1 - 300/450) = 1/6
    assert path_gates(get_path("fade600"), 900, 3600) == pytest.approx((1 / 6, 1 / 6))
    logits = torch.zeros(2, 1, 1)
    logits[0] = math.log(3.0)  # sigmoid = 3/4
    assert path_gates(get_path("unforced"), 10, 20, {"gate_logits": logits}) == pytest.approx((0.75, 0.5))


# ------------------------------------------------------------------------------------ traces and the experiment
def test_trace_on_a_fade_tracks_only_where_the_gate_moves():
    from softprior.training.loop import train
    cfg = make_run_config("assoc_recall", "fade10", steps=30, snapshot_every=10, eval_every=10, n_val=32,
                          batch_size=16)
    res = train(cfg)
    df = continuation_trace(res.snapshots, cfg, [(0, 0), (1, 3)], n_examples=32, max_iter=5)
    assert list(df["step"]) == [0, 10, 20, 30]
    # fade10: 0.5 until step 10, then 0.5 (1 - (s - 10)/450): the gate is flat over 0..10, moves after
    assert list(df["g_pos"]) == pytest.approx([0.5, 0.5, 0.5 * (1 - 10 / 450), 0.5 * (1 - 20 / 450)])
    assert math.isnan(df["tracking_cos"][0]) and math.isnan(df["tracking_cos"][3])
    assert df["tracking_cos"][1:3].notna().all() and (df["cg_iters"][1:3] == 5).all()
    assert df["dg_pos"][1] == pytest.approx(-0.5 * 10 / 450)
    # the other-heads control by hand: 6 other heads, k = 2 -> sqrt(2 * mean ||P_h g||^2) / ||g||
    model = build_model(cfg)
    model.load_state_dict(res.snapshots[2][1])
    task = make_task(cfg.task)
    batch = task.sample(32, 32, torch.Generator().manual_seed(cfg.val_seed))
    g = _grad(model, task, batch, 0.0, 0.0)
    layout = ParamLayout.from_model(model)
    others = [(l, h) for l in range(2) for h in range(4) if (l, h) not in [(0, 0), (1, 3)]]
    sq = [float(g[circuit_mask(layout, cfg.model, [x])].norm()) ** 2 for x in others]
    assert df["other_heads_share"][2] == pytest.approx(math.sqrt(2 * sum(sq) / 6) / float(g.norm()), rel=1e-4)
    assert df["share"][2] == pytest.approx(float(g[circuit_mask(layout, cfg.model, [(0, 0), (1, 3)])].norm())
                                           / float(g.norm()), rel=1e-4)


def test_traces_measured_by_two_worker_processes_equal_the_serial_ones():
    from softprior.training.loop import train
    cfg = make_run_config("assoc_recall", "fade10", steps=30, snapshot_every=10, eval_every=10, n_val=32,
                          batch_size=16)
    res = train(cfg)
    kw = dict(n_examples=32, max_iter=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers measure at one thread, as a report does
    try:
        specs = [dict(snapshots=res.snapshots, cfg=cfg, circuit=[(0, 0), (1, 3)], **kw),
                 dict(snapshots=[], cfg=cfg, circuit=[(0, 0)], **kw),  # a run without snapshots: an empty frame
                 dict(snapshots=res.snapshots[1:], cfg=cfg, circuit=[(1, 0)], step_offset=5, **kw)]
        serial = continuation_traces(specs)
        seen = []
        parallel = continuation_traces(specs, workers=2, on_trace=lambda j, df: seen.append((j, len(df))))
        for workers in (1, 2):  # a misspelt setting raises in both modes (not a silent default)
            with pytest.raises(TypeError):
                continuation_traces([dict(specs[0], dampng=1.0)], workers=workers)
    finally:
        torch.set_num_threads(threads)
    assert sorted(seen) == [(0, 4), (1, 0), (2, 3)]  # each run reported once, as soon as it was complete
    assert list(parallel[0]["step"]) == [0, 10, 20, 30] and parallel[0]["tracking_cos"][1:3].notna().all()
    assert parallel[1].empty and list(parallel[2]["step"]) == [15, 25, 35]
    for a, b in zip(serial, parallel):
        if not a.empty:
            pd.testing.assert_frame_equal(a.drop(columns="seconds"), b.drop(columns="seconds"), check_exact=True)


def test_continuation_trace_experiment_end_to_end(tmp_path):
    from softprior.executors.sweep import execute
    from softprior.experiments import Options, get_experiment
    from softprior.reports.experiment import write_report
    from softprior.store import RunStore

    exp = get_experiment("continuation_trace")
    cells = exp.build(Options(quick=True))
    assert {(c.col, c.row) for c in cells} == {("assoc_recall", p) for p in
                                                ("fade600", "hard_switch1050", "forced_zero", "unforced", "posthoc")} | {
        ("linear_icl", "fade600"), ("linear_icl", "forced_zero")}
    assert all(c.cfg.snapshot_every == 50 for c in cells)
    tiny = dict(steps=30, eval_every=15, n_val=32, batch_size=16, snapshot_every=15)  # tens of steps
    for c in cells:
        path = c.cfg.path.model_copy(update={"steps": 30}) if c.cfg.path.steps else c.cfg.path
        c.cfg = c.cfg.model_copy(update={**tiny, "path": path})
    store = RunStore(tmp_path / "s")
    execute([c.cfg for c in cells], store, progress=False)
    md = write_report(store, exp, cells, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "continuation.png").exists() and (out / "table.md").read_text() == md
    assert "**Verdict" in md and "Spearman" in md and "forced_zero's zero-gate gradient" in md
    for col, row in (("assoc_recall", "posthoc"), ("linear_icl", "fade600")):
        assert f"| {col} | {row} |" in md
    import pandas as pd
    post = pd.read_csv(out / "continuation_assoc_recall_posthoc_seed0.csv")
    unf = pd.read_csv(out / "continuation_assoc_recall_unforced_seed0.csv")
    fz = pd.read_csv(out / "continuation_assoc_recall_forced_zero_seed0.csv")
    assert list(unf["step"]) == [0, 15, 30] and list(post["step"]) == [30, 45, 60]  # after its parent's 30 steps
    # the continuation starts from the unforced run's final weights: same zero-gate gradient, same circuit
    assert post["share"][0] == pytest.approx(unf["share"][2], rel=1e-6)
    assert post["grad_norm"][0] == pytest.approx(unf["grad_norm"][2], rel=1e-6)
    # learned gates move (a tangent per interval); g = 0 throughout: nothing to track
    assert unf["tracking_cos"][:2].notna().all() and fz["tracking_cos"].isna().all() and post["tracking_cos"].isna().all()
    # a second report reads the traces back from the store's cache: the same table, to the last digit,
    # without computing them again
    import softprior.analysis.continuation.traces as cont
    assert len(list((tmp_path / "s" / "analysis_cache").glob("continuation_*.csv"))) == len(cells)
    def boom(*a, **k):
        raise AssertionError("recomputed a cached trace")
    orig, origs = cont.continuation_trace, cont.continuation_traces
    cont.continuation_trace = cont.continuation_traces = boom
    try:
        assert write_report(store, exp, cells, tmp_path / "out2") == md
    finally:
        cont.continuation_trace, cont.continuation_traces = orig, origs
    # and the cache keeps every bit: one run's trace computed, then read back
    from softprior.analysis.reports import _cached_traces
    c = next(c for c in cells if c.row == "unforced")
    kw = dict(n_examples=32, damping=1e-3, max_iter=5, method="minres", step_offset=0)
    computed = _cached_traces(store, [(c.cfg, [(0, 1)], kw)])[0]
    assert not computed.empty
    pd.testing.assert_frame_equal(_cached_traces(store, [(c.cfg, [(0, 1)], kw)])[0], computed, check_exact=True)
    # a run trained again (same run id, other weights: here its files' recorded checksums change) is
    # not served the old trace
    calls = []
    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    from softprior.training.loop import train
    res = train(c.cfg)
    res.state_dict = {k: v + 1e-3 for k, v in res.state_dict.items()}
    res.snapshots = [(st, {k: v + 1e-3 for k, v in w.items()}) for st, w in res.snapshots]
    store.save_result(res)
    cont.continuation_trace = counting
    try:
        again = _cached_traces(store, [(c.cfg, [(0, 1)], kw)])[0]
    finally:
        cont.continuation_trace = orig
    assert calls == [1] and not again["grad_norm"].equals(computed["grad_norm"])


# ------------------------------------------------------------------------------------ known answers (issue 28)
# Traces over planted snapshots whose tangent direction and solution cosine are known in sign and size,
# from quantities computed here independently (plain autograd and finite differences, float64). They
# hold for any correct tangent solver and curvature: at a damping far above the curvature's scale,
# t = -(K + lambda I)^{-1} A_w = -A_w / lambda (1 + O(||K|| / lambda)) for any K (Hessian, Gauss-Newton).
def _planted(cfg, theta0: dict, direction: torch.Tensor, c: float) -> dict:
    """A snapshot: ``theta0`` moved by ``c`` along the unit vector of ``direction`` (flat, the trace's layout)."""
    model = build_model(cfg)
    model.load_state_dict(theta0)
    return {k: v.detach().clone() for k, v in _shifted(model, direction / direction.norm(), c).state_dict().items()}


def _trace_batch(cfg, n):
    return cfg.validation_batch(make_task(cfg.task), n=n)


def test_trace_tangent_points_where_the_planted_change_goes():
    cfg = make_run_config("assoc_recall", "fade10", steps=30)  # gate 0.5 until step 10, then falling
    model = build_model(cfg)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    task, batch = make_task(cfg.task), _trace_batch(cfg, 32)
    m64 = build_model(cfg).double()
    m64.load_state_dict(theta0)
    # A along both gates at g = 0.5, by a central difference of the plain gradient (float64)
    g0, eps = 0.5, 1e-5
    a11 = (_grad(m64, task, batch, g0 + eps, g0 + eps) - _grad(m64, task, batch, g0 - eps, g0 - eps)) / (2 * eps)
    dg = path_gates(cfg.path, 20, cfg.total_steps)[0] - g0  # the fade's gate change from step 10 to 20
    assert dg < 0
    a_w = dg * a11  # d/d delta grad L(theta, g0 + delta (dg, dg)): the mixed derivative along the path's change
    lam, c = 1e4, 1.0  # a damping far above the curvature: t = -A_w / lambda to O(||K|| / lambda)
    kw = dict(n_examples=32, damping=lam, max_iter=10)
    for sign in (1.0, -1.0):  # planted along -A_w (the optimum's motion), then against it
        after = _planted(cfg, theta0, -sign * a_w.float(), c)
        df = continuation_trace([(10, theta0), (20, after)], cfg, [(0, 0)], **kw)
        assert df["dg_pos"][0] == pytest.approx(dg) and df["dg_content"][0] == pytest.approx(dg)
        assert df["tracking_cos"][0] == pytest.approx(sign, abs=1e-3)
        # ||t|| / ||theta' - theta|| = (||A_w|| / lambda) / c
        assert df["norm_ratio"][0] == pytest.approx(float(a_w.norm()) / (lam * c), rel=1e-2)
        assert math.isnan(df["tracking_cos"][1])
    # the tangent itself, by the public solver with the trace's settings, is -A_w / lambda
    t = optimum_tangent(model, task, batch, gate=(g0, g0), direction=(dg, dg), damping=lam, max_iter=10)
    cos = float(t.tangent.double() @ -a_w) / float(t.tangent.double().norm() * a_w.norm())
    assert cos == pytest.approx(1.0, abs=1e-3)


def test_trace_solution_cosine_is_the_planted_angle():
    cfg = make_run_config("assoc_recall", "fade10", steps=30)  # the gate is flat over 0..10: no tangent
    model = build_model(cfg)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    task, batch = make_task(cfg.task), _trace_batch(cfg, 32)
    m64 = build_model(cfg).double()
    m64.load_state_dict(theta0)
    g = _grad(m64, task, batch, 0.0, 0.0)  # the zero-gate gradient at theta0
    g = g / g.norm()
    r = torch.randn(g.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u = r - (r @ g) * g  # orthogonal to the gradient
    u = u / u.norm()
    for move, want in ((-g, 1.0), (g, -1.0), (-(g + u), 1 / math.sqrt(2)), (u - g * math.sqrt(3), math.sqrt(3) / 2)):
        final = _planted(cfg, theta0, move.float(), 1.0)  # the run ends at theta0 + move (unit length)
        df = continuation_trace([(0, theta0), (10, final)], cfg, [(0, 0)], n_examples=32)
        assert df["solution_cos"][0] == pytest.approx(want, abs=1e-4), want
        assert math.isnan(df["solution_cos"][1])  # the last snapshot is where the run ends
        assert df["tracking_cos"].isna().all()  # the gate did not move
