"""The optimum tangent's linear system and its solver (softprior.analysis.continuation, "The
tangent's system"): the tangent the library returns at its defaults against a dense solve of the
same system on a tiny model, the Gauss-Newton product against a Jacobian built here, the damping
pair, the convergence flag, and the report reading it.

Every dense matrix here is built by the test itself (torch.autograd.functional on the model's
loss), in float64."""

import math

import pandas as pd
import pytest
import torch

from softprior.analysis.continuation.core import MAX_ITER, REL_DAMPING, TOL, _cg_shifts
from softprior.analysis.continuation.model import model_second_order, optimum_tangent
from softprior.analysis.continuation.traces import continuation_trace
from softprior.config import make_run_config
from softprior.tasks.generators import make_task
from softprior.model.transformer import build_model
from softprior.training.loop import train


@pytest.fixture(scope="module")
def tiny():
    """A 464-parameter base-architecture model (1 layer, 2 heads, d_model 8) after 40 steps of an
    unforced run, in float64, with a fixed batch of 16 examples: a snapshot away from any minimum."""
    cfg = make_run_config("assoc_recall", "unforced", steps=40, calibrated=False,
                          task_options=dict(vocab=12, n_pairs=3, n_keys=4),
                          model_options=dict(d_model=8, n_heads=2, n_layers=1, n_ctx=8, content_rank=2),
                          batch_size=16, eval_every=20, n_val=32)
    res = train(cfg)
    model = build_model(cfg)
    model.load_state_dict(res.state_dict)
    model = model.double()
    task = make_task(cfg.task)
    batch = task.sample(16, cfg.model.n_ctx, torch.Generator().manual_seed(5))
    return cfg, model, task, batch


@pytest.fixture(scope="module")
def dense(tiny):
    """(H, G, A) at g = 0.5 on both gates, moved together, built here without the library: the loss
    through ``functional_call`` on the flat parameters (all but the gate logits); H by
    autograd.functional.hessian; G = J^T H_z J from the Jacobian of the outputs and the Hessian of the
    loss in the outputs; A = d/dg grad_theta L by autograd of dL/dg (Schwarz)."""
    from torch.func import functional_call
    _, model, task, batch = tiny
    named = [(n, p) for n, p in model.named_parameters() if n != "gate_logits"]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    L, H_ = model.cfg.n_layers, model.cfg.n_heads
    pos = task.loss_positions(batch.inputs.shape[1])

    def out_fn(th, d):
        params, o = {}, 0
        for n, p in named:
            params[n] = th[o:o + p.numel()].view_as(p)
            o += p.numel()
        g = torch.full((L, H_), 0.5, dtype=torch.float64) + d
        return functional_call(model, params, (batch.inputs,), dict(gate_pos=g, gate_content=g, positions=pos),
                               strict=False)

    def out_loss(z):
        return task.loss(z, batch.targets)
    zero = torch.zeros((), dtype=torch.float64)
    H = torch.autograd.functional.hessian(lambda th: out_loss(out_fn(th, zero)), theta)
    out0 = out_fn(theta, zero).detach()
    J = torch.autograd.functional.jacobian(lambda th: out_fn(th, zero).reshape(-1), theta)  # [m, n]
    Hz = torch.autograd.functional.hessian(lambda z: out_loss(z.view(out0.shape)), out0.reshape(-1))  # [m, m]
    G = J.T @ Hz @ J
    th, d = theta.clone().requires_grad_(True), zero.clone().requires_grad_(True)
    dl_dg = torch.autograd.grad(out_loss(out_fn(th, d)), d, create_graph=True)[0]
    A = torch.autograd.grad(dl_dg, th)[0]
    return (H + H.T) / 2, (G + G.T) / 2, A


def _cos(a, b):
    return float(a @ b) / float(a.norm() * b.norm())


def test_the_tangent_at_the_defaults_equals_a_dense_solve_of_its_system(tiny, dense):
    """At its defaults the library's tangent is the solution of the system it names, to cosine
    0.999 and the stated tolerance (the former defaults, the Hessian by 30 MINRES products, gave
    cosine 0.02 with its own dense solution here)."""
    _, model, task, batch = tiny
    H, G, A = dense
    n = A.numel()
    assert int((torch.linalg.eigvalsh(H) < 0).sum()) > n // 4  # the Hessian is strongly indefinite here
    t = optimum_tangent(model, task, batch, gate=0.5)
    K = G if getattr(t, "curvature", "hessian") == "ggn" else H
    eye = torch.eye(n, dtype=torch.float64)
    want = -torch.linalg.solve(K + t.damping * eye, A)
    assert _cos(t.tangent, want) >= 0.999
    assert float((t.tangent - want).norm() / want.norm()) <= 0.01
    # the reported residual is the dense system's, and within the tolerance the tangent states
    rel = float((K @ t.tangent + t.damping * t.tangent + A).norm() / A.norm())
    assert rel == pytest.approx(t.rel_residual, rel=1e-6, abs=1e-12)
    assert t.converged and t.rel_residual <= t.tol and t.iterations < t.products
    # the damping is REL_DAMPING x the largest curvature on the Krylov space of A: at most G's top eigenvalue
    top = float(torch.linalg.eigvalsh(G)[-1])
    assert 0.9 * top <= t.curvature_scale <= top * (1 + 1e-9)
    assert t.damping == pytest.approx(REL_DAMPING * t.curvature_scale) and t.rel_damping == REL_DAMPING
    # deterministic: the same tangent to the bit
    assert torch.equal(optimum_tangent(model, task, batch, gate=0.5).tangent, t.tangent)


def test_gauss_newton_product_is_jt_hz_j_and_positive_semidefinite(tiny, dense):
    _, model, task, batch = tiny
    _, G, _ = dense
    so = model_second_order(model, task, batch, gate=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        v = torch.randn(G.shape[0], generator=gen, dtype=torch.float64)
        assert torch.allclose(so.ggnvp(v), G @ v, rtol=1e-9, atol=1e-12 * float((G @ v).abs().max()))
    ev = torch.linalg.eigvalsh(G)
    assert float(ev[0]) >= -1e-10 * float(ev[-1]) and float(ev[-1]) > 0


def test_damping_pair_is_the_cosine_of_the_two_dense_solutions(tiny, dense):
    """``damping_cos`` = cos(t(lambda), t(10 lambda)), both from one Krylov space, against two dense
    solves; and CG at one shift equals the multi-shift solution (the pair costs no product)."""
    _, model, task, batch = tiny
    _, G, A = dense
    eye = torch.eye(A.numel(), dtype=torch.float64)
    lam = 1e-2
    t = optimum_tangent(model, task, batch, gate=0.5, damping=lam)
    d1, d10 = -torch.linalg.solve(G + lam * eye, A), -torch.linalg.solve(G + 10 * lam * eye, A)
    assert t.pair_damping == pytest.approx(10 * lam)
    assert t.damping_cos == pytest.approx(_cos(d1, d10), abs=1e-6)
    assert t.damping_cos < 0.999  # the damping matters here: the pair says so
    single = optimum_tangent(model, task, batch, gate=0.5, damping=lam, pair_factor=None)
    assert math.isnan(single.damping_cos) and single.products == t.products
    assert torch.allclose(single.tangent, t.tangent, rtol=0, atol=1e-12 * float(t.tangent.abs().max()))


def test_multishift_cg_solves_every_shift():
    gen = torch.Generator().manual_seed(0)
    n = 60
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    ev = torch.cat([torch.zeros(20, dtype=torch.float64), torch.logspace(-2, 1, 40, dtype=torch.float64)])
    M = q @ torch.diag(ev) @ q.T  # singular, positive semi-definite
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    shifts = [1e-2, 1e-1, 1.0]
    xs, its, neg = _cg_shifts(lambda v: M @ v, b, shifts, 500, 1e-12)
    assert not neg and its[0] >= its[1] >= its[2] > 0
    for s, x in zip(shifts, xs):
        want = torch.linalg.solve(M + s * torch.eye(n, dtype=torch.float64), b)
        assert float((x - want).norm() / want.norm()) < 1e-9


def test_an_unconverged_tangent_says_so(tiny, dense):
    _, model, task, batch = tiny
    H, G, A = dense
    t = optimum_tangent(model, task, batch, gate=0.5, max_iter=3)
    assert t.iterations == 3 and not t.converged and t.rel_residual > t.tol
    # the Hessian at the former defaults: MINRES's residual looked acceptable, the tangent was not converged
    old = optimum_tangent(model, task, batch, gate=0.5, curvature="hessian", method="minres", max_iter=30,
                            pair_factor=None)
    eye = torch.eye(A.numel(), dtype=torch.float64)
    assert not old.converged and _cos(old.tangent, -torch.linalg.solve(H + 1e-3 * eye, A)) < 0.5
    with pytest.raises(ValueError, match="unknown curvature"):
        optimum_tangent(model, task, batch, gate=0.5, curvature="fisher")


def test_trace_reports_the_solver_per_snapshot():
    cfg = make_run_config("assoc_recall", "fade10", steps=30, snapshot_every=10, eval_every=10, n_val=32,
                          batch_size=16)
    res = train(cfg)
    short = continuation_trace(res.snapshots, cfg, [(0, 0)], n_examples=16, max_iter=3)
    moving = short["tracking_cos"].notna()
    assert list(moving) == [False, True, True, False]
    assert not short["converged"][moving].any() and short["converged"][~moving].all()
    # the damping: REL_DAMPING x the snapshot's curvature scale, reported per snapshot
    assert (short["curvature_scale"][moving] > 0).all()
    assert short["damping"][moving].to_list() == pytest.approx(list(REL_DAMPING * short["curvature_scale"][moving]))
    assert short["damping"][~moving].isna().all()
    assert short["damping_cos"][moving].between(-1, 1).all() and (short["cg_iters"][moving] == 3).all()
    # at the defaults the same snapshots converge (stated tolerance, residual recomputed)
    full = continuation_trace(res.snapshots, cfg, [(0, 0)], n_examples=16)
    assert full["converged"].all() and (full["rel_residual"][moving] <= TOL).all()
    assert (full["cg_iters"][moving] < MAX_ITER).all()
    pd.testing.assert_series_equal(full["damping"], short["damping"])


def _row(path, track, converged, share, col="assoc_recall"):
    return {"col": col, "row": path, "metric": "acc", "share": [share], "zero": [share], "solution_cos": [0.1],
            "control": [0.01], "tracking": track, "converged": converged}


def test_claims_from_unconverged_tangents_are_inconclusive():
    from softprior.analysis.reports import _continuation_verdict, continuation_claims_table
    rows = [_row("fade600", [0.9], [True, True], 0.5), _row("hard_switch1050", [0.1], [True, False], 0.3),
            _row("forced_zero", [float("nan")], [], 0.1)]
    t = continuation_claims_table(rows).set_index(["row", "column"])
    assert t.loc[("fade600", "assoc_recall tangents converged"), "mean"] == 1.0
    assert t.loc[("hard_switch1050", "assoc_recall tangents converged"), "mean"] == 0.5
    # a tracking cosine is only a number where every tangent behind it converged
    assert t.loc[("fade600", "assoc_recall tracking cos"), "mean"] == pytest.approx(0.9)
    assert math.isnan(t.loc[("hard_switch1050", "assoc_recall tracking cos"), "mean"])
    assert math.isnan(t.loc[("forced_zero", "assoc_recall tangents converged"), "mean"])  # no tangent
    v = _continuation_verdict(rows)
    assert "**inconclusive**" in v and "1 of 4" in v
    ok = _continuation_verdict([_row("fade600", [0.9], [True], 0.5), _row("hard_switch1050", [0.1], [True], 0.3),
                                _row("forced_zero", [float("nan")], [], 0.1)])
    assert "inconclusive" not in ok and "**yes**" in ok


def test_the_report_keys_its_trace_cache_on_the_tangent_settings(tiny, tmp_path, monkeypatch):
    """The report passes the curvature and tolerance into the trace settings (and so into the cache
    key): a trace measured with another quantity is not read back."""
    from softprior.analysis import reports
    from softprior.cells import Cell
    cfg = tiny[0]

    class Store:
        root = tmp_path

        def is_done(self, run_id):
            return True

        def load_model(self, run_id):
            return cfg, build_model(cfg)

        def file_checksums(self, run_id):
            return {}
    seen = []
    monkeypatch.setattr(reports, "_cached_traces", lambda store, jobs, workers=1: seen.extend(jobs) or
                        [pd.DataFrame() for _ in jobs])
    reports.continuation_report(Store(), [Cell(cfg, row="unforced")], tmp_path, n_examples=8)
    (_, _, kw), = seen
    assert kw["curvature"] == "ggn" and kw["tol"] == TOL and kw["method"] == "cg"
    assert kw["rel_damping"] == REL_DAMPING and kw["damping"] is None
    f = reports._trace_file(Store(), cfg, [(0, 0)], kw)
    assert reports._trace_file(Store(), cfg, [(0, 0)], {**kw, "curvature": "hessian"}) != f
    assert reports._trace_file(Store(), cfg, [(0, 0)], {**kw, "tol": 1e-3}) != f
    assert reports._trace_file(Store(), cfg, [(0, 0)], {**kw, "rel_damping": 1e-2}) != f
