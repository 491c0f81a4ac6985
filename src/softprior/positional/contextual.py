"""Schemes that read the content: CoPE (contextual counts), DAPE (an MLP over logits and bias), GPSA (gated positional self-attention)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from .base import PositionalScheme, _allowed, _offsets
from .bias import KerpleLog


class CoPE(PositionalScheme):
    """cope: contextual position encoding.

    Formula (per head; s_ij = q_i.k_j/sqrt(dh) the scaled logits this scheme receives):
        g_ij = sigmoid(s_ij) * [j <= i]           (the causal mask is applied to the gates first)
        p_ij = min(sum_{t=j..i} g_it, npos - 1)   (a reversed cumulative sum over keys)
        z_i  = q_i @ P                            (P: [d_head, npos], one per layer, shared by heads)
        e_ij = z_i[ceil p_ij] (p_ij - floor p_ij) + z_i[floor p_ij] (1 - (p_ij - floor p_ij))
        s'_ij = s_ij + e_ij / sqrt(dh)
    The reference adds e to the unscaled q.k and then divides both by sqrt(dh) (its default, unless
    --cope-nodiv), so e is divided by sqrt(dh) here too (x-transformers adds it undivided). The gates
    use the scaled logits, as the reference (sigmoid(q.k / sqrt(dh))). Positions are fractional;
    the interpolation weight carries the gradient to the gates, floor/ceil do not.
    Reference: Golovneva et al. 2024; facebookresearch/RAM projects/cope/src/cope/context_position.py.
    Init: P = 0 (so CoPE starts as NoPE), as the reference.
    npos = n_ctx + 1 (the reference's default, block size + 1: p_ij ranges over 0..i+1 <= n_ctx,
    so every row of P is reachable in training and none is wasted).
    Sharing: one P per layer (the reference has a --cope-shared option, off by default).
    Beyond the training length: at T = 120 positions above n_ctx are clamped to npos - 1 = n_ctx,
    the last trained row (like B^pos's clip); with gates below 1 the counted positions grow slower
    than i - j, so more of the window stays in the trained range.
    Assumes kpos is ascending (the reversed cumsum runs over the key axis)."""

    name = "cope"

    def __init__(self, *, npos: int | None = None, **dims):
        super().__init__(**dims)
        self.npos = self.n_ctx + 1 if npos is None else npos
        if self.npos < 2:
            raise ValueError(f"cope needs npos >= 2, got {self.npos}")
        self.pos_emb = nn.Parameter(torch.zeros(self.d_head, self.npos))

    def positions(self, logits, qpos, kpos) -> torch.Tensor:
        """Contextual positions p_ij (B, H, Tq, T); 0 on future keys."""
        gates = torch.sigmoid(logits) * _allowed(qpos, kpos).to(logits.dtype)
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos - 1)

    def adjust_logits(self, logits, q, k, qpos, kpos):
        p = self.positions(logits, qpos, kpos)
        z = q @ self.pos_emb.to(q.dtype)  # (B, H, Tq, npos)
        lo = p.floor()
        w = p - lo
        e = z.gather(-1, p.ceil().long()) * w + z.gather(-1, lo.long()) * (1 - w)
        return logits + e / math.sqrt(self.d_head)


class DAPE(PositionalScheme):
    """dape: data-adaptive positional encoding on top of a Kerple-log base bias.

    Formula: with X = the scaled logits (B, H, Tq, T) and B = the base bias (H, Tq, T),
        out_ij = X_ij + B_ij + f([X_ij ; B_ij]),  f = Linear(2H, 32) -> LeakyReLU -> Linear(32, H)
    applied over the head axis at every (i, j); the causal mask comes afterwards (f is pointwise in
    (i, j), so no future entry reaches an allowed one).
    Reference: Zheng et al. 2024; chuanyang-Zheng/DAPE, ``ParallelKerpleLog_DAPE`` in DAPE.py (the
    ``*_C`` classes of megatron/model/positional_embeddings.py, formerly CAPE).
    Base: kerple_log (``KerpleLog``: learned r1, r2, init U(0,2)/U(0,1), clamped >= 0.01), the
    paper's headline configuration (DAPE-Kerple); its parameters belong to this instance.
    Init: f uses PyTorch's default Linear init (as the reference), so f adds a random
    content-dependent term from the first step (it is not zero-initialised).
    Sharing: base and f per layer, as chuanyang-Zheng/DAPE (megatron/model/transformer.py builds one in
    each attention layer; KERPLE's own code shares its kernel across layers, see ``KerpleLog``).
    Beyond the training length: B extrapolates as Kerple's formula; f sees (X, B) pairs, and at
    T = 120 B takes values more negative than any in training, so f is evaluated off its trained
    range (the paper's claim is that this adapts well)."""

    name = "dape"
    MLP_WIDTH = 32  # the reference's hidden width (``flops.train_step_flops`` counts the MLP with it)

    def __init__(self, *, mlp_width: int = MLP_WIDTH, **dims):
        super().__init__(**dims)
        self.base = KerpleLog(**dims)
        H = self.n_heads
        self.f = nn.Sequential(nn.Linear(2 * H, mlp_width), nn.LeakyReLU(), nn.Linear(mlp_width, H))

    def adjust_logits(self, logits, q, k, qpos, kpos):
        b = self.base.bias(qpos, kpos).to(logits.dtype)  # (H, Tq, T)
        xb = torch.cat([logits, b.expand_as(logits)], dim=-3)  # (B, 2H, Tq, T)
        mix = self.f(xb.movedim(-3, -1)).movedim(-1, -3)  # (B, H, Tq, T)
        return logits + b + mix


class GPSA(PositionalScheme):
    """gpsa: ConViT's gated positional self-attention, adapted to 1-D causal attention.

    Formula (per head h, delta = i - j):
        pos_ij = w_h1 delta + w_h2 delta^2          (a linear map of the features (delta, delta^2))
        A = (1 - sigmoid(l_h)) softmax_j(masked content logits) + sigmoid(l_h) softmax_j(masked pos)
        A <- A / sum_j A                             (renormalise, as the reference)
    ``mix_pattern`` receives the first softmax from the attention layer and applies the causal mask
    to the positional softmax itself.
    Reference: d'Ascoli et al. 2021; facebookresearch/convit ``convit.py`` (class GPSA). The original
    is 2-D and unmasked with features (dx, dy, dx^2 + dy^2); the 1-D features are (delta, delta^2).
    Init: l_h = 1 (sigmoid 0.73 of the weight on position), as the reference. Local init as the
    reference's ``local_init``: w_h = alpha (2h, -1), alpha = 1 (locality_strength), so
    pos_ij = -alpha (delta - h)^2 + alpha h^2, and the constant drops out of the softmax: head h is
    centred on offset h (the same shape as the model's "locality" B^pos init). The reference's
    pos_proj bias is constant over keys and cancels in the softmax, so we omit it.
    Sharing: pos map and gates per layer, as the reference (one per GPSA block). ConViT uses GPSA
    in its first 10 of 12 blocks; here every layer that gets this scheme is a GPSA layer.
    Beyond the training length: the positional score is a quadratic in delta, so T = 120 just
    evaluates it at larger offsets; with the local init far keys get vanishing positional weight."""

    name = "gpsa"

    def __init__(self, *, locality_strength: float = 1.0, gate_init: float = 1.0, **dims):
        super().__init__(**dims)
        H = self.n_heads
        self.pos_proj = nn.Linear(2, H, bias=False)
        self.gating = nn.Parameter(torch.full((H,), float(gate_init)))
        with torch.no_grad():
            h = torch.arange(H, dtype=torch.float32)
            self.pos_proj.weight.copy_(locality_strength * torch.stack([2 * h, -torch.ones(H)], dim=1))

    def pos_scores(self, qpos, kpos) -> torch.Tensor:
        """Unmasked positional scores (H, Tq, T)."""
        delta = _offsets(qpos, kpos).to(self.pos_proj.weight.dtype)  # the model's dtype (float32 in training)
        feats = torch.stack([delta, delta * delta], dim=-1)  # (Tq, T, 2)
        return self.pos_proj(feats).permute(2, 0, 1)

    def mix_pattern(self, pattern, qpos, kpos):
        s = self.pos_scores(qpos, kpos).masked_fill(~_allowed(qpos, kpos), float("-inf"))
        pos = s.softmax(-1).to(pattern.dtype)
        g = torch.sigmoid(self.gating).to(pattern.dtype)[:, None, None]
        a = (1 - g) * pattern + g * pos
        return a / a.sum(-1, keepdim=True)
