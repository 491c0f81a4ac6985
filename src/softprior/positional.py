"""Static positional schemes (SPEC section 5): the baselines the soft prior is compared against.

Every scheme is one ``PositionalScheme`` subclass behind the same four calls. The attention layer
does, per layer and head (q, k: (B, H, Tq, dh) and (B, H, T, dh); qpos [Tq], kpos [T] are the
absolute 0-indexed positions of the queries and keys, kpos ascending):

    x = token_embedding + scheme_of_layer_0.embed_positions(T)     # once per model; None = nothing
    q, k    = scheme.rotate(q, k, qpos, kpos)
    logits  = q @ k^T / sqrt(dh)                                    # (B, H, Tq, T)
    logits  = scheme.adjust_logits(logits, q, k, qpos, kpos)        # still unmasked
    logits += g_pos B^pos + g_content B^content                     # the model's soft prior (soft_*)
    pattern = softmax(causal_mask(logits))
    pattern = scheme.mix_pattern(pattern, qpos, kpos)               # row-stochastic, causal

Conventions shared by all schemes:
- the relative offset is i - j (query position minus key position), >= 0 on allowed keys;
- ``adjust_logits`` may put any finite value on future keys (j > i): the caller's causal mask
  removes them. The schemes never read a future key for an allowed entry (CoPE masks its gates
  itself, DAPE's MLP is pointwise in (i, j), GPSA masks its positional softmax), so the causal
  mask applied after ``adjust_logits`` is enough for the output to be causal;
- "beyond the training length" means T = 120 with n_ctx = 32 (the length test); each class
  docstring says what happens there;
- parameters live on the scheme instance. Each layer gets its own instance (``make_scheme(...,
  layer=l)``); where a reference shares parameters across layers we say so and say what we do;
- every forward is functional (no in-place writes to parameters, no ``.item()``), so the schemes
  run under ``torch.func.vmap(functional_call(...))`` as the grouped engine (engine.py) needs.

Adding a scheme: write one subclass (set ``name``; take ``**dims`` and pass them to
``super().__init__``; override the calls it needs) and add one ``SCHEMES`` entry.

The three soft-prior baselines (soft_bias, soft_pos_only, soft_content_only) are not schemes here:
they are the model's own gated prior on top of NoPE. The list of baselines (schemes and gated priors,
their gate settings and descriptions) lives in one place, ``softprior.baselines``.
"""

from __future__ import annotations

import math

import torch

from .registry import Registry
import torch.nn as nn

__all__ = [
    "PositionalScheme", "AdditiveBias", "make_scheme", "SCHEMES", "UnknownSchemeError", "alibi_slopes", "t5_bucket",
    "LearnedAbsolute", "NoPE", "RoPE", "ALiBi", "T5RelativeBias", "KerpleLog", "KerplePower", "FIRE",
    "CoPE", "DAPE", "GPSA",
]

DEFAULT_MAX_LEN = 128  # rows of the vanilla table: covers the T=120 length test


class UnknownSchemeError(ValueError):
    pass


def _offsets(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """i - j as a (Tq, T) long tensor."""
    return qpos[:, None] - kpos[None, :]


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Causal mask as booleans (Tq, T): key j visible from query i iff j <= i."""
    return kpos[None, :] <= qpos[:, None]


def _floor_clamp(p: torch.Tensor, lo: float, hi: float | None = None) -> torch.Tensor:
    """clamp(p, lo, hi) in the forward pass, identity in the backward pass (straight-through).

    The reference (KERPLE) rewrites ``param.data`` in place on every forward; a plain clamp would
    freeze a parameter pushed below the floor (zero gradient there). The straight-through clamp
    gives the same forward values without mutating weights, so it works under vmap and in eval."""
    return p + (p.clamp(min=lo, max=hi) - p).detach()


# ============================================================================ interface
class PositionalScheme(nn.Module):
    """Base class: the identity scheme. Subclasses override only what they change.

    Constructor keywords (all schemes): n_heads, d_head, d_model, n_ctx (training length), layer
    (this instance's layer index), n_layers."""

    name: str = "base"

    def __init__(self, *, n_heads: int, d_head: int, d_model: int, n_ctx: int, layer: int = 0,
                 n_layers: int = 1):
        super().__init__()
        self.n_heads, self.d_head, self.d_model = n_heads, d_head, d_model
        self.n_ctx, self.layer, self.n_layers = n_ctx, layer, n_layers

    def embed_positions(self, T: int) -> torch.Tensor | None:
        """[T, d_model] added to the token embeddings once per model, or None."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor):
        """q (B, H, Tq, dh), k (B, H, T, dh) -> rotated (q, k)."""
        return q, k

    def adjust_logits(self, logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """logits (B, H, Tq, T) = q.k/sqrt(dh), before the causal mask -> new (unmasked) logits."""
        return logits

    def mix_pattern(self, pattern: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """pattern (B, H, Tq, T) = softmax of the masked logits -> a row-stochastic causal pattern."""
        return pattern

    def extra_repr(self) -> str:
        return f"name={self.name!r}, layer={self.layer}, n_heads={self.n_heads}, n_ctx={self.n_ctx}"


class AdditiveBias(PositionalScheme):
    """A scheme that adds a bias b_h(i, j) to the scaled logits: s_ij = q.k/sqrt(dh) + b_h(i, j).

    Subclasses implement ``bias(qpos, kpos) -> (H, Tq, T)``; it is also handy for plots."""

    def bias(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def adjust_logits(self, logits, q, k, qpos, kpos):
        return logits + self.bias(qpos, kpos).to(logits.dtype)


# ============================================================================ schemes
class LearnedAbsolute(PositionalScheme):
    """vanilla: a learned absolute position table added to the token embeddings.

    Formula: x_t = E[token_t] + P[t] * d_model^-1/2, P a [max_len, d_model] table.
    Reference: x-transformers ``AbsolutePositionalEmbedding`` (x_transformers/x_transformers.py).
    Init: P ~ N(0, 1) (nn.Embedding's default) and the d_model^-1/2 output scale, as the reference.
    Sharing: one table per model, as the reference. Only the instance with ``layer == 0`` owns the
    table; instances of other layers have no parameters and their ``embed_positions`` returns None
    (every call is valid on every instance; the model calls it on layer 0's).
    Beyond the training length: the table has max(n_ctx, max_len) rows, max_len = 128 by default,
    so T = 120 runs. Rows n_ctx..max_len-1 (32..127 at n_ctx = 32) never receive a gradient: at
    T > n_ctx those positions get their random initial vectors (shrunk only by weight decay, if the
    optimiser decays this 2-D parameter). That is the honest behaviour of a learned absolute
    table, not a bug. A length above max_len raises (pass ``max_len=`` to make_scheme)."""

    name = "vanilla"

    def __init__(self, *, max_len: int = DEFAULT_MAX_LEN, **dims):
        super().__init__(**dims)
        self.max_len = max(self.n_ctx, max_len)
        self.scale = self.d_model ** -0.5
        if self.layer == 0:
            self.table = nn.Parameter(torch.randn(self.max_len, self.d_model))
        else:
            self.table = None

    def embed_positions(self, T: int) -> torch.Tensor | None:
        if self.table is None:
            return None
        if T > self.max_len:
            raise ValueError(f"vanilla position table has {self.max_len} rows but T={T}; "
                             f"build the scheme with max_len >= {T}")
        return self.table[:T] * self.scale


class NoPE(PositionalScheme):
    """nope: no positional term; only the causal mask orders the tokens.

    Reference: Kazemnejad et al. 2023 (a causal Transformer with no positional encoding).
    No parameters. Beyond the training length: nothing position-dependent to extrapolate; the
    model's behaviour at T = 120 depends only on how its content circuits handle longer contexts."""

    name = "nope"


class RoPE(PositionalScheme):
    """rope: rotary position embedding over the full head dimension.

    Formula: for k = 0..dh/2-1, inv_freq_k = 1 / base^(2k/dh) (base 10000); at position t the pair
    (x1, x2) = (x[k], x[k + dh/2]) becomes (x1 cos(t w_k) - x2 sin(t w_k), x1 sin(t w_k) + x2 cos(t w_k)).
    q is rotated at its query positions, k at its key positions, with the same pairing, so q_i.k_j
    depends on positions only through i - j. The pairing is the split-halves convention of GPT-NeoX
    and Hugging Face's ``rotate_half`` (dims k and k + dh/2). x-transformers' ``RotaryEmbedding``
    pairs adjacent dims (2k, 2k + 1) instead; the two are the same rotation up to one fixed
    permutation of the head dims applied to both q and k, which leaves q.k unchanged and which the
    learned Q/K projections absorb, so the function class is the same.
    Reference: Su et al. 2021 (RoFormer), eq. 34; GPT-NeoX for the pairing; x-transformers
    ``RotaryEmbedding`` for the base. Unlike x-transformers' default (which rotates only part of the
    head), all dh dims are rotated, the slowest pair included.
    No parameters (nothing to share). Beyond the training length: angles t w_k for t >= n_ctx were
    never seen; the fast pairs wrap around, the slow pairs (w_7 = 10^-3.5 at dh = 16) reach angles
    never trained. RoPE is known to extrapolate poorly; we keep it as the reference has it."""

    name = "rope"

    def __init__(self, *, base: float = 10000.0, **dims):
        super().__init__(**dims)
        if self.d_head % 2:
            raise ValueError(f"rope needs an even head dimension, got d_head={self.d_head}")
        self.base = base

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.d_head // 2
        inv_freq = self.base ** (-torch.arange(half, device=x.device, dtype=torch.float32) * 2 / self.d_head)
        angle = pos.to(device=x.device, dtype=torch.float32)[:, None] * inv_freq  # (T, dh/2)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def rotate(self, q, k, qpos, kpos):
        return self._rotate(q, qpos), self._rotate(k, kpos)


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
        return _offsets(qpos, kpos).abs().to(torch.float32)


class KerpleLog(_Kerple):
    """kerple_log: b_h(i, j) = -r1_h log(1 + r2_h |i - j|).

    Reference: Chi et al. 2022; chijames/KERPLE ``ParallelKerpleLog`` (megatron/model/
    positional_embeddings.py; also in chuanyang-Zheng/DAPE).
    Init: r1 ~ U(0, 2), r2 ~ U(0, 1), per head. Both are clamped to >= 0.01 on every forward (the
    reference clamps ``.data`` in place; we clamp the value with a straight-through gradient, so the
    forward is identical and nothing is mutated).
    Sharing: one (r1, r2) per head per layer, as the reference (one module per attention layer).
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
    Sharing: per head per layer, as the reference.
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
        rel = _offsets(qpos, kpos).clamp(min=0).to(torch.float32)
        L = (self.L_mult * self.L_init).abs()
        norm = torch.maximum(qpos.to(torch.float32), L)  # (Tq,)
        return torch.log1p(c * rel) / (torch.log1p(c * norm)[:, None] + self.eps)

    def bias(self, qpos, kpos):
        return self.mlp(self.normalized_distance(qpos, kpos)[..., None]).permute(2, 0, 1)


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
    Sharing: base and f per layer, as the reference (one module per attention layer).
    Beyond the training length: B extrapolates as Kerple's formula; f sees (X, B) pairs, and at
    T = 120 B takes values more negative than any in training, so f is evaluated off its trained
    range (the paper's claim is that this adapts well)."""

    name = "dape"

    def __init__(self, *, mlp_width: int = 32, **dims):
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
        delta = _offsets(qpos, kpos).to(torch.float32)
        feats = torch.stack([delta, delta * delta], dim=-1)  # (Tq, T, 2)
        return self.pos_proj(feats).permute(2, 0, 1)

    def mix_pattern(self, pattern, qpos, kpos):
        s = self.pos_scores(qpos, kpos).masked_fill(~_allowed(qpos, kpos), float("-inf"))
        pos = s.softmax(-1).to(pattern.dtype)
        g = torch.sigmoid(self.gating).to(pattern.dtype)[:, None, None]
        a = (1 - g) * pattern + g * pos
        return a / a.sum(-1, keepdim=True)


# ============================================================================ registry
SCHEMES: Registry[tuple[type[PositionalScheme], str]] = Registry(
    "positional scheme", UnknownSchemeError, describe=lambda e: e[1],
    hint="or none (the gated soft prior baselines are not schemes: softprior.baselines.resolve_baseline)", entries={
    "vanilla": (LearnedAbsolute, "learned absolute position table added to the token embeddings"),
    "nope": (NoPE, "no positional encoding; causal mask only"),
    "rope": (RoPE, "rotary embedding of q and k over the full head dim (base 10000)"),
    "alibi": (ALiBi, "fixed linear bias -m_h|i-j| with geometric head slopes"),
    "t5": (T5RelativeBias, "learned scalar bias per head over T5 log-spaced causal offset buckets"),
    "kerple_log": (KerpleLog, "learned kernel bias -r1 log(1 + r2|i-j|)"),
    "kerple_power": (KerplePower, "learned kernel bias -r1 |i-j|^r2, r2 in (0, 2]"),
    "fire": (FIRE, "MLP of the log-normalised offset psi(i-j)/psi(max(i, L))"),
    "cope": (CoPE, "contextual positions: counts of sigmoid(q.k) gates, interpolated embeddings"),
    "dape": (DAPE, "Kerple-log bias plus an MLP over (logits, bias) across heads"),
    "gpsa": (GPSA, "ConViT gated mix of content and positional (delta, delta^2) softmaxes"),
})


def make_scheme(name: str, *, n_heads: int, d_head: int, d_model: int, n_ctx: int, layer: int,
                n_layers: int, **options) -> PositionalScheme:
    """Build the scheme instance for one layer. ``options`` are scheme-specific keywords (e.g.
    ``max_len`` for vanilla, ``npos`` for cope, ``num_buckets`` for t5)."""
    if name not in SCHEMES:  # (the baselines module imports this one, so it is named, not imported)
        raise UnknownSchemeError(f"unknown positional scheme {name!r}; allowed: {', '.join(SCHEMES)} (the gated "
                                 f"soft prior baselines are not schemes: softprior.baselines.resolve_baseline)")
    if n_heads * d_head != d_model:
        raise ValueError(f"n_heads * d_head must equal d_model, got {n_heads} * {d_head} != {d_model}")
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer={layer} out of range for n_layers={n_layers}")
    cls = SCHEMES[name][0]
    dims = dict(n_heads=n_heads, d_head=d_head, d_model=d_model, n_ctx=n_ctx, layer=layer, n_layers=n_layers)
    try:
        return cls(**dims, **options)
    except TypeError as e:
        if not options:
            raise
        raise ValueError(f"bad options {sorted(options)} for scheme {name!r}: {e}") from e
