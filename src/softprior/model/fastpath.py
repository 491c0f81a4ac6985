"""The fast training forward: the readable model's function (``model/transformer.py``), rewritten for speed and
batched over a leading run dimension K (K = 1 for a single run).

``model.transformer.SoftPriorTransformer`` stays the one definition of the model; this module computes the
same logits from the same parameters (a test holds logits and gradients equal to 1e-5 on random
weights, ``tests/model/test_fastpath.py``) with fewer, larger kernels (or one: point 7). Autograd does the backward, except
for two small ``autograd.Function``s with hand-written backwards (``_Gather``, ``_Attention``). ``_Attention``
runs as the fused C++ operator of ``kernels/attention.py`` where that builds (``_attention``).

What it does differently (each an exact algebraic identity, so only rounding differs):

1. **LayerNorm weight and bias folded into the next projection** where the normalised input has
   many rows. With n = (x - mean) / std, ``LN(x) W^T = n (W diag(w))^T + W b``: the [B, T, d]
   affine multiply and its backward become an op on the [3d + 2Hr, d] weight (H heads, content rank
   r). (Where only a few rows are normalised, the vocabulary table and the final LayerNorm at the loss
   positions, the affine is applied directly: fewer ops.)
2. **in_proj rows regrouped per head**: per head ``[Q_h / sqrt(d_head), g_content,h U_h]``
   and ``[K_h, W_h]`` side by side, so the paper's logits ``Q K^T / sqrt(d_head) + g_c (xU)(xW)^T``
   are one batched matmul of the two blocks, without a concatenation of activations; the scale and
   the content gate ride on the weight. Every layer takes all rows in one ``index_select`` into the
   per-head order ``[Q_h, U_h, K_h, W_h, V_h]`` (``_per_head_rows``) with one per-row scale; middle
   layers then make three projections of the same normalised input (slicing one fused output
   measured slower in the backward).
3. **Layer 0 of a token model works on the vocabulary.** Its input is the token embedding, so
   ``LN(E[tok]) W^T = (LN(E) W^T)[tok]``: all in_proj rows are applied to the V vocabulary entries
   in one matmul ([V, d] x [d, 3d + 2Hr]), and the per-head query, key and value columns are gathered by
   token, straight into the head-major layout the batched attention matmuls want (no [B*T, d] x
   [d, 3d] projection, no head-split copies). Going through the rows once instead of three
   projections cuts the ops of a step (docs/PERFORMANCE.md, section 4, "Fused projections").
4. **The last layer, re-associated at the loss positions.** Only the positions that carry loss
   need outputs, so instead of projecting keys and values at every position,
   ``q_i . (W_K n_j + W_K b) = (W_K^T q_i) . n_j + const_i`` (the constant cancels in the softmax) and
   ``sum_j P_ij (W_V n_j + W_V b) = W_V (sum_j P_ij n_j) + W_V b`` (rows of P sum to 1); the output
   projection is folded in as ``M_h = W_O,h W_V,h`` (d x d per head). The last layer's cost then
   scales with the number of loss positions, not the context length.
5. **The residual add fused into the output projection** (``baddbmm``), the position bias gathered
   once per step as [K, H, T, T] with the causal mask added in, no [B, H, T, T] bias tensor.

6. **Positional schemes** (``_scheme_kind``), each computed by the scheme's own code on the run's own
   parameters (``functional_call`` of a template scheme, one run at a time):
   - those that only add a bias (ALiBi, T5, Kerple log and power, FIRE): b_h(i, j) per layer, added
     to the prior's bias before the mask, as ``AdditiveBias.adjust_logits`` adds it in the readable
     model; its gradient reaches the scheme's parameters through autograd. NoPE adds nothing.
   - vanilla: the learned table P[:T] d^-1/2 added to the input; layer 0 then runs the plain way
     (its input is no longer a function of the token alone, so point 3 does not apply).
   - RoPE: the first d_head columns of q and k rotated by position after the projections (the
     content-factor columns are not rotated, as in the readable model); the last layer runs the plain
     way (point 4's re-association does not pass through a rotation between q_i and k_j).
   - the contextual schemes (positional/contextual.py), whose logit or pattern depends on the content:
     CoPE and DAPE ("logits": ``adjust_logits`` of the logits q_ext . k_ext, content factors included,
     and of the unscaled q, before the prior's bias and the mask, as the readable ``Attention.forward``),
     GPSA ("pattern": ``mix_pattern`` of the softmax). The scheme runs on the logits laid out
     [K, B, H, Tq, T] (``_scheme_pattern``), one run at a time (``_scheme_eval``). The fused
     ``_Attention`` node only adds a batch-independent bias, so every plain layer of these schemes forms
     its logits and pattern in autograd instead (``_contextual_attention``); layer 0 still projects on
     the vocabulary (point 3: the input is still the token alone). The re-associated last layer (point
     4) stays: for CoPE and DAPE, which read the logits and not only their softmax, it adds back
     point 4's const_i (q_ext,i . the key and content-factor rows applied to the LayerNorm bias), which
     only a softmax cancels, and passes q at the loss positions (neither scheme reads k, which this
     layer never forms); GPSA's mixed pattern is renormalised to rows summing to 1,
     so the values re-associate as before.
   What each saves against ``vmap`` of the readable model, per run-step: docs/PERFORMANCE.md, section 4,
   "Positional schemes" (the contextual schemes measured by benchmarks/contextual_fastpath.py).

7. **The whole step in one operator** where it applies (``kernels/step.py``: the soft prior with no
   positional scheme, pre-LayerNorm, a token task whose last layer is re-associated): points 1-5 computed
   in C++ with their backward, layer 0's logits on vocabulary pairs, no autograd graph of the ops above.
   Elsewhere the functions below run, the attention through the fused operator where it builds.

Supported: the soft-prior model with no positional scheme or any registered one (nope, alibi, t5,
kerple, kerple_power, fire, vanilla, rope, cope, dape, gpsa; the soft_* baselines and every path),
token and vector tasks, any gate granularity. Anything else (a scheme ``_scheme_kind`` does not know;
active hooks) goes through the readable model (``supports``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.func import functional_call

from .. import kernels
from ..kernels import step as kstep
from .config import ModelConfig
from ..positional.rotary import rotate_pairs  # RoPE's rotation, shared with the readable scheme

__all__ = ["supports", "engine", "fast_forward", "stacked_params", "model_forward"]


def supports(cfg: ModelConfig) -> bool:
    """Whether ``fast_forward`` computes this model (else use the readable model): no positional
    scheme, or one the fast path implements (``_scheme_kind``); any prior family whose B^pos is a
    function of the query and key positions (``softprior.model.priors``: the bias is data to the
    attention, ``_family_bias``), but not one that replaces B^content (``content_bias``: it reads the
    residual stream, which the fast path never forms per layer); LayerNorms before the attention or
    none (post-LayerNorm runs in the readable model)."""
    return (_why_family(cfg) is None and _scheme_kind(cfg.positional) != "unsupported" and cfg.norm != "post")


def _why_family(cfg: ModelConfig) -> str | None:
    """Why the prior family keeps this model off the fast path (None: it does not)."""
    family = getattr(cfg, "prior_family", "soft")
    if family == "soft":
        return None
    from .priors import PositionalPrior
    for layer in range(cfg.n_layers):
        own = getattr(type(_prior_template(cfg, layer)), "content_bias", None)
        if own is not None and own is not PositionalPrior.content_bias:
            return f"prior family {family!r} replaces B^content (content_bias), which the fast path does not form"
    return None


def engine(cfg: ModelConfig, tokens: bool, T: int, P: int, device: str = "cpu") -> tuple[str, str | None]:
    """Which engine trains this model at context T with P loss positions, and why not the fastest:
    ("whole-step", None) for the whole-step operator (``kernels/step.py``); ("fast-path", why) for
    this module's run-stacked forward (its attention through the fused operator where it is built);
    ("readable", why) for the readable model, vmapped one run at a time. A run summary records it per
    run (``loop.run_summary``, ``engine``)."""
    if not supports(cfg):
        why = (_why_family(cfg) or ("post-LayerNorm is not on the fast path" if cfg.norm == "post" else
                                    f"positional scheme {cfg.positional!r} is not on the fast path"))
        return "readable", why
    why = kstep.why_not(cfg, tokens, T, P)
    if why is None and device != "cpu":
        why = f"device {device} (the operator is CPU code)"
    if why is None and not kstep.enabled():
        from ..kernels.attention import build_error
        why = f"the kernels' library is unavailable ({build_error() or 'switched off'})"
    return ("whole-step", None) if why is None else ("fast-path", why)


@lru_cache(maxsize=None)
def _scheme_kind(name: str) -> str | None:
    """How the fast path treats a positional scheme: None (no scheme), "none" (the identity scheme,
    NoPE), "bias" (a scheme whose only effect is ``AdditiveBias.adjust_logits``: ALiBi, T5, Kerple,
    FIRE), "absolute" (vanilla's learned table added to the input), "rotary" (RoPE), "logits" (a
    contextual scheme whose only effect is its ``adjust_logits`` of the logits and q, never k: CoPE,
    DAPE), "pattern" (one whose only effect is its ``mix_pattern``: GPSA), or "unsupported" (any
    other scheme: the readable model computes it). Classes are matched exactly (a subclass may read
    what its parent does not), so a new scheme is "unsupported" until the fast path is taught it."""
    if name == "none":
        return None
    from ..positional import SCHEMES
    from ..positional.absolute import LearnedAbsolute
    from ..positional.base import AdditiveBias, PositionalScheme
    from ..positional.contextual import DAPE, GPSA, CoPE
    from ..positional.rotary import RoPE
    cls = SCHEMES[name][0]
    changed = {f for f in ("embed_positions", "rotate", "adjust_logits", "mix_pattern")
               if getattr(cls, f) is not getattr(PositionalScheme, f)}
    if not changed:
        return "none"
    if changed == {"adjust_logits"} and cls.adjust_logits is AdditiveBias.adjust_logits:
        return "bias"
    if changed == {"embed_positions"} and cls is LearnedAbsolute:
        return "absolute"
    if changed == {"rotate"} and cls is RoPE:
        return "rotary"
    if changed == {"adjust_logits"} and cls in (CoPE, DAPE):  # positional/contextual.py: neither reads k
        return "logits"
    if changed == {"mix_pattern"} and cls is GPSA:
        return "pattern"
    return "unsupported"


_CONTEXTUAL = ("logits", "pattern")  # the kinds whose scheme reads the content (point 6)


class _SchemeCall(torch.nn.Module):
    """One method of a layer's scheme as a module's forward, for ``functional_call``."""

    def __init__(self, scheme, method: str):
        super().__init__()
        self.scheme, self.method = scheme, method

    def forward(self, *args):
        return getattr(self.scheme, self.method)(*args)


@lru_cache(maxsize=32)
def _scheme_module(name: str, method: str, H: int, dh: int, d: int, n_ctx: int, layer: int, L: int) -> _SchemeCall:
    """A template of layer ``layer``'s scheme: its own parameters are never read (``functional_call``
    substitutes the run's); built under a forked RNG so that building it draws nothing from the caller's."""
    from ..positional import make_scheme
    with torch.random.fork_rng(devices=[]):
        scheme = make_scheme(name, n_heads=H, d_head=dh, d_model=d, n_ctx=n_ctx, layer=layer, n_layers=L)
    return _SchemeCall(scheme, method)


def _scheme_eval(params: dict, cfg: ModelConfig, layer: int, K: int, method: str, *args,
                 per_run: tuple[bool, ...] = ()) -> torch.Tensor:
    """``scheme.method(*args)`` of layer ``layer``'s scheme for each of K runs, from the run-stacked
    scheme parameters (``blocks.{layer}.attn.scheme.*``): [K, ...], one run at a time.
    ``per_run[i]``: args[i] is the runs' own [K, ...] tensor (a contextual scheme's logits, q or
    pattern), sliced with the parameters; the other args (positions, None) are the same for every run.
    Not vmapped: a vmapped scheme runs batched kernels ([K, H] elementwise ops vectorised, matrix-vector
    products as batches) that round differently from one run's, so a run grouped with others would not
    compute what it computes alone (docs/DESIGN.md, "Bit-identity")."""
    mod = _scheme_module(cfg.positional, method, cfg.n_heads, cfg.d_head, cfg.d_model, cfg.n_ctx, layer, cfg.n_layers)
    pre = f"blocks.{layer}.attn."
    sub = {n[len(pre):]: p for n, p in params.items() if n.startswith(pre + "scheme.")}
    batched = tuple(i < len(per_run) and per_run[i] and a is not None for i, a in enumerate(args))
    if not any(batched) and not sub:  # no parameters (ALiBi): the same value for every run
        out = mod(*args)
        return out[None].expand(K, *out.shape)
    # strict: every parameter of the scheme comes from the run (never the template's own)
    return torch.stack([functional_call(mod, {n: p[k] for n, p in sub.items()},
                                        tuple(a[k] if b else a for a, b in zip(args, batched)), strict=True)
                        for k in range(K)])


@lru_cache(maxsize=64)
def _prior_template(cfg: ModelConfig, layer: int):
    """A template of layer ``layer``'s B^pos module (``priors.build_prior``) for a family other than
    soft: its own parameters are never read (``_family_bias`` substitutes the run's); built under a
    forked RNG so that building it draws nothing from the caller's."""
    from .priors import build_prior
    with torch.random.fork_rng(devices=[]):
        return build_prior(cfg, layer)


def _family_bias(params: dict, cfg: ModelConfig, layer: int, K: int, qpos: torch.Tensor,
                 kpos: torch.Tensor) -> torch.Tensor:
    """B^pos_h(i, j) of a registered family at layer ``layer`` for each of K runs, [K, H, Tq, T] (ungated),
    as the readable model's ``prior_module.bias(qpos, kpos)``, from the run-stacked parameters
    ``blocks.{layer}.attn.prior_module.*``, one run at a time (not vmapped: ``_scheme_eval``). The
    attention takes it as data, an additive input under the gate, and autograd carries its gradient
    into the family's parameters (the idea of FlexAttention's ``score_mod``)."""
    mod = _SchemeCall(_prior_template(cfg, layer), "bias")
    pre = f"blocks.{layer}.attn.prior_module."
    sub = {"scheme." + n[len(pre):]: p for n, p in params.items() if n.startswith(pre)}
    own = {"scheme." + n for n, _ in mod.scheme.named_parameters()}
    if set(sub) != own:
        raise ValueError(f"prior family of layer {layer}: parameters {sorted(own)} expected, got {sorted(sub)}")
    if not sub:  # no parameters (ALiBi, a layer without the prior): the same bias for every run
        out = mod(qpos, kpos)
        out = out[None].expand(K, *out.shape)
    else:  # the template's buffers (constants) stay; every parameter comes from the run
        out = torch.stack([functional_call(mod, {n: p[k] for n, p in sub.items()}, (qpos, kpos), strict=False)
                           for k in range(K)])
    return out * cfg.prior_gain if cfg.prior_gain != 1.0 else out  # the family's strength, as the readable model


def _with_family_biases(params: dict, cfg: ModelConfig, K: int, T: int) -> dict:
    """``params`` for the whole-step operator: as they are for the soft prior; for another family, each
    layer's table replaced by the family's bias at every (query, key) pair, [K, H, T, T] (ungated)."""
    if getattr(cfg, "prior_family", "soft") == "soft":
        return params
    table = params["blocks.0.attn.pos_bias"]
    kpos = torch.arange(T, device=table.device)
    return {**params, **{f"blocks.{l}.attn.pos_bias": _family_bias(params, cfg, l, K, kpos, kpos).to(table.dtype)
                         for l in range(cfg.n_layers)}}


def _prior_bias(params: dict, cfg: ModelConfig, l: int, c, gp: torch.Tensor, at_loss: bool) -> torch.Tensor:
    """g_pos,h B^pos_h(i, j) + the causal mask for layer ``l``, [K, H, Tq, T], at every query or at the
    loss positions (``at_loss``): the soft prior's table over offsets (``_pos_bias``) or a registered
    family's bias (``_family_bias``)."""
    off, mask = (c.off_q, c.mask_q) if at_loss else (c.off_all, c.mask_all)
    table = params[f"blocks.{l}.attn.pos_bias"]
    if getattr(cfg, "prior_family", "soft") == "soft":
        return _pos_bias(table, gp, off, mask)
    qpos = torch.tensor(c.pos, device=c.kpos.device) if at_loss else c.kpos
    b = _family_bias(params, cfg, l, c.K, qpos, c.kpos).to(table.dtype)
    return gp[:, :, None, None] * b + mask


def _scheme_pattern(params: dict, cfg: ModelConfig, layer: int, s: torch.Tensor, q: torch.Tensor | None,
                    k: torch.Tensor | None, bias: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """A contextual scheme's attention pattern, as the readable ``Attention.forward`` computes it:
    ``adjust_logits(s, q, k)`` (CoPE, DAPE), + the prior's bias and the mask, softmax, ``mix_pattern``
    (GPSA), each the scheme's own code on the run's parameters. s: [K, B, H, Tq, T] the logits
    q_ext . k_ext (the content factors included, as the readable model's ``scores``); q, k: [K, B, H, ., d_head]
    unscaled (None where the kind does not read them); bias: [K, H, Tq, T]. Returns [K, B, H, Tq, T]."""
    kind, K = _scheme_kind(cfg.positional), s.shape[0]
    if kind == "logits":
        s = _scheme_eval(params, cfg, layer, K, "adjust_logits", s, q, k, qpos, kpos, per_run=(True, True, True))
    p = torch.softmax(s + bias.unsqueeze(1), -1)
    if kind == "pattern":
        p = _scheme_eval(params, cfg, layer, K, "mix_pattern", p, qpos, kpos, per_run=(True,))
    return p


def _contextual_attention(params: dict, cfg: ModelConfig, layer: int, qe: torch.Tensor, ke: torch.Tensor,
                          v: torch.Tensor, bias: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """``_Attention`` for a contextual scheme (point 6), in autograd: z = pattern v with the pattern of
    ``_scheme_pattern`` (the fused node's additive bias cannot express a logit or pattern that depends
    on the content). qe, ke: [K*H*B, T, e] per head (qe's first d_head columns are q / sqrt(d_head),
    point 2); v: [K*H*B, T, d_head]; bias: [K, H, T, T]. Returns [K*H*B, T, d_head]."""
    K, H, T = bias.shape[0], bias.shape[1], bias.shape[-1]
    B, e, dh = qe.shape[0] // (K * H), qe.shape[-1], cfg.d_head
    s = torch.bmm(qe, ke.transpose(1, 2)).view(K, H, B, T, T).transpose(1, 2)  # [K, B, H, T, T]: the scheme's layout
    q = k = None
    if _scheme_kind(cfg.positional) == "logits":  # the readable model passes the unscaled q (and k)
        q = qe.view(K, H, B, T, e)[..., :dh].transpose(1, 2) * cfg.qk_unscale
        k = ke.view(K, H, B, T, e)[..., :dh].transpose(1, 2)
    p = _scheme_pattern(params, cfg, layer, s, q, k, bias, kpos, kpos)
    return torch.bmm(p.transpose(1, 2).reshape(K * H * B, T, T), v)


def _few(cfg: ModelConfig, P: int, T: int) -> bool:
    """Whether the last layer runs re-associated at the P loss positions (point 4): while few
    positions carry loss, and never under RoPE (a rotation between q_i and k_j does not move onto n)."""
    return 2 * P <= T and _scheme_kind(cfg.positional) != "rotary"


def _biases(params: dict, cfg: ModelConfig, K: int, T: int, pos: tuple[int, ...], dtype, device) -> list:
    """Per layer, a static additive scheme's bias b_h(i, j), [K, H, Tq, T], at the queries that layer
    computes (all T, or the loss positions for a re-associated last layer), or None (no such scheme).
    Added to the logits before the mask, as the readable model's ``AdditiveBias.adjust_logits`` adds
    it; its gradient reaches the scheme's parameters through autograd."""
    if _scheme_kind(cfg.positional) != "bias":
        return [None] * cfg.n_layers
    kpos = torch.arange(T, device=device)
    qpos = torch.tensor(pos, device=device) if _few(cfg, len(pos), T) else kpos
    return [_scheme_eval(params, cfg, l, K, "bias", qpos if l == cfg.n_layers - 1 else kpos, kpos).to(dtype)
            for l in range(cfg.n_layers)]


def _absolute(params: dict, cfg: ModelConfig, K: int, T: int, dtype) -> torch.Tensor | None:
    """vanilla's position embedding P[:T] * d^-1/2 for K runs, [K, T, d] (layer 0's scheme owns the
    table), added to the input as the readable model adds ``embed_positions``; None for other schemes."""
    if _scheme_kind(cfg.positional) != "absolute":
        return None
    return _scheme_eval(params, cfg, 0, K, "embed_positions", T).to(dtype)


def _rope_tables(cfg: ModelConfig, T: int, dtype, device):
    """RoPE's (cos, sin) at positions 0..T-1, [T, d_head / 2] each (the scheme's own ``angles``), or None."""
    if _scheme_kind(cfg.positional) != "rotary":
        return None
    scheme = _scheme_module(cfg.positional, "rotate", cfg.n_heads, cfg.d_head, cfg.d_model, cfg.n_ctx, 0,
                            cfg.n_layers).scheme
    cos, sin = scheme.angles(torch.arange(T, device=device), device, dtype)
    return cos.to(dtype), sin.to(dtype)


def stacked_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A single model's parameters as a run-stacked dict (K = 1 views; gradients flow back)."""
    return {n: p.unsqueeze(0) for n, p in model.named_parameters()}


def model_forward(model, inputs: torch.Tensor, gate_pos=None, gate_content=None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """``model(inputs, gate_pos, gate_content, positions=positions)`` for one run: through
    ``fast_forward`` when it supports the model and no hooks are active, else the readable model."""
    beyond = model.cfg.pos_beyond != "clip" and inputs.shape[1] > model.cfg.n_ctx  # _geometry clips offsets
    if positions is None or not supports(model.cfg) or model.hook_state.active or beyond:
        return model(inputs, gate_pos, gate_content, positions=positions)
    gp, gc = model.gates(gate_pos, gate_content)
    return fast_forward(stacked_params(model), model.cfg, inputs, gp[None], gc[None], positions)[0]


@lru_cache(maxsize=64)
def _geometry(T: int, n_ctx: int, positions: tuple[int, ...] | None, device: torch.device):
    """Clipped relative offsets and the causal mask (0 / -inf) for all queries and for ``positions``."""
    kpos = torch.arange(T, device=device)
    qpos = kpos if positions is None else torch.tensor(positions, device=device)
    off = (qpos[:, None] - kpos[None, :]).clamp(0, n_ctx - 1)
    mask = torch.zeros(len(qpos), T, device=device).masked_fill_(qpos[:, None] < kpos[None, :], float("-inf"))
    return off, mask


def _with_static(bias: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
    """The prior's bias (with the mask) plus a layer's static scheme bias, if the model has one (point 6)."""
    return bias if static is None else bias + static


def _pos_bias(table: torch.Tensor, g_pos: torch.Tensor, off: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """g_pos,h * B^pos_h[i - j] + causal mask: [K, H, Tq, T] (broadcast over the batch by the caller)."""
    return g_pos[:, :, None, None] * table[:, :, off] + mask


class _Gather(torch.autograd.Function):
    """rows = table[idx] (idx any shape, table [N, w]) with an ``index_add_`` backward: the
    embedding backward sorts its indices, slower for these few, often repeated rows (docs/PERFORMANCE.md, section 5)."""

    @staticmethod
    def forward(ctx, table, idx):
        ctx.save_for_backward(idx)
        ctx.n = table.shape[0]
        return table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        return g.new_zeros(ctx.n, g.shape[1]).index_add_(0, idx.reshape(-1), g), None


class _Attention(torch.autograd.Function):
    """z = softmax(q k^T + bias) v for a head-major batch, with a hand-written backward.

    q, k: [K*H*B, T, e]; v: [K*H*B, T, dh]; bias: [K, H, Tq, T] (broadcast over B). Backward
    (the softmax Jacobian applied row-wise): dP = dz v^T, dS = P * (dP - sum_j dP P), dq = dS k,
    dk = dS^T q, dv = P^T dz, dbias = sum_B dS. One node instead of eight, and every kernel sees
    contiguous operands (autograd's softmax backward got a strided gradient and ran slower: docs/PERFORMANCE.md,
    section 5).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias):
        K, H, Tq, T = bias.shape
        s = torch.bmm(q, k.transpose(1, 2)).view(K, H, -1, Tq, T).add_(bias.unsqueeze(2))
        p = torch.softmax(s, -1).view(q.shape[0], Tq, T)
        ctx.save_for_backward(q, k, v, p)
        ctx.shape = (K, H, Tq, T)
        return torch.bmm(p, v)

    @staticmethod
    def backward(ctx, dz):
        q, k, v, p = ctx.saved_tensors
        K, H, Tq, T = ctx.shape
        dz = dz.contiguous()
        dp = torch.bmm(dz, v.transpose(1, 2))
        ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)
        dq = torch.bmm(ds, k) if ctx.needs_input_grad[0] else None
        dk = torch.bmm(ds.transpose(1, 2), q) if ctx.needs_input_grad[1] else None
        dv = torch.bmm(p.transpose(1, 2), dz) if ctx.needs_input_grad[2] else None
        db = ds.view(K, H, -1, Tq, T).sum(2) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, db


@lru_cache(maxsize=16)
def _head_columns(d: int, H: int, dh: int, r: int, qs: float, device: torch.device):
    """The in_proj rows (stored Q | K | V | U | W) in per-head order [Q_h, U_h, K_h, W_h, V_h]
    (``perm``, [H * (2 dh + 2 r + dh)]), the constant part of their per-row scale (``qs``, the factor on
    Q K^T, on Q rows, 1 on K, W, V rows, 0 on U rows) and a mask of the U rows (which take the content gate)."""
    Q, Kb, Vb, U, Wb = 0, d, 2 * d, 3 * d, 3 * d + H * r
    rows, const, umask = [], [], []
    for h in range(H):
        for start, n, c, u in ((Q + h * dh, dh, qs, 0.0), (U + h * r, r, 0.0, 1.0),
                               (Kb + h * dh, dh, 1.0, 0.0), (Wb + h * r, r, 1.0, 0.0), (Vb + h * dh, dh, 1.0, 0.0)):
            rows += range(start, start + n)
            const += [c] * n
            umask += [u] * n
    w = 3 * dh + 2 * r
    return (torch.tensor(rows, device=device), torch.tensor(const, device=device).view(H, w),
            torch.tensor(umask, device=device).view(H, w))


def _per_head_rows(W: torch.Tensor, g_content: torch.Tensor, cfg: ModelConfig):
    """in_proj rows in per-head order [Q_h, U_h, K_h, W_h, V_h] ([K, H*w, d], one ``index_select``)
    and their scale ([K, H*w]: the factor on Q K^T on Q rows, the head's content gate on U rows, 1 elsewhere)."""
    perm, const, umask = _head_columns(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.content_rank, cfg.qk_scale, W.device)
    K = W.shape[0]
    return W.index_select(1, perm), torch.addcmul(const, g_content[:, :, None], umask).view(K, -1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``_Attention`` through the fused C++ operator where it is built (``kernels/attention.py``: the
    same function and backward, each block's scores kept in cache), else the pure-PyTorch node."""
    if q.device.type == "cpu" and kernels.available():
        return kernels.attention(q, k, v, bias)
    return _Attention.apply(q, k, v, bias)


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(table, idx)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-5)


def _normed(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """A block's LayerNorm without its affine (folded into the projections, point 1), or x itself
    for a model without LayerNorms (``norm="none"``)."""
    return _layer_norm(x) if cfg.norm == "pre" else x


def _ln_affine(params: dict, cfg: ModelConfig, pre: str, like: torch.Tensor):
    """A block's LayerNorm weight and bias [K, d]; a model without LayerNorms folds in ones and zeros
    (exact: the products equal the plain projection's)."""
    if cfg.norm == "pre":
        return params[pre + "ln.weight"], params[pre + "ln.bias"]
    K, d = like.shape[0], cfg.d_model
    return like.new_ones(K, d), like.new_zeros(K, d)


def _bmv(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A @ x for each of K runs (A [K, m, n], x [K, n, 1] -> [K, m, 1]), one ``bmm`` per run: a batch of
    one matrix-vector product takes another BLAS kernel (a gemv) than a batch of K (measured: the last
    bits differ), so a run grouped with others would round differently from the same run alone.
    Per run, every run computes exactly what it computes alone (docs/DESIGN.md, "Bit-identity")."""
    return _runwise(torch.bmm, A, x)


def _runwise(op, *args: torch.Tensor) -> torch.Tensor:
    """``op(*args)`` on run-stacked [K, ...] operands, one run at a time for K > 1 (``_bmv``'s reason)."""
    if args[0].shape[0] == 1:
        return op(*args)
    return torch.cat([op(*one) for one in zip(*(a.split(1) for a in args))])


def _proj(n: torch.Tensor, W: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor) -> torch.Tensor:
    """LN(x) W^T with the LayerNorm affine folded into W (point 1): n [K, N, d], W [K, m, d] -> [K, N, m]."""
    return torch.baddbmm(_bmv(W, ln_b[:, :, None]).transpose(1, 2), n, (W * ln_w[:, None, :]).transpose(1, 2))


def _take(x: torch.Tensor, pos: tuple[int, ...]) -> torch.Tensor:
    """x[:, :, pos] ([K, B, T, d]); a strided slice when the positions are evenly spaced (a cheaper backward)."""
    step = pos[1] - pos[0] if len(pos) > 1 else 1
    if step > 0 and list(pos) == list(range(pos[0], pos[-1] + 1, step)):
        return x[:, :, pos[0]:pos[-1] + 1:step]
    return x[:, :, list(pos)]


class _Ctx(NamedTuple):
    """What every layer of one ``fast_forward`` call shares: the sizes, the token or vector inputs
    [K, B, T(, d_in)], the loss positions, the offsets and masks for all queries (``_all``) and for the
    loss positions (``_q``), the static scheme biases, RoPE's tables and the key positions."""
    K: int
    B: int
    T: int
    inputs: torch.Tensor
    pos: tuple[int, ...]
    off_all: torch.Tensor
    mask_all: torch.Tensor
    off_q: torch.Tensor
    mask_q: torch.Tensor
    static: list
    rot: tuple | None
    kpos: torch.Tensor


def fast_forward(params: dict[str, torch.Tensor], cfg: ModelConfig, inputs: torch.Tensor,
                 g_pos: torch.Tensor, g_content: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Outputs at ``positions`` for K runs at once.

    params: run-stacked parameters [K, ...] named as ``SoftPriorTransformer.named_parameters()``.
    inputs: [K, B, T] tokens or [K, B, T, d_in] vectors (or without K: shared by all runs).
    g_pos, g_content: [K, L, H] gate values (as ``model.gates`` gives them, per run).
    Returns [K, B, P, vocab] logits (or [K, B, P, d_out]), equal to
    ``model(inputs, g_pos, g_content, positions=positions)`` for each run.
    """
    K, L = g_pos.shape[0], cfg.n_layers
    tokens = cfg.d_in is None
    pos = tuple(int(p) for p in positions.tolist())
    if inputs.device.type == "cpu" and kstep.supports(cfg, tokens, inputs.shape[-1], len(pos)) and kstep.enabled():
        # point 7: the whole step in C++ (a family's B^pos given to it as data, ``_with_family_biases``)
        return kstep.step_logits(_with_family_biases(params, cfg, K, inputs.shape[-1]), cfg, inputs, g_pos,
                                 g_content, pos)
    if inputs.dim() == (2 if tokens else 3):
        inputs = inputs.expand(K, *inputs.shape)
    B, T = inputs.shape[1], inputs.shape[2]
    dev = inputs.device
    dtype = params["blocks.0.attn.in_proj.weight"].dtype
    pe = _absolute(params, cfg, K, T, dtype)  # point 6
    c = _Ctx(K, B, T, inputs, pos, *_geometry(T, cfg.n_ctx, None, dev), *_geometry(T, cfg.n_ctx, pos, dev),
             _biases(params, cfg, K, T, pos, dtype, dev), _rope_tables(cfg, T, dtype, dev), torch.arange(T, device=dev))
    x = _embed(params, cfg, c, pe)
    # the last layer computes queries at the loss positions only, re-associated onto n (point 4): a
    # saving while few positions carry loss; with loss on most positions (Markov ``loss_on="determined"``,
    # P = T) the re-associated products cost more than a plain layer (docs/PERFORMANCE.md, section 5), so that
    # layer runs the plain way
    few = _few(cfg, len(pos), T)
    for l in range(L):
        if l < L - 1 or not few:
            vocab = l == 0 and tokens and pe is None  # layer 0 sees token embeddings only (point 3)
            qe, ke, v = (_vocab_heads if vocab else _plain_heads)(params, cfg, l, c, x, g_content[:, l])
            x = _full_attention(params, cfg, l, c, x, qe, ke, v, g_pos[:, l])
        else:
            x = _reassociated_layer(params, cfg, l, c, x, g_pos[:, l], g_content[:, l])
    if not few:
        x = _take(x.view(K, B, T, -1), pos).reshape(K, B * len(pos), -1)
    return _readout(params, cfg, c, x)


def _embed(params: dict, cfg: ModelConfig, c: _Ctx, pe: torch.Tensor | None) -> torch.Tensor:
    """The residual stream's input [K, B*T, d]: token embeddings (gathered) or the vectors' read-in,
    plus vanilla's position table where the scheme has one (point 6)."""
    K, B, T, d = c.K, c.B, c.T, cfg.d_model
    if cfg.d_in is None:
        E = params["embed.weight"]  # [K, V, d]
        V = E.shape[1]
        idx = c.inputs + (torch.arange(K, device=c.inputs.device) * V).view(K, 1, 1)
        x = _gather(E.reshape(K * V, d), idx)  # [K, B, T, d]
    else:
        # one run at a time: with few input features the weight's gradient is a long, thin product that
        # a multi-threaded BLAS splits along its sum for one run and not inside a batch (``_bmv``)
        x = _runwise(torch.baddbmm, params["read_in.bias"].unsqueeze(1), c.inputs.reshape(K, B * T, -1),
                     params["read_in.weight"].transpose(1, 2)).view(K, B, T, d)
    if pe is not None:  # vanilla: layer 0 then sees token + position, so it runs the plain way
        x = x + pe[:, None]
    return x.reshape(K, B * T, d)


def _vocab_heads(params: dict, cfg: ModelConfig, l: int, c: _Ctx, x: torch.Tensor, gc: torch.Tensor):
    """Layer 0 of a token model (point 3): LN(E) W^T for the V vocabulary rows with all in_proj rows in
    per-head order, scaled, laid out [K, H, V, .], gathered by token: (q_ext, k_ext, v), [K*H*B, T, .]."""
    K, B, T, H, d, dh, r = c.K, c.B, c.T, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    pre, e = f"blocks.{l}.", dh + r
    E = params["embed.weight"]
    V = E.shape[1]
    W_p, scale = _per_head_rows(params[pre + "attn.in_proj.weight"], gc, cfg)
    w = 2 * e + dh
    ln_w, ln_b = _ln_affine(params, cfg, pre, E)
    rows = torch.addcmul(ln_b[:, None, :], _normed(cfg, E), ln_w[:, None, :])
    tab = torch.bmm(rows, W_p.transpose(1, 2)) * scale[:, None, :]  # [K, V, H*w]
    tab = tab.view(K, V, H, w).transpose(1, 2)  # [K, H, V, w]
    hidx = c.inputs.unsqueeze(1) + (torch.arange(K * H, device=c.inputs.device) * V).view(K, H, 1, 1)  # [K, H, B, T]
    return tuple(_gather(tab[..., a:b].reshape(K * H * V, b - a), hidx).view(K * H * B, T, b - a)
                 for a, b in ((0, e), (e, 2 * e), (2 * e, w)))


def _plain_heads(params: dict, cfg: ModelConfig, l: int, c: _Ctx, x: torch.Tensor, gc: torch.Tensor):
    """A middle layer's (q_ext, k_ext, v), [K*H*B, T, .]: three projections of one LayerNorm of x with
    the in_proj rows in per-head order, scaled, the LayerNorm affine folded in (points 1, 2)."""
    K, B, T, H, d, dh, r = c.K, c.B, c.T, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    pre, e = f"blocks.{l}.", dh + r
    ln_w, ln_b = _ln_affine(params, cfg, pre, x)  # [K, d]
    W_p, scale = _per_head_rows(params[pre + "attn.in_proj.weight"], gc, cfg)
    Wh = (W_p * scale[:, :, None]).view(K, H, -1, d)
    W_qu, W_kw, W_v = (Wh[:, :, a:b].reshape(K, -1, d) for a, b in ((0, e), (e, 2 * e), (2 * e, None)))
    n = _normed(cfg, x)  # [K, B*T, d] (the affine part is folded into the weights)

    def heads(Wr, width):  # three projections of one n: slicing a fused output costs more
        y = _proj(n, Wr, ln_w, ln_b).view(K, B, T, H, width)
        return y.permute(0, 3, 1, 2, 4).reshape(K * H * B, T, width)
    return heads(W_qu, e), heads(W_kw, e), heads(W_v, dh)


def _full_attention(params: dict, cfg: ModelConfig, l: int, c: _Ctx, x: torch.Tensor, qe: torch.Tensor,
                    ke: torch.Tensor, v: torch.Tensor, gp: torch.Tensor) -> torch.Tensor:
    """x + attention(x) W_out^T for every position: the prior's bias with the mask (and a static
    scheme's), RoPE's rotation, the fused attention (or a contextual scheme's, point 6), the residual
    add fused into the output projection (point 5). Returns [K, B*T, d]."""
    K, B, T, d, dh = c.K, c.B, c.T, cfg.d_model, cfg.d_head
    pre = f"blocks.{l}."
    bias = _with_static(_prior_bias(params, cfg, l, c, gp, at_loss=False), c.static[l])
    if c.rot is not None:
        qe, ke = rotate_pairs(qe, *c.rot, dh), rotate_pairs(ke, *c.rot, dh)
    if _scheme_kind(cfg.positional) in _CONTEXTUAL:  # CoPE, DAPE, GPSA: the scheme's own code (point 6)
        z = _contextual_attention(params, cfg, l, qe, ke, v, bias, c.kpos)
    else:
        z = _attention(qe, ke, v, bias)  # [K*H*B, T, dh]
    z = z.view(K, cfg.n_heads, B, T, dh).permute(0, 2, 3, 1, 4).reshape(K, B * T, d)
    return torch.baddbmm(x, z, params[pre + "attn.out_proj.weight"].transpose(1, 2))


def _reassociated_layer(params: dict, cfg: ModelConfig, l: int, c: _Ctx, x: torch.Tensor, gp: torch.Tensor,
                        gc: torch.Tensor) -> torch.Tensor:
    """The last layer at the loss positions only, keys and values re-associated onto n (point 4): in_proj
    rows in per-head order [Q_h, U_h, K_h, W_h, V_h], scaled (1/sqrt(dh) on Q, the content gate on U),
    the LayerNorm affine folded in (point 1). Returns [K, B*P, d]."""
    K, B, T, P, pos = c.K, c.B, c.T, len(c.pos), c.pos
    H, d, dh, r = cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    pre, e = f"blocks.{l}.", dh + r
    ln_w, ln_b = _ln_affine(params, cfg, pre, x)  # [K, d]
    W_out = params[pre + "attn.out_proj.weight"]  # [K, d, d]
    W_p, scale = _per_head_rows(params[pre + "attn.in_proj.weight"], gc, cfg)
    w = 2 * e + dh
    Wp = W_p * scale[:, :, None]
    Wn = (Wp * ln_w[:, None, :]).view(K, H, w, d)
    bn = _bmv(Wp, ln_b[:, :, None]).view(K, H, w)  # each row applied to the LN bias
    n4 = _normed(cfg, x).view(K, B, T, d)
    qa = torch.baddbmm(bn.view(K, 1, H * w), _take(n4, pos).reshape(K, B * P, d),
                       Wn.view(K, H * w, d).transpose(1, 2))  # [K, B*P, H*w]: all rows, P positions
    q = qa.view(K, B * P, H, w)[..., :e].transpose(1, 2).reshape(K * H, B * P, e)
    qt = torch.bmm(q, Wn[:, :, e:2 * e].reshape(K * H, e, d))  # [K*H, B*P, d] = W_K,h^T q_h
    qt = qt.view(K, H, B, P, d).permute(0, 2, 1, 3, 4).reshape(K * B, H * P, d)
    s = torch.bmm(qt, n4.reshape(K * B, T, d).transpose(1, 2)).view(K, B, H, P, T)
    bias = _with_static(_prior_bias(params, cfg, l, c, gp, at_loss=True), c.static[l])
    if _scheme_kind(cfg.positional) in _CONTEXTUAL:  # point 6: the scheme's own code on these P queries
        qs = None
        if _scheme_kind(cfg.positional) == "logits":
            # CoPE and DAPE read the logits themselves, not only their softmax: add back point 4's
            # const_i = q_ext,i . bn_K (the key and content-factor rows applied to the LayerNorm
            # bias; it cancels only in a softmax), and pass the unscaled q; the keys are never
            # formed here (neither scheme reads k)
            const = torch.bmm(q, bn[:, :, e:2 * e].reshape(K * H, e, 1))  # [K*H, B*P, 1]
            s = s + const.view(K, H, B, P, 1).transpose(1, 2)
            qs = q.view(K, H, B, P, e)[..., :dh].transpose(1, 2) * cfg.qk_unscale
        # a mixed pattern's rows still sum to 1 (GPSA renormalises), so the values re-associate as before
        pm = _scheme_pattern(params, cfg, l, s, qs, None, bias, torch.tensor(pos, device=x.device), c.kpos)
    else:
        pm = (s + bias.unsqueeze(1)).softmax(-1)
    nbar = torch.bmm(pm.reshape(K * B, H * P, T), n4.reshape(K * B, T, d))  # [K*B, H*P, d]
    nbar = nbar.view(K, B, H, P, d).permute(0, 1, 3, 2, 4).reshape(K, B * P, H * d)
    W_o = W_out.view(K, d, H, dh).permute(0, 2, 1, 3)  # [K, H, d, dh]
    M = torch.matmul(W_o, Wn[:, :, 2 * e:])  # [K, H, d, d] = W_O,h W_V,h (LN weight folded)
    cb = _bmv(W_out, bn[:, :, 2 * e:].reshape(K, d, 1))  # [K, d, 1] = W_O W_V b
    xq = _take(x.view(K, B, T, d), pos).reshape(K, B * P, d)
    return torch.baddbmm(xq + cb.transpose(1, 2), nbar, M.permute(0, 1, 3, 2).reshape(K, H * d, d))


def _readout(params: dict, cfg: ModelConfig, c: _Ctx, x: torch.Tensor) -> torch.Tensor:
    """The final LayerNorm of the loss positions' x [K, B*P, d] and the tied unembedding (or the vector
    read-out): [K, B, P, .]."""
    if cfg.norm == "none":
        n = x
    else:
        wf, bf = params["ln_final.weight"], params["ln_final.bias"]
        n = torch.addcmul(bf[:, None, :], _layer_norm(x), wf[:, None, :])  # B*P rows: the affine is cheaper here than folded
    if cfg.d_in is None:
        out = torch.bmm(n, params["embed.weight"].transpose(1, 2))  # tied unembedding
    else:
        # one run at a time: with d_out = 1 each run's product is a matrix-vector one (``_bmv``)
        out = _runwise(torch.baddbmm, params["read_out.bias"][:, None, :], n, params["read_out.weight"].transpose(1, 2))
    return out.view(c.K, c.B, len(c.pos), -1)
