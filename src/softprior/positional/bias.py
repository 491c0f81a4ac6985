"""Relative biases added to the logits: ALiBi, T5 buckets, Kerple (log and power), FIRE."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from .base import AdditiveBias, _floor_clamp, _offsets


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi head slopes. A power of two n: m_h = 2^(-8(h+1)/n) for h = 0..n-1. Otherwise: the slopes
    for p = the largest power of two below n, then every other slope of the 2p schedule (the
    1st, 3rd, ...) until there are n."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    if n_heads & (n_heads - 1) == 0:
        return [2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)]
    p = 1 << (n_heads.bit_length() - 1)
    return alibi_slopes(p) + alibi_slopes(2 * p)[0::2][: n_heads - p]


class ALiBi(AdditiveBias):
    """alibi: b_h(i, j) = -m_h |i - j| with fixed geometric slopes (``alibi_slopes``).

    Reference: Press et al. 2022; ofirpress/attention_with_linear_biases (the slope rule in
    ``fairseq/models/transformer.py``; the DAPE repo's ``AliBi`` copies it).
    No parameters; the same slopes in every layer, as the reference.
    Beyond the training length: the bias is a formula in |i - j|, so T = 120 just extends the
    linear penalty (what ALiBi is designed for)."""

    name = "alibi"

    def __init__(self, **dims):
        super().__init__(**dims)
        self.slopes = alibi_slopes(self.n_heads)

    def bias(self, qpos, kpos):
        m = torch.tensor(self.slopes, device=qpos.device, dtype=torch.float32)
        dist = _offsets(qpos, kpos).abs().to(torch.float32)
        return -m[:, None, None] * dist


def t5_bucket(offset: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's causal (unidirectional) relative-position bucket of n = max(i - j, 0).

    n < num_buckets/2: its own bucket n. Larger n: num_buckets/2 + floor(log(n / (num_buckets/2)) /
    log(max_distance / (num_buckets/2)) * num_buckets/2), capped at num_buckets - 1 (so every
    n >= max_distance shares the last bucket)."""
    n = offset.clamp(min=0)
    exact = num_buckets // 2
    scaled = torch.log(n.to(torch.float32).clamp(min=1.0) / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (num_buckets - exact)).to(torch.long)).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


class T5RelativeBias(AdditiveBias):
    """t5: learned relative bias, b_h(i, j) = W[bucket(i - j), h], T5 log-spaced causal buckets.

    Formula: ``t5_bucket`` with num_buckets = 32, max_distance = 128; one learned scalar per bucket
    per head, added to the scaled logits as is (NOT multiplied by sqrt(d_head) as x-transformers'
    ``RelativePositionBias`` does, so the table lives on the logit scale like every other bias here).
    Reference: Raffel et al. 2020; x-transformers ``RelativePositionBias``.
    Why T5 and not Shaw et al.: Shaw adds q.a^K_{clip(j-i)} to the logits and a^V to the values,
    which changes the value path and adds d_head-sized vectors; T5's scalar bias per offset and head
    is the same kind of object as the model's B^pos table, so the comparison isolates the bucketing
    and the missing gate.
    Init: W ~ N(0, d_model^-1/2), as Hugging Face T5's initialiser.
    Sharing: T5 and x-transformers compute the bias once and share it across layers; we give every
    layer its own table, matching the model's per-layer B^pos.
    Beyond the training length: offsets are clipped to n_ctx - 1 before bucketing (bucketing is
    monotone, so this equals clipping to the last trained bucket), like B^pos's clip rule. At
    n_ctx = 32 the trained offsets 0..31 use buckets 0..21; buckets 22..31 are never used (kept so
    the table has the reference's size). T = 120 therefore reuses bucket 21 for every offset >= 31."""

    name = "t5"

    def __init__(self, *, num_buckets: int = 32, max_distance: int = 128, clip: bool = True, **dims):
        super().__init__(**dims)
        self.num_buckets, self.max_distance, self.clip = num_buckets, max_distance, clip
        self.table = nn.Parameter(torch.randn(num_buckets, self.n_heads) * self.d_model ** -0.5)

    def buckets(self, qpos, kpos) -> torch.Tensor:
        off = _offsets(qpos, kpos).clamp(min=0)
        if self.clip:
            off = off.clamp(max=self.n_ctx - 1)
        return t5_bucket(off, self.num_buckets, self.max_distance)

    def bias(self, qpos, kpos):
        return self.table[self.buckets(qpos, kpos)].permute(2, 0, 1)  # (Tq, T, H) -> (H, Tq, T)


class _Kerple(AdditiveBias):
    """Shared parameters of the two KERPLE kernels: r1_h (the multiplier), r2_h per head, per layer.

    Init as the reference (chijames/KERPLE, ``ParallelKerpleLog`` / ``ParallelKerplePower``): it
    draws ``bias_p ~ U(0, 2)`` first, then ``bias_a ~ U(0, 1)``, per head. In the log kernel
    -p log(1 + a|i-j|) p is the multiplier (r1) and a the scale inside the log (r2); in the power
    kernel -a |i-j|^p p is the exponent (r2) and a the multiplier (r1). ``exponent_p`` says which."""

    eps = 0.01  # the reference's floor
    r2_max: float | None = None
    exponent_p = False  # True: r2 is the reference's p (the power kernel's exponent)

    def __init__(self, **dims):
        super().__init__(**dims)
        p = torch.rand(self.n_heads) * 2.0  # bias_p ~ U(0, 2), drawn first as in the reference
        a = torch.rand(self.n_heads)  # bias_a ~ U(0, 1)
        r1, r2 = (a, p) if self.exponent_p else (p, a)
        self.r1 = nn.Parameter(r1)
        self.r2 = nn.Parameter(r2)

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clamped (r1, r2) actually used, each (H, 1, 1)."""
        r1 = _floor_clamp(self.r1, self.eps)
        r2 = _floor_clamp(self.r2, self.eps, self.r2_max)
        return r1[:, None, None], r2[:, None, None]

    def _dist(self, qpos, kpos):
        """|i - j| in the parameters' dtype (float32 in training, float64 in a float64 model)."""
        return _offsets(qpos, kpos).abs().to(self.r1.dtype)


class KerpleLog(_Kerple):
    """kerple_log: b_h(i, j) = -r1_h log(1 + r2_h |i - j|).

    Reference: Chi et al. 2022; chijames/KERPLE ``ParallelKerpleLog`` (megatron/model/
    positional_embeddings.py; also in chuanyang-Zheng/DAPE).
    Init: r1 ~ U(0, 2), r2 ~ U(0, 1), per head. Both are clamped to >= 0.01 on every forward (the
    reference clamps ``.data`` in place; we clamp the value with a straight-through gradient, so the
    forward is identical and nothing is mutated).
    Sharing: one (r1, r2) per head per layer. This is our choice: chijames/KERPLE builds one
    ``ParallelKerpleLog`` in ``GPT2ModelPipe.init_specs`` and hands it to every layer, so its (r1, r2)
    are shared across layers (chuanyang-Zheng/DAPE builds one per attention layer); per layer matches
    the model's per-layer B^pos and the other learned schemes here.
    Dtype: computed in the parameters' dtype (float32 in training; float64 in a float64 model).
    Beyond the training length: a formula in |i - j|, so T = 120 continues the log decay with the
    learned r1, r2."""

    name = "kerple_log"

    def bias(self, qpos, kpos):
        r1, r2 = self.params()
        return -r1 * torch.log1p(r2 * self._dist(qpos, kpos))


class KerplePower(_Kerple):
    """kerple_power: b_h(i, j) = -r1_h |i - j|^r2_h, r2 in (0, 2].

    Reference: Chi et al. 2022; chijames/KERPLE ``ParallelKerplePower``.
    Init (the reference's ``bias_a``, ``bias_p``): multiplier r1 ~ U(0, 1), exponent r2 ~ U(0, 2);
    clamped on every forward to r1 >= 0.01 and 0.01 <= r2 <= 2 (straight-through, see ``KerpleLog``). |i - j|^r2 is computed as exp(r2 log|i - j|) off the
    diagonal and 0 on it, so the gradient in r2 stays finite at i = j.
    Sharing: per head per layer, our choice (chijames/KERPLE shares one module across layers; see
    ``KerpleLog``). Dtype: the parameters' (``KerpleLog``).
    Beyond the training length: a formula in |i - j|; T = 120 continues the power law."""

    name = "kerple_power"
    r2_max = 2.0
    exponent_p = True

    def bias(self, qpos, kpos):
        r1, r2 = self.params()
        d = self._dist(qpos, kpos)
        powd = torch.where(d > 0, torch.exp(r2 * torch.log(d.clamp(min=1.0))), torch.zeros_like(d))
        return -r1 * powd


class FIRE(AdditiveBias):
    """fire: functional interpolation, b_h(i, j) = MLP(psi(i - j) / psi(max(i, L)))_h.

    Formula: psi(x) = log(|c| x + 1) with c learnable (|c| keeps the log's argument >= 1; c > 0 in
    the paper); L = |L_mult * L_init|, L_mult learnable; the MLP is Linear(1, 32) -> ReLU ->
    Linear(32, H) applied to each (i, j). i - j is clamped at 0 (causal), and the normaliser gets
    + 1e-6 as the reference.
    Reference: Li et al. 2024 (no official code); the DAPE repo's ``FIRE`` class
    (chuanyang-Zheng/DAPE ``DAPE.py`` / megatron/model/positional_embeddings.py).
    Init: c = 0.1, L_mult = 1, L_init = n_ctx (never more than the training length: with the
    reference's L_init = 512 and T = 32 the normaliser would be the constant psi(512) at every length
    we use, and the progressive interpolation would never act); MLP: PyTorch's default Linear init.
    Sharing: one FIRE per layer (the DAPE repo builds one per attention layer); we do the same.
    Beyond the training length: during training (i < n_ctx = L) the normaliser is the constant
    psi(L), so inputs span [0, psi(n_ctx - 1)/psi(n_ctx)]. At T = 120, rows i > L are normalised by
    psi(i), so their inputs stay in [0, 1]: the MLP only sees values near its trained range (this is
    FIRE's progressive interpolation)."""

    name = "fire"

    def __init__(self, *, mlp_width: int = 32, c_init: float = 0.1, L_init: float | None = None,
                 eps: float = 1e-6, **dims):
        super().__init__(**dims)
        self.mlp = nn.Sequential(nn.Linear(1, mlp_width), nn.ReLU(), nn.Linear(mlp_width, self.n_heads))
        self.c = nn.Parameter(torch.tensor(float(c_init)))
        self.L_mult = nn.Parameter(torch.tensor(1.0))
        if L_init is not None and L_init > self.n_ctx:
            raise ValueError(f"fire L_init={L_init} exceeds the training length n_ctx={self.n_ctx}; "
                             "use L_init <= n_ctx or the progressive interpolation never acts")
        self.L_init = float(self.n_ctx if L_init is None else L_init)
        self.eps = eps

    def normalized_distance(self, qpos, kpos) -> torch.Tensor:
        """psi(max(i - j, 0)) / psi(max(i, L)), (Tq, T)."""
        c = self.c.abs()
        dt = c.dtype  # float32 in training; the parameters' dtype (e.g. float64 in the fast-path tests)
        rel = _offsets(qpos, kpos).clamp(min=0).to(dt)
        L = (self.L_mult * self.L_init).abs()
        norm = torch.maximum(qpos.to(dt), L)  # (Tq,)
        return torch.log1p(c * rel) / (torch.log1p(c * norm)[:, None] + self.eps)

    def bias(self, qpos, kpos):
        return self.mlp(self.normalized_distance(qpos, kpos)[..., None]).permute(2, 0, 1)
