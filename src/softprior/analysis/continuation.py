"""The paper's continuation argument (Section 3.3 of arXiv 2609.10287), measured.

Write L(theta, g) for the training loss of the parameters theta at gate value g (the prior's
strength). Two quantities carry the paper's explanation of why a slow fade keeps a circuit and an
abrupt switch or a from-scratch NoPE run does not.

1. **Optimum tracking.** If theta*(g) is a stationary point for every g near g0,
   grad_theta L(theta*(g), g) = 0; differentiating in g (the implicit function theorem, as in
   numerical continuation: Allgower & Georg 1990, *Introduction to Numerical Continuation Methods*,
   ch. 2; the paper's Section 3.3) gives

       H_g dtheta*/dg + A_g = 0,   so   dtheta*/dg = -H_g^{-1} A_g,
       H_g = grad^2_theta L(theta, g)                  (the Hessian in theta),
       A_g = grad^2_{theta g} L(theta, g) = d/dg grad_theta L(theta, g)   (the mixed derivative).

   A path that tracks the optimum moves its parameters, over a gate change dg, along
   t * dg with t = dtheta*/dg; ``tracking_cosine`` compares that with the change the path actually
   made between two snapshots. What is measured is the damped Gauss-Newton form of t (below, "The
   tangent's system"): the Hessian's stationary point is a saddle at a snapshot that is still learning.

2. **Recovery signal.** When the prior is removed at theta_prior, what drives the zero-gate model
   towards the circuit is the zero-gate gradient restricted to the circuit's parameters:

       r = || P_C grad_theta L(theta_prior, 0) ||,

   P_C the orthogonal projection onto the subspace C of the circuit's parameters. The paper's claim:
   from scratch (forced_zero in discrete retrieval) this gradient is small and symmetric on C; a
   prior-trained state supplies a useful one; in linear ICL it is not needed.

How each is computed (no Hessian is ever formed):

- ``H v`` by double-backward autograd (Pearlmutter 1994, "Fast exact multiplication by the Hessian"):
  one reverse pass builds grad_theta L with its graph, and every product is
  H v = grad_theta (grad_theta L . v), a second reverse pass through that graph.
- ``A_g`` by symmetry of mixed partial derivatives (Schwarz): d/dg grad_theta L = grad_theta (dL/dg),
  one more reverse pass from the scalar dL/dg.
- ``G v`` (the generalised Gauss-Newton matrix G = J^T H_z J, J = d outputs / d theta, H_z the
  Hessian of the loss in the outputs; Schraudolph 2002, Martens 2010) by the double-vjp trick for
  J v, a double backward through the loss alone for H_z, and one reverse pass for J^T
  (``SecondOrder.ggnvp``), about the cost of an H-vector product.

The tangent's system (what ``optimum_tangent`` and the trace measure, and why). The implicit function
theorem's H_g^{-1} A_g is the motion of a *stationary point*; at the snapshots of a run that is still
learning H_g is strongly indefinite, so the stationary point it follows is a saddle the path is not
on, and (H_g + lambda I) t = -A_g is ill posed at a small damping. On the tiny model of
``tests/test_continuation_solver.py`` (464 parameters after 40 steps, g = 0.5, float64, dense) H has
eigenvalues from -3.4 to 7.3, 227 of them negative; MINRES at the former defaults (lambda = 1e-3, 30
products) returned a tangent with cosine 0.02 with the dense solution while its relative residual
(0.27) looked acceptable (0.085 after 300 products, cosine 0.15); only lambda ~ 1, where the damping
dominates, converges, and there the direction turns with the damping (cosine -0.02 between the
solutions at lambda = 1 and 10). The trace therefore measures the damped Gauss-Newton tangent

       t = -(G_g + lambda I)^{-1} A_g,    lambda = 1e-3 x kappa_s   (``REL_DAMPING``),

A_g the exact mixed derivative, kappa_s the largest curvature G shows on the Krylov space of A_g at
the snapshot (the largest Ritz value after ``LANCZOS_STEPS`` = 10 Lanczos steps from A_g,
``_lanczos_max``; from below, and within a fraction of a percent of the top eigenvalue in our
checks). G is positive semi-definite at every theta (the loss is convex in the outputs:
cross-entropy, squared error), so G + lambda I is positive definite for every lambda > 0 and the
system is well posed at any snapshot; at a minimum with a perfect fit G equals H. It is the curvature
of the loss with the network linearised around the snapshot, so t is the tangent of the optimum of
that local, damped model, theta*(g) = argmin_theta L_lin(theta, g) + lambda/2 ||theta - theta_s||^2:
the response that influence-function work uses for networks away from a minimum (Koh & Liang 2017;
Bae et al. 2022, "If influence functions are the answer, then what is the question?": the damped
Gauss-Newton response is the proximal Bregman response function). Why this damping: relative to the
curvature the solver meets, the condition number of G + lambda I on that space is at most about
1 + 1 / REL_DAMPING = 1001 at every snapshot, so CG reaches the tolerance in a bounded number of
products (about sqrt(1001)/2 ln(2/tol) ~ 160 in exact arithmetic; 46-113 measured), where a fixed
lambda = 1e-3 was 1e-4 of the curvature on one snapshot and 2e-5 on another, and missed the
tolerance in 500 products there; and the tangent does not change when the loss is rescaled. It is
solved by conjugate gradients (``_cg_shifts``) to the relative residual
||(G + lambda I) t + A|| / ||A|| <= 1e-4 (``TOL``), in at most ``MAX_ITER`` = 500 products; the
residual is recomputed from t with one more product, and ``Tangent.converged`` records whether it
meets the tolerance. The same Krylov space gives, for no further product, the solution at
10 lambda: ``Tangent.damping_cos`` = cos(t(lambda), t(10 lambda)) says how much the direction depends
on the damping (0.91-0.96 on the snapshots we checked: the damping is part of the quantity, and the
trace reports it). A tangent that did not converge is reported as such (the trace's ``converged``
column), and a claim computed from it is inconclusive (``analysis.reports``). The Hessian remains
available (``curvature="hessian"``, with MINRES for an indefinite H, Paige & Saunders 1975, or CG,
which flags non-positive curvature in ``Tangent.negative_curvature``), an absolute ``damping`` may be
given instead of the relative one, and a generic ``loss_fn`` closure has only the Hessian.
docs/CONTINUATION.md says the same for readers of the results.

Conventions of the model wrappers (``model_output``, ``model_loss``, ``recovery_signal``, ``optimum_tangent``):

- theta is every parameter of the model except ``gate_logits``: the gates are the external variable
  g. A learned gate is evaluated at the model's own value sigmoid(logit) and held there.
- The gate variable is a scalar delta moving both gates along a ``direction`` (w_pos, w_content):
  g_pos = g_pos0 + delta w_pos, g_content = g_content0 + delta w_content, derivatives at delta = 0.
  The default direction (1, 1) is "g applied to both gates" (every path of the paper moves both
  together); (1, 0) differentiates in the position gate alone. The loss is the task's training loss
  (``task.loss`` at ``task.loss_positions``) on one fixed batch, through the readable
  ``SoftPriorTransformer`` (the fast path's hand-written backwards are first order only).
- The circuit subspace C (``circuit_mask``) is a coordinate subspace: by default the query, key and
  value rows of ``in_proj`` and the matching columns of ``out_proj`` of a list of (layer, head)
  pairs (4 d_model d_head coordinates per head), the heads found by ``circuit_heads``: zero-gate
  mean-ablation importance (``ablation_importance``, the mechanism traces' (ii)) of at least 0.03, at most half
  of all heads, at least the top head. An explicit boolean mask, a list of parameter names or a
  {name: bool tensor} dict are accepted too.
- The control is a random coordinate subspace of the same dimension k (seeded), drawn uniformly from
  the coordinates the zero-gate loss depends on (``zero_gate_mask``: everything but the prior's own
  parameters B^pos and the content factors U, W, whose zero-gate gradient is exactly 0); its share
  is averaged over ``n_control`` draws. For a gradient spread evenly over those n coordinates the
  expected share is about sqrt(k / n) (``RecoverySignal.expected_share``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..model.transformer import SoftPriorTransformer

__all__ = ["ParamLayout", "SecondOrder", "second_order", "solve_damped", "Tangent", "optimum_tangent_fn",
           "RecoverySignal", "project_norm", "recovery_signal_fn", "model_output", "model_loss",
           "model_second_order", "CURVATURES",
           "circuit_mask", "circuit_heads", "zero_gate_mask", "recovery_signal", "optimum_tangent",
           "tracking_cosine", "solution_cosine", "continuation_trace", "removal_step", "path_gates"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (theta [n], delta 0-d) -> scalar loss
CURVATURES = ("ggn", "hessian")
# the tangent as the continuation trace measures it (module docstring, "The tangent's system")
REL_DAMPING, LANCZOS_STEPS, TOL, MAX_ITER, PAIR_FACTOR = 1e-3, 10, 1e-4, 500, 10.0
_STOP_MARGIN = 0.5  # the solvers stop at half the tolerance: the recomputed residual then meets it


# ------------------------------------------------------------------------------------ the generic core
class SecondOrder:
    """Derivatives of ``loss_fn(theta, g)`` at one point, sharing one autograd graph.

    ``grad`` = grad_theta L, ``mixed`` = A = d/dg grad_theta L = grad_theta (dL/dg) (Schwarz),
    ``hvp(v)`` = H v = grad_theta (grad_theta L . v) (Pearlmutter 1994). Products reuse the graph, so
    each costs one double-backward pass and no forward.

    Given the loss as ``output_loss(output_fn(theta, g))`` (the network's outputs z, then a loss
    convex in z: cross-entropy, squared error), ``ggnvp(v)`` = G v, the generalised Gauss-Newton
    matrix G = J^T H_z J (J = dz/dtheta, H_z = d^2 loss/dz^2; Schraudolph 2002, Martens 2010),
    positive semi-definite wherever theta is: J v by the double-vjp trick (J v = d/du (J^T u) . v, u a
    dummy cotangent, one double-backward pass), H_z (J v) by a double backward through the loss
    alone (cheap: it sees only z), then J^T (H_z J v) by one reverse pass. ``loss_fn`` may then be
    None."""

    def __init__(self, loss_fn: LossFn | None, theta: torch.Tensor, g=0.0, output_fn=None, output_loss=None):
        if (output_fn is None) != (output_loss is None):
            raise ValueError("give output_fn and output_loss together (the loss is output_loss(output_fn(theta, g)))")
        if loss_fn is None and output_fn is None:
            raise ValueError("give loss_fn, or output_fn and output_loss")
        self.theta = theta.detach().clone().requires_grad_(True)
        self.g = torch.as_tensor(g, dtype=theta.dtype, device=theta.device).detach().clone().requires_grad_(True)
        self._out = None
        self._output_loss = output_loss
        with torch.enable_grad():
            if output_fn is not None:
                self._out = output_fn(self.theta, self.g)
                self.loss = output_loss(self._out)
            else:
                self.loss = loss_fn(self.theta, self.g)
            g_theta, g_g = torch.autograd.grad(self.loss, (self.theta, self.g), create_graph=True, allow_unused=True)
        self._g_theta = g_theta if g_theta is not None else torch.zeros_like(self.theta)
        self.grad = self._g_theta.detach()
        if g_g is not None and g_g.requires_grad:
            a = torch.autograd.grad(g_g, self.theta, retain_graph=True, allow_unused=True)[0]
        else:  # the loss does not depend on g, or dL/dg does not depend on theta
            a = None
        self.mixed = a.detach() if a is not None else torch.zeros_like(self.theta)
        self.n_products = 0
        self._ggn = None  # (u, J^T u, z, grad_z loss): built on the first G-vector product

    @property
    def has_ggn(self) -> bool:
        """Whether ``ggnvp`` is available (the loss was given as outputs and an output loss)."""
        return self._out is not None

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        """H v (one double-backward pass through the stored graph)."""
        self.n_products += 1
        if not self._g_theta.requires_grad:  # a loss linear in theta: H = 0
            return torch.zeros_like(self.theta)
        out = torch.autograd.grad(self._g_theta, self.theta, grad_outputs=v.to(self.theta.dtype),
                                  retain_graph=True, allow_unused=True)[0]
        return out.detach() if out is not None else torch.zeros_like(self.theta)

    def ggnvp(self, v: torch.Tensor) -> torch.Tensor:
        """G v = J^T H_z J v, the generalised Gauss-Newton product (class docstring)."""
        if self._out is None:
            raise ValueError("the Gauss-Newton product needs the loss as output_loss(output_fn(theta, g))")
        self.n_products += 1
        if not self._out.requires_grad:  # outputs independent of theta: J = 0
            return torch.zeros_like(self.theta)
        if self._ggn is None:
            with torch.enable_grad():
                u = torch.zeros_like(self._out, requires_grad=True)
                jtu = torch.autograd.grad(self._out, self.theta, grad_outputs=u, create_graph=True,
                                          allow_unused=True)[0]
                z = self._out.detach().requires_grad_(True)
                gz = torch.autograd.grad(self._output_loss(z), z, create_graph=True)[0]
            self._ggn = (u, jtu, z, gz)
        u, jtu, z, gz = self._ggn
        if jtu is None or not jtu.requires_grad:
            return torch.zeros_like(self.theta)
        jv = torch.autograd.grad(jtu, u, grad_outputs=v.to(self.theta.dtype), retain_graph=True, allow_unused=True)[0]
        if jv is None:
            return torch.zeros_like(self.theta)
        hjv = torch.autograd.grad(gz, z, grad_outputs=jv, retain_graph=True, allow_unused=True)[0] \
            if gz.requires_grad else None
        if hjv is None:  # an output loss linear in z: H_z = 0
            return torch.zeros_like(self.theta)
        out = torch.autograd.grad(self._out, self.theta, grad_outputs=hjv, retain_graph=True, allow_unused=True)[0]
        return out.detach() if out is not None else torch.zeros_like(self.theta)

    def product(self, curvature: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The curvature-vector product: ``hvp`` for "hessian", ``ggnvp`` for "ggn"."""
        if curvature not in CURVATURES:
            raise ValueError(f"unknown curvature {curvature!r}; allowed: {', '.join(CURVATURES)}")
        return self.ggnvp if curvature == "ggn" else self.hvp


def second_order(loss_fn: LossFn, theta: torch.Tensor, g=0.0) -> SecondOrder:
    """``SecondOrder(loss_fn, theta, g)``: grad, A_g and H-vector products of L at (theta, g)."""
    return SecondOrder(loss_fn, theta, g)


def _cg(op, b, max_iter, tol):
    """Conjugate gradients for op(x) = b from x = 0 (Hestenes & Stiefel 1952; Nocedal & Wright 2006,
    Algorithm 5.2). Returns (the iterate with the smallest recurrence residual, iterations, whether a
    direction with p^T op(p) <= 0 was met)."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = torch.dot(r, r)
    bnorm = float(rs.sqrt())
    best, best_norm, neg, it = x.clone(), bnorm, False, 0
    if bnorm == 0.0:
        return best, 0, False
    for k in range(max_iter):
        Ap = op(p)
        pAp = torch.dot(p, Ap)
        if float(pAp) <= 0.0:
            neg = True
            if float(pAp) == 0.0:
                break
        alpha = rs / pAp
        x = x + alpha * p
        r = r - alpha * Ap
        rs_new = torch.dot(r, r)
        it = k + 1
        rn = float(rs_new.sqrt())
        if rn < best_norm:
            best, best_norm = x.clone(), rn
        if rn <= tol * bnorm:
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    return best, it, neg


def _minres(op, b, max_iter, tol):
    """MINRES for a symmetric (possibly indefinite) op(x) = b from x = 0 (Paige & Saunders 1975; the
    unpreconditioned recurrence of SciPy's ``minres``). Returns (x, iterations, False)."""
    x = torch.zeros_like(b)
    beta1 = float(torch.linalg.vector_norm(b))
    if beta1 == 0.0:
        return x, 0, False
    r1, r2, y = b.clone(), b.clone(), b.clone()
    oldb, beta, dbar, epsln, phibar = 0.0, beta1, 0.0, 0.0, beta1
    cs, sn = -1.0, 0.0
    w, w2 = torch.zeros_like(b), torch.zeros_like(b)
    tiny = torch.finfo(b.dtype).eps
    it = 0
    for itn in range(1, max_iter + 1):
        v = y / beta
        y = op(v)
        if itn >= 2:
            y = y - (beta / oldb) * r1
        alfa = float(torch.dot(v, y))
        y = y - (alfa / beta) * r2
        r1, r2 = r2, y
        oldb, beta = beta, float(torch.linalg.vector_norm(r2))
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = max(math.hypot(gbar, beta), tiny)
        cs, sn = gbar / gamma, beta / gamma
        phi, phibar = cs * phibar, sn * phibar
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) / gamma
        x = x + phi * w
        it = itn
        if phibar <= tol * beta1 or beta <= tiny * beta1:
            break
    return x, it, False


def _cg_shifts(op, b, shifts, max_iter, tol):
    """Multi-shift conjugate gradients: (op + s I) x_s = b for every shift s from x_s = 0, in one Krylov
    space (K_k(op + s I, b) = K_k(op, b), so one product per iteration serves every shift; Jegerlehner
    1996, "Krylov space solvers for shifted linear systems", hep-lat/9612014; Frommer 2003). The
    first shift is the base system, CG as in ``_cg`` (Nocedal & Wright 2006, Algorithm 5.2); a shifted
    system's residual is collinear with the base's, r_s = zeta_s r, and its iterate follows from the
    base's alpha, beta and zeta_s. The first shift must be the smallest (the slowest to converge);
    each system stops (its iterate frozen) once its recurrence residual is <= tol ||b||, all stop when
    the base does or after ``max_iter`` products. Returns (iterates, iterations per system, whether a
    direction with p^T (op + s_0 I) p <= 0 was met)."""
    shifts = [float(s) for s in shifts]
    if any(s < shifts[0] for s in shifts):
        raise ValueError(f"the first shift must be the smallest, got {shifts}")
    m, s0 = len(shifts), shifts[0]
    xs = [torch.zeros_like(b) for _ in shifts]
    its = [0] * m
    bnorm = float(torch.linalg.vector_norm(b))
    if bnorm == 0.0:
        return xs, its, False
    r, p = b.clone(), b.clone()
    ps = [b.clone() for _ in shifts]
    zeta, zeta_old = [1.0] * m, [1.0] * m
    active = [True] * m
    rs = float(torch.dot(r, r))
    alpha_old, beta_old, neg = 1.0, 0.0, False
    for k in range(max_iter):
        Ap = op(p) + s0 * p
        pAp = float(torch.dot(p, Ap))
        if pAp <= 0.0:  # not positive definite along p (an indefinite Hessian): CG is still defined if != 0
            neg = True
            if pAp == 0.0:
                break
        alpha = rs / pAp
        r = r - alpha * Ap
        rs_new = float(torch.dot(r, r))
        beta = rs_new / rs
        for j in range(m):
            if not active[j]:
                continue
            if j == 0:
                z_new = 1.0
            else:
                den = (alpha_old * zeta_old[j] * (1.0 + alpha * (shifts[j] - s0))
                       + alpha * beta_old * (zeta_old[j] - zeta[j]))
                if den == 0.0 or zeta[j] == 0.0:
                    active[j] = False
                    continue
                z_new = zeta[j] * zeta_old[j] * alpha_old / den
            xs[j] = xs[j] + (alpha * z_new / zeta[j]) * ps[j]
            ps[j] = z_new * r + (beta * (z_new / zeta[j]) ** 2) * ps[j]
            zeta_old[j], zeta[j] = zeta[j], z_new
            its[j] = k + 1
            if abs(z_new) * math.sqrt(rs_new) <= tol * bnorm:
                active[j] = False
        if not active[0] or rs_new == 0.0:
            break
        p = r + beta * p
        rs, alpha_old, beta_old = rs_new, alpha, beta
    return xs, its, neg


def solve_damped(hvp: Callable[[torch.Tensor], torch.Tensor], rhs: torch.Tensor, damping: float = 1e-3,
                 max_iter: int = 30, tol: float = 1e-6, method: str = "minres"):
    """Solve (H + damping I) x = rhs with ``hvp(v) = H v``; returns (x, iterations, negative_curvature).
    ``tol``: stop when the residual falls below tol * ||rhs||. Methods: "cg", "minres"."""
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    if method not in ("cg", "minres"):
        raise ValueError(f"unknown method {method!r}; allowed: cg, minres")

    def op(v):
        return hvp(v) + damping * v
    solver = _cg if method == "cg" else _minres
    return solver(op, rhs, max_iter, tol)


@dataclass
class Tangent:
    """dtheta*/dg from ``optimum_tangent``: t solves (K + damping I) t = -A approximately, K the
    ``curvature`` ("ggn": the Gauss-Newton matrix G, "hessian": H; module docstring).

    ``residual`` = ||(K + damping I) t + A||, recomputed from t with one more product;
    ``rel_residual`` = residual / ||A|| (1.0 for t = 0); ``converged``: rel_residual <= ``tol``, the
    stated tolerance (a tangent that is not converged should not be read as dtheta*/dg);
    ``damping_cos``: cos(t, t') with t' the solution at ``pair_damping`` = 10 x damping (how much the
    tangent depends on the damping; NaN when not computed); ``iterations``: the solver's iterations
    (one product each) for t; ``products``: every curvature product spent, the check, the scale and t'
    included; ``curvature_scale``: the largest Ritz value of K on the Krylov space of A
    (``_lanczos_max``), of which ``rel_damping`` is the damping's fraction (NaN: an absolute damping)."""
    tangent: torch.Tensor
    residual: float
    rel_residual: float
    iterations: int
    damping: float
    a_norm: float
    negative_curvature: bool
    method: str
    layout: "ParamLayout | None" = None
    curvature: str = "hessian"
    tol: float = float("nan")
    converged: bool = False
    damping_cos: float = float("nan")
    pair_damping: float = float("nan")
    products: int = 0
    curvature_scale: float = float("nan")
    rel_damping: float = float("nan")

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tangent as {parameter name: tensor} (model wrappers only)."""
        if self.layout is None:
            raise ValueError("this tangent has no parameter layout (it came from a generic loss closure)")
        return self.layout.unflatten(self.tangent)


def _lanczos_max(op, b: torch.Tensor, steps: int = LANCZOS_STEPS) -> float:
    """The largest Ritz value (in magnitude) of the symmetric ``op`` on the Krylov space
    K_steps(op, b) (Lanczos 1950, without reorthogonalisation: a few steps only): the curvature scale
    that CG on op x = b meets, since it works in that same space. From below, and for an extreme
    eigenvalue in few steps (Kaniel-Paige; Golub & Van Loan 2013, section 10.1). 0.0 for b = 0."""
    bn = float(torch.linalg.vector_norm(b))
    if bn == 0.0:
        return 0.0
    v, v_old, beta = b / bn, torch.zeros_like(b), 0.0
    alphas, betas = [], []
    for _ in range(steps):
        w = op(v) - beta * v_old
        a = float(torch.dot(w, v))
        w = w - a * v
        alphas.append(a)
        beta = float(torch.linalg.vector_norm(w))
        if beta <= 1e-12 * max(abs(x) for x in alphas):  # an invariant subspace: the Ritz values are exact
            break
        betas.append(beta)
        v_old, v = v, w / beta
    k = len(alphas)
    off = torch.tensor(betas[:k - 1], dtype=torch.float64)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64)) + torch.diag(off, 1) + torch.diag(off, -1)
    return float(torch.linalg.eigvalsh(T).abs().max())


def _tangent_from(so: SecondOrder, damping, max_iter, tol, method, layout=None, curvature: str = "hessian",
                  pair_factor: float | None = PAIR_FACTOR, rel_damping: float | None = None) -> Tangent:
    """Solve (K + lambda I) t = -A (K = ``so.product(curvature)``) to ``tol``, and the same at
    ``pair_factor`` x lambda for ``damping_cos`` (CG: both in one Krylov space, ``_cg_shifts``; MINRES:
    a second solve). lambda = ``damping`` when it is given (not None), else ``rel_damping`` x the
    curvature scale (``_lanczos_max`` from A, ``LANCZOS_STEPS`` products). The solvers stop at
    ``_STOP_MARGIN`` x tol, so that the recomputed residual, which the recurrence tracks only up to
    rounding, still meets tol."""
    if method not in ("cg", "minres"):
        raise ValueError(f"unknown method {method!r}; allowed: cg, minres")
    prod = so.product(curvature)
    start = so.n_products
    A = so.mixed
    scale = float("nan")
    if damping is None:
        if rel_damping is None or rel_damping < 0:
            raise ValueError(f"give a damping >= 0, or a rel_damping >= 0; got {damping}, {rel_damping}")
        scale = _lanczos_max(prod, A)
        damping = rel_damping * scale
    elif damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    else:
        rel_damping = None
    pair = damping * pair_factor if pair_factor and damping > 0 else float("nan")
    stop = _STOP_MARGIN * tol
    t_pair = None
    if method == "cg":
        xs, its, neg = _cg_shifts(prod, -A, [damping] + ([pair] if math.isfinite(pair) else []), max_iter, stop)
        t, it = xs[0], its[0]
        t_pair = xs[1] if len(xs) > 1 else None
    else:
        t, it, neg = solve_damped(prod, -A, damping, max_iter, stop, "minres")
        if math.isfinite(pair):
            t_pair = solve_damped(prod, -A, pair, max_iter, stop, "minres")[0]
    res = float(torch.linalg.vector_norm(prod(t) + damping * t + A))
    an = float(torch.linalg.vector_norm(A))
    rel = res / an if an > 0 else 0.0
    return Tangent(t, res, rel, it, damping, an, neg, method, layout, curvature=curvature, tol=tol,
                   converged=bool(rel <= tol), damping_cos=_cos(t, t_pair) if t_pair is not None else float("nan"),
                   pair_damping=pair, products=so.n_products - start, curvature_scale=scale,
                   rel_damping=rel_damping if rel_damping is not None else float("nan"))


def optimum_tangent_fn(loss_fn: LossFn | None, theta: torch.Tensor, g=0.0, damping: float = 1e-3, max_iter: int = 30,
                       tol: float = 1e-6, method: str = "minres", output_fn=None, output_loss=None,
                       curvature: str | None = None) -> Tangent:
    """dtheta*/dg = -(K + damping I)^{-1} A_g at (theta, g) for a generic ``loss_fn(theta, g)`` (implicit
    function theorem; see the module docstring), by CG or MINRES on curvature-vector products. K is the
    Hessian for a loss closure; given the loss as ``output_loss(output_fn(theta, g))`` (``loss_fn``
    None), ``curvature`` may be "ggn" (the default then) or "hessian"."""
    so = SecondOrder(loss_fn, theta, g, output_fn, output_loss)
    curvature = curvature or ("ggn" if so.has_ggn else "hessian")
    return _tangent_from(so, damping, max_iter, tol, method, curvature=curvature)


@dataclass
class RecoverySignal:
    """||P_C grad|| (``signal``), its share of ||grad|| (``share``), and the same for random coordinate
    subspaces of dimension ``dim`` (``control_signal``, ``control_share``: means over the draws)."""
    signal: float
    grad_norm: float
    share: float
    control_signal: float
    control_share: float
    dim: int
    n_eligible: int
    grad: torch.Tensor = field(repr=False, default=None)

    @property
    def expected_share(self) -> float:
        """sqrt(dim / n_eligible): a random subspace's share for a gradient spread evenly."""
        return math.sqrt(self.dim / self.n_eligible) if self.n_eligible else float("nan")


def project_norm(vec: torch.Tensor, subspace: torch.Tensor) -> float:
    """||P_C vec||. ``subspace``: a [n] bool mask (C spanned by those coordinates) or an [n, k]
    matrix whose columns span C (orthonormalised here by a reduced QR: P_C = Q Q^T, ||P_C v|| = ||Q^T v||)."""
    if subspace.dtype == torch.bool:
        if subspace.shape != vec.shape:
            raise ValueError(f"mask of shape {tuple(subspace.shape)} for a vector of shape {tuple(vec.shape)}")
        return float(torch.linalg.vector_norm(vec[subspace]))
    if subspace.dim() != 2 or subspace.shape[0] != vec.shape[0]:
        raise ValueError(f"a basis must be [n={vec.shape[0]}, k], got {tuple(subspace.shape)}")
    q, _ = torch.linalg.qr(subspace.to(vec.dtype))
    return float(torch.linalg.vector_norm(q.T @ vec))


def _subspace_dim(subspace: torch.Tensor) -> int:
    if subspace.dtype == torch.bool:
        return int(subspace.sum())
    return int(torch.linalg.matrix_rank(subspace.double()))


def _signal_from_grad(grad, subspace, eligible=None, n_control: int = 8, seed: int = 0) -> RecoverySignal:
    n = grad.numel()
    eligible = torch.ones(n, dtype=torch.bool) if eligible is None else eligible.to(torch.bool)
    gn = float(torch.linalg.vector_norm(grad))
    sig = project_norm(grad, subspace)
    k = _subspace_dim(subspace)
    idx = eligible.nonzero()[:, 0]
    if k > len(idx):
        raise ValueError(f"the subspace has dimension {k} > {len(idx)} eligible coordinates for the control")
    gen = torch.Generator().manual_seed(seed)
    ctrl = []
    for _ in range(n_control):
        pick = idx[torch.randperm(len(idx), generator=gen)[:k]]
        ctrl.append(float(torch.linalg.vector_norm(grad[pick.to(grad.device)])))
    cs = sum(ctrl) / len(ctrl) if ctrl else float("nan")
    share = sig / gn if gn > 0 else 0.0
    return RecoverySignal(sig, gn, share, cs, cs / gn if gn > 0 else 0.0, k, len(idx), grad)


def recovery_signal_fn(loss_fn: LossFn, theta: torch.Tensor, subspace: torch.Tensor,
                       eligible: torch.Tensor | None = None, n_control: int = 8, seed: int = 0) -> RecoverySignal:
    """||P_C grad_theta L(theta, 0)|| for a generic ``loss_fn(theta, g)``, its share of
    ||grad_theta L(theta, 0)||, and a control: random coordinate subsets of the same dimension from
    ``eligible`` (a [n] bool mask, default all coordinates), ``n_control`` draws from ``seed``."""
    th = theta.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_fn(th, torch.zeros((), dtype=theta.dtype, device=theta.device))
        grad = torch.autograd.grad(loss, th)[0].detach()
    return _signal_from_grad(grad, subspace, eligible, n_control, seed)


# ------------------------------------------------------------------------------------ the real model
class ParamLayout:
    """The model's parameters (all but ``gate_logits`` unless told otherwise) as one flat vector."""

    def __init__(self, named: Sequence[tuple[str, torch.Size]]):
        self.names = [n for n, _ in named]
        self.shapes = {n: torch.Size(s) for n, s in named}
        self.offsets, o = {}, 0
        for n in self.names:
            self.offsets[n] = o
            o += self.shapes[n].numel()
        self.numel = o

    @classmethod
    def from_model(cls, model: torch.nn.Module, exclude: Sequence[str] = ("gate_logits",)) -> "ParamLayout":
        return cls([(n, p.shape) for n, p in model.named_parameters() if n not in exclude])

    def slice(self, name: str) -> slice:
        o = self.offsets[name]
        return slice(o, o + self.shapes[name].numel())

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        from .mechanism import _strip_state
        tensors = _strip_state(tensors)
        return torch.cat([tensors[n].detach().reshape(-1) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: vec[self.slice(n)].view(self.shapes[n]) for n in self.names}


def _gate_base(model: SoftPriorTransformer, gate) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_pos, g_content) as [L, H] tensors: ``gate`` None (the model's own), a float (both), or a pair."""
    if gate is None or isinstance(gate, (int, float)) or (torch.is_tensor(gate) and gate.dim() == 0):
        gp = gc = gate
    else:
        gp, gc = gate
    with torch.no_grad():
        a, b = model.gates(gp, gc)
    return a.detach().clone(), b.detach().clone()


def model_output(model: SoftPriorTransformer, task, batch, gate=None, direction=(1.0, 1.0),
                 exclude: Sequence[str] = ("gate_logits",)):
    """(output_fn, output_loss, theta0, layout): the model's training loss on ``batch`` split as
    ``output_loss(output_fn(theta, delta))``: output_fn gives the outputs (logits or predictions) at
    ``task.loss_positions`` with the parameters theta (flat, ``layout``) and the gates g0 + delta *
    direction, g0 = ``gate`` (None: the model's own; a float: both; a (pos, content) pair; a component
    may be None for that gate's own value); output_loss(out) = ``task.loss(out, targets)`` (convex in
    the outputs: cross-entropy or squared error). ``direction`` (w_pos, w_content): floats or [L, H]
    tensors. Runs the readable model (double backward)."""
    from torch.func import functional_call
    layout = ParamLayout.from_model(model, exclude)
    dtype = next(model.parameters()).dtype
    theta0 = layout.flatten(dict(model.named_parameters())).to(dtype)
    gp0, gc0 = _gate_base(model, gate)
    wp, wc = (torch.as_tensor(w, dtype=dtype) for w in direction)
    inputs = batch.inputs.to(dtype) if batch.inputs.is_floating_point() else batch.inputs
    targets = batch.targets.to(dtype) if batch.targets.is_floating_point() else batch.targets
    pos = task.loss_positions(inputs.shape[1])

    def output_fn(theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return functional_call(model, layout.unflatten(theta), (inputs,),
                               dict(gate_pos=gp0 + delta * wp, gate_content=gc0 + delta * wc, positions=pos),
                               strict=False)

    def output_loss(out: torch.Tensor) -> torch.Tensor:
        return task.loss(out, targets)
    return output_fn, output_loss, theta0, layout


def model_loss(model: SoftPriorTransformer, task, batch, gate=None, direction=(1.0, 1.0),
               exclude: Sequence[str] = ("gate_logits",)) -> tuple[LossFn, torch.Tensor, ParamLayout]:
    """(loss_fn, theta0, layout) for the model's training loss on ``batch``: loss_fn(theta, delta) is
    ``task.loss`` at ``task.loss_positions`` with the parameters theta (flat, ``layout``) and the gates
    g0 + delta * direction (``model_output``, whose two parts it composes)."""
    output_fn, output_loss, theta0, layout = model_output(model, task, batch, gate, direction, exclude)

    def loss_fn(theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return output_loss(output_fn(theta, delta))
    return loss_fn, theta0, layout


def model_second_order(model: SoftPriorTransformer, task, batch, gate=None, direction=(1.0, 1.0)) -> SecondOrder:
    """``SecondOrder`` of the model's loss at its parameters and ``gate`` (see ``model_output``), with
    both H-vector and Gauss-Newton-vector products."""
    output_fn, output_loss, theta, _ = model_output(model, task, batch, gate, direction)
    return SecondOrder(None, theta, 0.0, output_fn, output_loss)


def zero_gate_mask(layout: ParamLayout, cfg) -> torch.Tensor:
    """[n] bool: the coordinates the zero-gate loss depends on, i.e. all but the prior's own parameters
    (every ``pos_bias`` table, and the content factors U, W: ``in_proj`` rows 3d ..), whose gradient at
    g = 0 is exactly 0 (they enter the logits multiplied by the gate)."""
    m = torch.ones(layout.numel, dtype=torch.bool)
    d = cfg.d_model
    for n in layout.names:
        s = layout.slice(n)
        if n.endswith("attn.pos_bias"):
            m[s] = False
        elif n.endswith("attn.in_proj.weight"):
            m[s].view(layout.shapes[n])[3 * d:] = False
    return m


def circuit_mask(layout: ParamLayout, cfg, circuit) -> torch.Tensor:
    """[n] bool mask of the circuit subspace C. ``circuit``:

    - a list of (layer, head) pairs: the head's query, key and value rows of
      ``blocks.{l}.attn.in_proj.weight`` (rows h*dh.., d + h*dh.., 2d + h*dh.., dh each; the fused
      layout Q | K | V | U | W of ``model.Attention``) and its columns h*dh..(h+1)*dh of
      ``blocks.{l}.attn.out_proj.weight`` (W_O^h: the out projection reads head h's z from those
      columns): 4 d_model d_head coordinates per head;
    - a list of parameter names: every coordinate of those parameters;
    - a {name: bool tensor of the parameter's shape} dict;
    - a [n] bool tensor (returned as is)."""
    if torch.is_tensor(circuit):
        if circuit.dtype != torch.bool or circuit.shape != (layout.numel,):
            raise ValueError(f"a circuit mask must be a [{layout.numel}] bool tensor, got {circuit.dtype} "
                             f"{tuple(circuit.shape)}")
        return circuit
    m = torch.zeros(layout.numel, dtype=torch.bool)
    if isinstance(circuit, dict):
        for n, sub in circuit.items():
            if n not in layout.offsets:
                raise KeyError(f"unknown parameter {n!r}; allowed: {', '.join(layout.names)}")
            m[layout.slice(n)] = sub.reshape(-1).to(torch.bool)
        return m
    items = list(circuit)
    if all(isinstance(x, str) for x in items):
        for n in items:
            if n not in layout.offsets:
                raise KeyError(f"unknown parameter {n!r}; allowed: {', '.join(layout.names)}")
            m[layout.slice(n)] = True
        return m
    d, H, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    for item in items:
        l, h = (int(x) for x in item)
        if not (0 <= l < cfg.n_layers and 0 <= h < H):
            raise IndexError(f"head ({l}, {h}) out of range for {cfg.n_layers} layers x {H} heads")
        inp = m[layout.slice(f"blocks.{l}.attn.in_proj.weight")].view(layout.shapes[f"blocks.{l}.attn.in_proj.weight"])
        for base in (0, d, 2 * d):  # Q, K, V rows of head h
            inp[base + h * dh: base + (h + 1) * dh] = True
        out = m[layout.slice(f"blocks.{l}.attn.out_proj.weight")].view(layout.shapes[f"blocks.{l}.attn.out_proj.weight"])
        out[:, h * dh:(h + 1) * dh] = True
    return m


def circuit_heads(model: SoftPriorTransformer, task, batch, threshold: float = 0.03,
                  max_heads: int | None = None) -> list[tuple[int, int]]:
    """The heads that carry the zero-gate circuit: zero-gate mean-ablation importance
    (``ablation_importance``, DESIGN.md "Mechanism traces") >= ``threshold``, largest first, at most ``max_heads``
    (default half of all heads), and at least the top head."""
    from .mechanism import ablation_importance
    imp = ablation_importance(model, task, batch, (0.0, 0.0))
    L, H = imp.shape
    cap = max_heads if max_heads is not None else max(1, (L * H) // 2)
    order = sorted(((float(imp[l, h]), l, h) for l in range(L) for h in range(H)), reverse=True)
    heads = [(l, h) for v, l, h in order if v >= threshold][:cap]
    return heads or [(order[0][1], order[0][2])]


def recovery_signal(model: SoftPriorTransformer, task, batch, circuit=None, n_control: int = 8,
                    seed: int = 0) -> RecoverySignal:
    """||P_C grad_theta L(theta, g=0)||, its share of ||grad_theta L(theta, 0)|| and a random control
    (module docstring). ``circuit``: see ``circuit_mask``; None uses ``circuit_heads`` of this model."""
    if circuit is None:
        circuit = circuit_heads(model, task, batch)
    fn, theta, layout = model_loss(model, task, batch, gate=(0.0, 0.0))
    return recovery_signal_fn(fn, theta, circuit_mask(layout, model.cfg, circuit),
                              zero_gate_mask(layout, model.cfg), n_control, seed)


def optimum_tangent(model: SoftPriorTransformer, task, batch, gate=None, direction=(1.0, 1.0),
                    damping: float | None = None, max_iter: int = MAX_ITER, tol: float = TOL, method: str = "cg",
                    curvature: str = "ggn", pair_factor: float | None = PAIR_FACTOR,
                    rel_damping: float = REL_DAMPING) -> Tangent:
    """dtheta*/dg = -(K + lambda I)^{-1} A_g for the model at ``gate`` (None: its own gates; a float:
    both; a pair) along ``direction``, K the Gauss-Newton matrix ("ggn", the default) or the Hessian
    ("hessian"); lambda = ``rel_damping`` x the largest curvature K shows on the Krylov space of A_g
    (the default), or ``damping`` when given; solved to the relative residual ``tol`` in at most
    ``max_iter`` products, and again at ``pair_factor`` x lambda for ``Tangent.damping_cos`` (module
    docstring, "The tangent's system"). ``Tangent.converged`` says whether the tolerance was met;
    ``Tangent.as_dict()`` names the parts."""
    output_fn, output_loss, theta, layout = model_output(model, task, batch, gate, direction)
    return _tangent_from(SecondOrder(None, theta, 0.0, output_fn, output_loss), damping, max_iter, tol, method,
                         layout, curvature, pair_factor, rel_damping)


def _flat(x, layout: ParamLayout | None) -> torch.Tensor:
    if isinstance(x, Tangent):
        return x.tangent
    if isinstance(x, dict):
        if layout is None:
            raise ValueError("state dicts need a layout (ParamLayout.from_model(model))")
        return layout.flatten(x)
    return x


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()  # the norms in the dot product's precision: |cos| <= 1 up to rounding
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0.0 or nb == 0.0:
        return float("nan")
    return float(torch.dot(a, b)) / (na * nb)


def tracking_cosine(tangent, before, after, layout: ParamLayout | None = None, dg: float = 1.0) -> float:
    """cos(dg t, theta_after - theta_before): does the change a path made between two snapshots point
    where the optimum moves for a gate change dg (first order: dtheta* = t dg)? ``tangent``: a
    ``Tangent`` or flat vector; ``before``/``after``: flat vectors or state dicts (with ``layout``;
    the trainer's snapshots are accepted). NaN when dg = 0 or either vector is 0."""
    t = _flat(tangent, layout if layout is not None else getattr(tangent, "layout", None))
    lay = layout if layout is not None else getattr(tangent, "layout", None)
    delta = _flat(after, lay).to(t.dtype) - _flat(before, lay).to(t.dtype)
    return _cos(dg * t, delta)


def solution_cosine(grad: torch.Tensor, theta: torch.Tensor, theta_final: torch.Tensor) -> float:
    """cos(-grad, theta_final - theta): is the (zero-gate) descent direction already aligned with the
    displacement to where the run ends?"""
    return _cos(-grad, theta_final.to(grad.dtype) - theta.to(grad.dtype))


# ------------------------------------------------------------------------------------ traces over snapshots
def path_gates(path, step: int, total_steps: int, state: dict | None = None, model=None) -> tuple[float, float]:
    """The (g_pos, g_content) the path applies at ``step``: the schedule's value, or for a learned
    gate the model's own sigmoid(logit) from ``state`` (loaded into ``model``), averaged over units."""
    out = []
    for i, gc in enumerate((path.pos, path.content)):
        v = gc.value_at(step, total_steps)
        if v is None:
            logits = (state or {}).get("gate_logits")
            if logits is None and model is not None:
                logits = model.gate_logits
            v = float(torch.sigmoid(logits[i].detach()).mean()) if logits is not None else float("nan")
        out.append(float(v))
    return out[0], out[1]


def removal_step(path, total_steps: int) -> int:
    """Where the path removes the prior: 0 if both gates start at 0 (forced_zero, post hoc
    continuation), the final step if a gate is learned (unforced: removal would come after training),
    else the last step before a gate first falls below its step-0 value, the last prior-trained state
    (fade S: S; hard switch at s: s - 1)."""
    if path.pos.mode == "learned" or path.content.mode == "learned":
        return total_steps
    g0 = [g.value_at(0, total_steps) for g in (path.pos, path.content)]
    if max(g0) == 0.0:
        return 0
    for s in range(1, total_steps + 1):
        if any(g.value_at(s, total_steps) < v for g, v in zip((path.pos, path.content), g0)):
            return s - 1
    return total_steps


def _as_heads(circuit) -> list[tuple[int, int]] | None:
    """The circuit as (layer, head) pairs, or None when it is given otherwise (names, masks)."""
    if torch.is_tensor(circuit) or isinstance(circuit, dict):
        return None
    items = list(circuit)
    if not items or any(isinstance(x, str) for x in items):
        return None
    return [(int(l), int(h)) for l, h in items]


def _other_heads_share(rs: RecoverySignal, other_masks, heads) -> float:
    """A second control: the share of k random heads outside the circuit (k = len(heads)), as the root
    of its mean square, sqrt(k mean_{h not in C} ||P_h grad||^2) / ||grad|| (squared shares of disjoint
    coordinate sets add). NaN without a head circuit or without other heads."""
    if not heads or not other_masks or rs.grad_norm == 0:
        return float("nan")
    sq = [float(torch.linalg.vector_norm(rs.grad[m])) ** 2 for m in other_masks]
    return math.sqrt(len(heads) * sum(sq) / len(sq)) / rs.grad_norm


def continuation_trace(snapshots: Sequence[tuple[int, dict]], cfg, circuit, batch=None, n_examples: int = 256,
                       damping: float | None = None, max_iter: int = MAX_ITER, method: str = "cg",
                       n_control: int = 8, step_offset: int = 0, task=None, tol: float = TOL, curvature: str = "ggn",
                       rel_damping: float = REL_DAMPING):
    """Per snapshot of one run (a pandas DataFrame, one row per snapshot, in step order):

        step, g_pos, g_content, signal, grad_norm, share, control_share, expected_share,
        other_heads_share, solution_cos, dg_pos, dg_content, tracking_cos, norm_ratio, residual,
        rel_residual, cg_iters, negative_curvature, damping, curvature_scale, converged, damping_cos, seconds

    - ``signal``, ``share``, ``control_share``: ``recovery_signal`` at the zero gate with the circuit
      ``circuit`` (see ``circuit_mask``); ``other_heads_share``: the same number of heads outside the
      circuit (``_other_heads_share``; for a circuit given as heads); ``solution_cos`` = cos(-grad_theta L(theta_s, 0),
      theta_final - theta_s) (is the zero-gate descent direction aligned with where the run ends?).
    - ``tracking_cos``: for consecutive snapshots s, s', the tangent at s along the path's gate
      change w = g(s') - g(s) (so t_w predicts theta(s') - theta(s) to first order) against the actual
      change: ``tracking_cosine``; ``norm_ratio`` = ||t_w|| / ||theta(s') - theta(s)||. NaN where the
      gate did not change (nothing to track) and on the last snapshot. ``residual``/``rel_residual``/
      ``cg_iters``/``negative_curvature``/``damping``/``curvature_scale``/``damping_cos``: the solver's
      report (``Tangent``: the curvature ``curvature``; the damping lambda used, ``rel_damping`` x the
      snapshot's curvature scale unless ``damping`` is given; the relative tolerance ``tol``, at most
      ``max_iter`` products; the cosine with the tangent at 10 lambda); ``converged``: False where a tangent was
      solved and missed ``tol`` (True on the rows without a tangent), so ``df["converged"].all()`` says
      whether every tracking cosine of the trace rests on a converged tangent.
    - ``seconds``: the wall time of the snapshot's measurements.

    The batch is the run's validation set (the first ``n_examples`` of ``cfg.val_seed`` at length
    ``cfg.model.n_ctx``), the same for every snapshot; gates are the path's (``path_gates``).
    ``step_offset`` is added to the reported steps (a post hoc continuation starts at its parent's end).
    ``continuation_traces`` measures several runs' traces in worker processes.
    """
    import pandas as pd

    snaps = sorted(((int(s), sd) for s, sd in snapshots), key=lambda x: x[0])
    if not snaps:
        return pd.DataFrame()
    ctx = _TraceContext(snaps, cfg, circuit, batch, n_examples, damping, max_iter, method, n_control, step_offset,
                        task, tol, curvature, rel_damping)
    return pd.DataFrame([ctx.row(i) for i in range(len(snaps))])


def continuation_traces(specs: Sequence[dict], workers: int = 1, on_trace: Callable | None = None) -> list:
    """``continuation_trace(**spec)`` for each spec (its keyword arguments), in order; ``on_trace(j, df)``
    is called as soon as run j's trace is complete (a caller caches it there: an interrupted batch keeps
    what it finished).

    ``workers`` > 1: every snapshot of every run is one task for a pool of that many spawned processes
    at one torch thread each (a snapshot's row depends only on the run's snapshots, so the rows are
    independent); the costly tasks start first (rows with a tangent, the larger models first), so the
    workers finish together. The snapshots travel to the workers as numpy arrays (pickled by value;
    torch tensors would hold one shared-memory file open per tensor in every process). The numbers
    equal a serial trace's at one thread; only ``seconds`` differs."""
    import pandas as pd
    out: list = [None] * len(specs)

    def done(j, df):
        out[j] = df
        if on_trace is not None:
            on_trace(j, df)
    if workers <= 1:
        for j, spec in enumerate(specs):
            done(j, continuation_trace(**spec))
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    ctxs = [_TraceContext.of(s) for s in specs]  # here only to order the tasks
    for j, c in enumerate(ctxs):
        if c is None:
            done(j, pd.DataFrame())
    tasks = [(j, i) for j, c in enumerate(ctxs) if c is not None for i in range(len(c.snaps))]
    tasks.sort(key=lambda t: (not ctxs[t[0]].has_tangent(t[1]), -ctxs[t[0]].thetas[0].numel()))
    if not tasks:
        return out
    left = {j: len(c.snaps) for j, c in enumerate(ctxs) if c is not None}
    rows: dict = {}
    portable = [{**s, "snapshots": [(st, {k: v.detach().cpu().numpy() for k, v in sd.items()})
                                    for st, sd in s["snapshots"]]} for s in specs]
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=mp.get_context("spawn"),
                             initializer=_trace_worker_init, initargs=(portable,)) as ex:
        futures = {ex.submit(_trace_worker_row, t): t for t in tasks}
        for f in as_completed(futures):
            j, i = futures[f]
            rows[j, i] = f.result()  # a task's exception reaches the caller
            left[j] -= 1
            if not left[j]:
                done(j, pd.DataFrame([rows.pop((j, k)) for k in range(len(ctxs[j].snaps))]))
    return out


class _TraceContext:
    """What every row of a continuation trace reads (the model, batch, masks, flattened snapshots and the
    path's gates); ``row(i)`` measures snapshot i."""

    @classmethod
    def of(cls, spec: dict) -> "_TraceContext | None":
        """The context of ``continuation_trace(**spec)`` (None: no snapshots)."""
        import inspect
        bound = inspect.signature(continuation_trace).bind(**spec)  # a misspelt key raises, as in a serial trace
        bound.apply_defaults()
        kw = dict(bound.arguments)
        snaps = sorted(((int(s), sd) for s, sd in kw.pop("snapshots")), key=lambda x: x[0])
        if not snaps:
            return None
        return cls(snaps, kw["cfg"], kw["circuit"], kw["batch"], kw["n_examples"], kw["damping"], kw["max_iter"],
                   kw["method"], kw["n_control"], kw["step_offset"], kw["task"], kw["tol"], kw["curvature"],
                   kw["rel_damping"])

    def __init__(self, snaps, cfg, circuit, batch, n_examples, damping, max_iter, method, n_control, step_offset,
                 task, tol=TOL, curvature="ggn", rel_damping=REL_DAMPING):
        from ..tasks.generators import make_task
        from .mechanism import _strip_state
        if curvature not in CURVATURES:  # raised here, before any snapshot is measured
            raise ValueError(f"unknown curvature {curvature!r}; allowed: {', '.join(CURVATURES)}")
        self.cfg = cfg
        self.kw = dict(damping=damping, max_iter=max_iter, method=method, tol=tol, curvature=curvature,
                       rel_damping=rel_damping)
        self.n_control, self.step_offset = n_control, step_offset
        self.task = task if task is not None else make_task(cfg.task)
        self.batch = batch if batch is not None else cfg.validation_batch(self.task, n=n_examples)
        with torch.random.fork_rng(devices=[]):
            model = SoftPriorTransformer(cfg.model)
        model.eval()
        self.model = model
        layout = ParamLayout.from_model(model)
        self.snaps = [(s, _strip_state(sd)) for s, sd in snaps]
        self.mask = circuit_mask(layout, cfg.model, circuit)
        self.eligible = zero_gate_mask(layout, cfg.model)
        self.heads = _as_heads(circuit)
        others = [(l, h) for l in range(cfg.model.n_layers) for h in range(cfg.model.n_heads)
                  if self.heads is not None and (l, h) not in self.heads]
        self.other_masks = [circuit_mask(layout, cfg.model, [x]) for x in others]
        self.thetas = [layout.flatten(sd) for _, sd in self.snaps]
        self.gates = [path_gates(cfg.path, s, cfg.total_steps, sd) for s, sd in self.snaps]
        self.learned = (cfg.path.pos.mode == "learned", cfg.path.content.mode == "learned")

    def _gate_change(self, i):
        g = self.gates
        return (g[i + 1][0] - g[i][0], g[i + 1][1] - g[i][1]) if i + 1 < len(g) else None

    def has_tangent(self, i) -> bool:
        w = self._gate_change(i)
        return w is not None and any(math.isfinite(x) and x != 0.0 for x in w)

    def row(self, i: int) -> dict:
        import time
        t0 = time.perf_counter()
        step, sd = self.snaps[i]
        model, task, batch, gates, thetas = self.model, self.task, self.batch, self.gates, self.thetas
        model.load_state_dict(sd)
        rs = recovery_signal_fn(*model_loss(model, task, batch, gate=(0.0, 0.0))[:2], self.mask, self.eligible,
                                self.n_control)
        row = {"step": step + self.step_offset, "g_pos": gates[i][0], "g_content": gates[i][1], "signal": rs.signal,
               "grad_norm": rs.grad_norm, "share": rs.share, "control_share": rs.control_share,
               "expected_share": rs.expected_share,
               "other_heads_share": _other_heads_share(rs, self.other_masks, self.heads),
               "solution_cos": solution_cosine(rs.grad, thetas[i], thetas[-1]),
               "dg_pos": float("nan"), "dg_content": float("nan"), "tracking_cos": float("nan"),
               "norm_ratio": float("nan"), "residual": float("nan"), "rel_residual": float("nan"),
               "cg_iters": 0, "negative_curvature": False, "damping": float("nan"),
               "curvature_scale": float("nan"), "converged": True, "damping_cos": float("nan")}
        w = self._gate_change(i)
        if w is not None:
            row["dg_pos"], row["dg_content"] = w
            if self.has_tangent(i):
                w = tuple(x if math.isfinite(x) else 0.0 for x in w)
                at = tuple(None if lrn else g for lrn, g in zip(self.learned, gates[i]))  # learned: the model's own
                tg = optimum_tangent(model, task, batch, gate=at, direction=w, **self.kw)
                delta = thetas[i + 1] - thetas[i]
                row.update(tracking_cos=_cos(tg.tangent, delta),
                           norm_ratio=float(torch.linalg.vector_norm(tg.tangent) / torch.linalg.vector_norm(delta))
                           if float(torch.linalg.vector_norm(delta)) > 0 else float("nan"),
                           residual=tg.residual, rel_residual=tg.rel_residual, cg_iters=tg.iterations,
                           negative_curvature=tg.negative_curvature, damping=tg.damping,
                           curvature_scale=tg.curvature_scale, converged=tg.converged, damping_cos=tg.damping_cos)
        row["seconds"] = time.perf_counter() - t0
        return row


_WORKER: dict = {}  # a trace worker's specs, and the contexts built from them as its tasks need them


def _trace_worker_init(specs):
    torch.set_num_threads(1)
    _WORKER.clear()
    _WORKER["specs"] = [{**s, "snapshots": [(st, {k: torch.from_numpy(v) for k, v in sd.items()})
                                            for st, sd in s["snapshots"]]} for s in specs]


def _trace_worker_row(task: tuple[int, int]) -> dict:
    j, i = task
    if j not in _WORKER:
        _WORKER[j] = _TraceContext.of(_WORKER["specs"][j])
    return _WORKER[j].row(i)
