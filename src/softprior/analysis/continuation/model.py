"""The continuation quantities of the real model: its parameters as one flat vector (``ParamLayout``),
its training loss as a function of theta and the gate (``model_output``, ``model_loss``), the circuit
subspace and its control (``circuit_mask``, ``circuit_heads``, ``zero_gate_mask``), the recovery
signal and the optimum tangent of a model, and the cosines a trace reports (the package docstring,
``softprior.analysis.continuation``, "Conventions of the model wrappers")."""

from __future__ import annotations

from typing import Sequence

import torch

from ...model.transformer import SoftPriorTransformer
from .core import (MAX_ITER, PAIR_FACTOR, REL_DAMPING, TOL, LossFn, RecoverySignal, SecondOrder, Tangent, _cos,
                   _tangent_from, recovery_signal_fn)

__all__ = ["ParamLayout", "model_output", "model_loss", "model_second_order", "circuit_mask", "circuit_heads",
           "zero_gate_mask", "recovery_signal", "optimum_tangent", "tracking_cosine", "solution_cosine"]


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
        from ..mechanism import _strip_state
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
      layout Q | K | V | U | W of ``model.transformer.Attention``) and its columns h*dh..(h+1)*dh of
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
    from ..mechanism import ablation_importance
    imp = ablation_importance(model, task, batch, (0.0, 0.0))
    L, H = imp.shape
    cap = max_heads if max_heads is not None else max(1, (L * H) // 2)
    order = sorted(((float(imp[l, h]), l, h) for l in range(L) for h in range(H)), reverse=True)
    heads = [(l, h) for v, l, h in order if v >= threshold][:cap]
    return heads or [(order[0][1], order[0][2])]


def recovery_signal(model: SoftPriorTransformer, task, batch, circuit=None, n_control: int = 8,
                    seed: int = 0) -> RecoverySignal:
    """||P_C grad_theta L(theta, g=0)||, its share of ||grad_theta L(theta, 0)|| and a random control
    (package docstring). ``circuit``: see ``circuit_mask``; None uses ``circuit_heads`` of this model."""
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
    ``max_iter`` products, and again at ``pair_factor`` x lambda for ``Tangent.damping_cos`` (package
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
