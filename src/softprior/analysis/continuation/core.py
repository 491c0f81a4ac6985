"""The continuation quantities' generic core: derivatives of a loss ``L(theta, g)`` at one point
(``SecondOrder``: the gradient, the mixed derivative A_g, Hessian- and Gauss-Newton-vector products),
the Krylov solvers, the optimum tangent and the recovery signal of a loss closure (the package
docstring, ``softprior.analysis.continuation``, says what each is and how it is computed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["SecondOrder", "second_order", "solve_damped", "Tangent", "optimum_tangent_fn", "RecoverySignal",
           "project_norm", "recovery_signal_fn", "CURVATURES"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (theta [n], delta 0-d) -> scalar loss
CURVATURES = ("ggn", "hessian")
# the tangent as the continuation trace measures it (package docstring, "The tangent's system")
REL_DAMPING, LANCZOS_STEPS, TOL, MAX_ITER, PAIR_FACTOR = 1e-3, 10, 1e-4, 500, 10.0
_STOP_MARGIN = 0.5  # the solvers stop at half the tolerance: the recomputed residual then meets it


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
    ``curvature`` ("ggn": the Gauss-Newton matrix G, "hessian": H; package docstring).

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
    layout: object = None  # the flat vector's ``model.ParamLayout`` (the model wrappers; None: a loss closure)
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


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()  # the norms in the dot product's precision: |cos| <= 1 up to rounding
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0.0 or nb == 0.0:
        return float("nan")
    return float(torch.dot(a, b)) / (na * nb)


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
    function theorem; see the package docstring), by CG or MINRES on curvature-vector products. K is the
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
