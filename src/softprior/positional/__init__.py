"""Static positional schemes (docs/DESIGN.md, "Baselines"): the baselines the soft prior is compared against.

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
  run under ``torch.func.vmap(functional_call(...))`` as the fast path (model/fastpath.py, point 6) and the
  grouped engine's readable fallback (training/loop.py) need.

Layout: ``base`` (the interface and shared helpers), one module per family (``absolute``: vanilla,
NoPE; ``rotary``: RoPE; ``bias``: ALiBi, T5, Kerple, FIRE; ``contextual``: CoPE, DAPE, GPSA), and the
registry here. Adding a scheme: write one subclass (set ``name``; take ``**dims`` and pass them to
``super().__init__``; override the calls it needs) and add one ``SCHEMES`` entry. It trains through
the readable model (vmapped) until ``fastpath._scheme_kind`` is taught it.

The three soft-prior baselines (soft_bias, soft_pos_only, soft_content_only) are not schemes here:
they are the model's own gated prior on top of NoPE. The list of baselines (schemes and gated priors,
their gate settings and descriptions) lives in one place, ``softprior.model.baselines``.
"""

from __future__ import annotations

from ..registry import Registry
from .absolute import LearnedAbsolute, NoPE
from .base import PositionalScheme, UnknownSchemeError
from .bias import ALiBi, FIRE, KerpleLog, KerplePower, T5RelativeBias
from .contextual import DAPE, GPSA, CoPE
from .rotary import RoPE

__all__ = ["make_scheme", "SCHEMES"]


# ============================================================================ registry
SCHEMES: Registry[tuple[type[PositionalScheme], str]] = Registry(
    "positional scheme", UnknownSchemeError, describe=lambda e: e[1],
    hint="or none (the gated soft prior baselines are not schemes: softprior.model.baselines.resolve_baseline)", entries={
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
                                 f"soft prior baselines are not schemes: softprior.model.baselines.resolve_baseline)")
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
