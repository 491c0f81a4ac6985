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
``tests/analysis/test_continuation_solver.py`` (464 parameters after 40 steps, g = 0.5, float64, dense) H has
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
