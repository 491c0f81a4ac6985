"""The fast training forward: the readable model's function (``model.py``), rewritten for speed and
batched over a leading run dimension K (K = 1 for a single run).

``model.SoftPriorTransformer`` stays the one definition of the model; this module computes the
same logits from the same parameters (a test holds logits and gradients equal to 1e-5 on random
weights, ``tests/test_fastpath.py``) with fewer, larger kernels. Autograd does the backward, except
for two small ``autograd.Function``s with hand-written backwards (``_Gather``, ``_Attention``).

What it does differently (each an exact algebraic identity, so only rounding differs):

1. **LayerNorm weight and bias folded into the next projection** where the normalised input has
   many rows. With n = (x - mean) / std, ``LN(x) W^T = n (W diag(w))^T + W b``: the [B, T, d]
   affine multiply and its backward become an op on a 208 x 64 weight. (Where only a few rows are
   normalised, the vocabulary table and the final LayerNorm at the loss positions, the affine is
   applied directly: fewer ops.)
2. **in_proj rows regrouped per head**: per head ``[Q_h / sqrt(d_head), g_content,h U_h]``
   and ``[K_h, W_h]`` side by side, so the paper's logits ``Q K^T / sqrt(d_head) + g_c (xU)(xW)^T``
   are one batched matmul of the two blocks, without a concatenation of activations; the scale and
   the content gate ride on the weight. Every layer takes all rows in one ``index_select`` into the
   per-head order ``[Q_h, U_h, K_h, W_h, V_h]`` (``_per_head_rows``) with one per-row scale; middle
   layers then make three projections of the same normalised input (slicing one fused output
   measured slower in the backward).
3. **Layer 0 of a token model works on the vocabulary.** Its input is the token embedding, so
   ``LN(E[tok]) W^T = (LN(E) W^T)[tok]``: all in_proj rows are applied to the V vocabulary entries
   in one matmul ([V, d] x [d, 208]), and the per-head query, key and value columns are gathered by
   token, straight into the head-major layout the batched attention matmuls want (no [B*T, d] x
   [d, 3d] projection, no head-split copies). Going through the rows once instead of three
   projections cut ~75 ops per step: 5.0-5.35 -> 4.6-4.8 ms/step (2 threads; docs/PERFORMANCE.md).
4. **The last layer, re-associated at the loss positions.** Only the positions that carry loss
   need outputs, so instead of projecting keys and values at every position,
   ``q_i . (W_K n_j + W_K b) = (W_K^T q_i) . n_j + const_i`` (the constant cancels in the softmax) and
   ``sum_j P_ij (W_V n_j + W_V b) = W_V (sum_j P_ij n_j) + W_V b`` (rows of P sum to 1); the output
   projection is folded in as ``M_h = W_O,h W_V,h`` (d x d per head). The last layer's cost then
   scales with the number of loss positions, not the context length.
5. **The residual add fused into the output projection** (``baddbmm``), the position bias gathered
   once per step as [K, H, T, T] with the causal mask added in, no [B, H, T, T] bias tensor.

6. **Optionally, no autograd graph at all** (docs/PERFORMANCE.md, the hand-written backward): ``backward="hand"`` (or
   ``$SOFTPRIOR_BACKWARD=hand``) runs the same forward as one ``autograd.Function`` (``_Whole``:
   ``_hand_forward`` saves what the backward reads, ``_hand_backward`` computes the gradient of every
   stacked parameter and of g_pos / g_content, formulas at ``_hand_forward``). The loss and the gate
   sigmoid stay in autograd, so learned gates get their gradient through ``gate_logits`` as before.
   Opt-in: it rounds differently in the last bits, so recorded runs would not reproduce their bits
   (the default, "autograd", does). Gain: ~1.25-1.4x on the fixed per-step cost (batch 1), but at
   batch 64 a step is dominated by the attention kernels and the gain is ~5% (docs/PERFORMANCE.md).

7. **Positional schemes** (``_scheme_kind``), each computed by the scheme's own code on the run's own
   parameters (``functional_call`` of a template scheme, vmapped over the runs):
   - those that only add a bias (ALiBi, T5, Kerple log and power, FIRE): b_h(i, j) per layer, added
     to the prior's bias before the mask, as ``AdditiveBias.adjust_logits`` adds it in the readable
     model; its gradient reaches the scheme's parameters through autograd (in the hand path it enters
     ``_Whole`` as one more input whose gradient is dbias). NoPE adds nothing.
   - vanilla: the learned table P[:T] d^-1/2 added to the input; layer 0 then runs the plain way
     (its input is no longer a function of the token alone, so point 3 does not apply).
   - RoPE: the first d_head columns of q and k rotated by position after the projections (the
     content-factor columns are not rotated, as in the readable model); the last layer runs the plain
     way (point 4's re-association does not pass through a rotation between q_i and k_j); the hand
     backward applies the inverse rotation to dq and dk.
   - the contextual schemes (positional/contextual.py), whose logit or pattern depends on the content:
     CoPE and DAPE ("logits": ``adjust_logits`` of the logits q_ext . k_ext, content factors included,
     and of the unscaled q, before the prior's bias and the mask, as the readable ``Attention.forward``),
     GPSA ("pattern": ``mix_pattern`` of the softmax). The scheme runs on the logits laid out
     [K, B, H, Tq, T] (``_scheme_pattern``), vmapped over the runs (one run: no vmap). The fused
     ``_Attention`` node only adds a batch-independent bias, so every plain layer of these schemes forms
     its logits and pattern in autograd instead (``_contextual_attention``); layer 0 still projects on
     the vocabulary (point 3: the input is still the token alone). The re-associated last layer (point
     4) stays: for CoPE and DAPE, which read the logits and not only their softmax, it adds back
     point 4's const_i (q_ext,i . the key and content-factor rows applied to the LayerNorm bias), which
     only a softmax cancels, and passes q at the loss positions (neither scheme reads k, which this
     layer never forms); GPSA's mixed pattern is renormalised to rows summing to 1,
     so the values re-associate as before. The hand backward (point 6) does not compute them:
     ``fast_forward`` takes the autograd backward for them whatever ``backward`` says.
   Against ``vmap`` of the readable model, per run-step (docs/PERFORMANCE.md): ~2x for the bias
   schemes and NoPE, 1.2-1.4x for vanilla, 1.1-1.4x for RoPE (the contextual schemes:
   benchmarks/contextual_fastpath.py).

Supported: the soft-prior model with no positional scheme or any registered one (nope, alibi, t5,
kerple, kerple_power, fire, vanilla, rope, cope, dape, gpsa; the soft_* baselines and every path),
token and vector tasks, any gate granularity. Anything else (a scheme ``_scheme_kind`` does not know;
active hooks) goes through the readable model (``supports``).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from .model import ModelConfig
from .positional.rotary import rotate_pairs  # RoPE's rotation, shared with the readable scheme

__all__ = ["supports", "fast_forward", "hand_forward", "stacked_params", "model_forward"]


def supports(cfg: ModelConfig) -> bool:
    """Whether ``fast_forward`` computes this model (else use the readable model): no static scheme,
    or one the fast path implements (``_scheme_kind``)."""
    return _scheme_kind(cfg.positional) != "unsupported"


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
    from .positional import GPSA, SCHEMES, AdditiveBias, CoPE, DAPE, LearnedAbsolute, PositionalScheme, RoPE
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


_CONTEXTUAL = ("logits", "pattern")  # the kinds whose scheme reads the content (point 7)


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
    from .positional import make_scheme
    with torch.random.fork_rng(devices=[]):
        scheme = make_scheme(name, n_heads=H, d_head=dh, d_model=d, n_ctx=n_ctx, layer=layer, n_layers=L)
    return _SchemeCall(scheme, method)


def _scheme_eval(params: dict, cfg: ModelConfig, layer: int, K: int, method: str, *args,
                 per_run: tuple[bool, ...] = ()) -> torch.Tensor:
    """``scheme.method(*args)`` of layer ``layer``'s scheme for each of K runs, from the run-stacked
    scheme parameters (``blocks.{layer}.attn.scheme.*``): [K, ...] (vmapped over the runs).
    ``per_run[i]``: args[i] is the runs' own [K, ...] tensor (a contextual scheme's logits, q or
    pattern), mapped with the parameters; the other args (positions, None) are the same for every run."""
    mod = _scheme_module(cfg.positional, method, cfg.n_heads, cfg.d_head, cfg.d_model, cfg.n_ctx, layer, cfg.n_layers)
    pre = f"blocks.{layer}.attn."
    sub = {n[len(pre):]: p for n, p in params.items() if n.startswith(pre + "scheme.")}
    batched = tuple(i < len(per_run) and per_run[i] and a is not None for i, a in enumerate(args))
    if not any(batched):
        if not sub:  # no parameters (ALiBi): the same value for every run
            out = mod(*args)
            return out[None].expand(K, *out.shape)
        if K == 1:  # strict: every parameter of the scheme comes from the run (never the template's own)
            return functional_call(mod, {n: p[0] for n, p in sub.items()}, args, strict=True)[None]
        return vmap(lambda p: functional_call(mod, p, args, strict=True))(sub)
    if K == 1:  # one run: its own slice of everything, no vmap (fewer ops)
        one = tuple(a[0] if b else a for a, b in zip(args, batched))
        return functional_call(mod, {n: p[0] for n, p in sub.items()}, one, strict=True)[None]
    return vmap(lambda p, *a: functional_call(mod, p, a, strict=True),
                in_dims=(0, *(0 if b else None for b in batched)))(sub, *args)


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
    """``_Attention`` for a contextual scheme (point 7), in autograd: z = pattern v with the pattern of
    ``_scheme_pattern`` (the fused node's additive bias cannot express a logit or pattern that depends
    on the content). qe, ke: [K*H*B, T, e] per head (qe's first d_head columns are q / sqrt(d_head),
    point 2); v: [K*H*B, T, d_head]; bias: [K, H, T, T]. Returns [K*H*B, T, d_head]."""
    K, H, T = bias.shape[0], bias.shape[1], bias.shape[-1]
    B, e, dh = qe.shape[0] // (K * H), qe.shape[-1], cfg.d_head
    s = torch.bmm(qe, ke.transpose(1, 2)).view(K, H, B, T, T).transpose(1, 2)  # [K, B, H, T, T]: the scheme's layout
    q = k = None
    if _scheme_kind(cfg.positional) == "logits":  # the readable model passes the unscaled q (and k)
        q = qe.view(K, H, B, T, e)[..., :dh].transpose(1, 2) * math.sqrt(dh)
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
    if positions is None or not supports(model.cfg) or model.hook_state.active:
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
    """The prior's bias (with the mask) plus a layer's static scheme bias, if the model has one (point 7)."""
    return bias if static is None else bias + static


def _pos_bias(table: torch.Tensor, g_pos: torch.Tensor, off: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """g_pos,h * B^pos_h[i - j] + causal mask: [K, H, Tq, T] (broadcast over the batch by the caller)."""
    return g_pos[:, :, None, None] * table[:, :, off] + mask


class _Gather(torch.autograd.Function):
    """rows = table[idx] (idx any shape, table [N, w]) with an ``index_add_`` backward: the
    embedding backward sorts its indices and measured 3-4x slower for these few, often repeated rows."""

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
    contiguous operands (autograd's softmax backward got a strided gradient and ran 5x slower).
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
def _head_columns(d: int, H: int, dh: int, r: int, device: torch.device):
    """The in_proj rows (stored Q | K | V | U | W) in per-head order [Q_h, U_h, K_h, W_h, V_h]
    (``perm``, [H * (2 dh + 2 r + dh)]), the constant part of their per-row scale (1/sqrt(dh) on
    Q rows, 1 on K, W, V rows, 0 on U rows) and a mask of the U rows (which take the content gate)."""
    Q, Kb, Vb, U, Wb = 0, d, 2 * d, 3 * d, 3 * d + H * r
    rows, const, umask = [], [], []
    for h in range(H):
        for start, n, c, u in ((Q + h * dh, dh, 1.0 / math.sqrt(dh), 0.0), (U + h * r, r, 0.0, 1.0),
                               (Kb + h * dh, dh, 1.0, 0.0), (Wb + h * r, r, 1.0, 0.0), (Vb + h * dh, dh, 1.0, 0.0)):
            rows += range(start, start + n)
            const += [c] * n
            umask += [u] * n
    w = 3 * dh + 2 * r
    return (torch.tensor(rows, device=device), torch.tensor(const, device=device).view(H, w),
            torch.tensor(umask, device=device).view(H, w))


def _per_head_rows(W: torch.Tensor, g_content: torch.Tensor, d: int, H: int, dh: int, r: int):
    """in_proj rows in per-head order [Q_h, U_h, K_h, W_h, V_h] ([K, H*w, d], one ``index_select``)
    and their scale ([K, H*w]: 1/sqrt(dh) on Q rows, the head's content gate on U rows, 1 elsewhere)."""
    perm, const, umask = _head_columns(d, H, dh, r, W.device)
    K = W.shape[0]
    return W.index_select(1, perm), torch.addcmul(const, g_content[:, :, None], umask).view(K, -1)


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(table, idx)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-5)


def _proj(n: torch.Tensor, W: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor) -> torch.Tensor:
    """LN(x) W^T with the LayerNorm affine folded into W (point 1): n [K, N, d], W [K, m, d] -> [K, N, m]."""
    return torch.baddbmm((W @ ln_b[:, :, None]).transpose(1, 2), n, (W * ln_w[:, None, :]).transpose(1, 2))


def _take(x: torch.Tensor, pos: tuple[int, ...]) -> torch.Tensor:
    """x[:, :, pos] ([K, B, T, d]); a strided slice when the positions are evenly spaced (a cheaper backward)."""
    step = pos[1] - pos[0] if len(pos) > 1 else 1
    if step > 0 and list(pos) == list(range(pos[0], pos[-1] + 1, step)):
        return x[:, :, pos[0]:pos[-1] + 1:step]
    return x[:, :, list(pos)]


def fast_forward(params: dict[str, torch.Tensor], cfg: ModelConfig, inputs: torch.Tensor,
                 g_pos: torch.Tensor, g_content: torch.Tensor, positions: torch.Tensor,
                 backward: str | None = None) -> torch.Tensor:
    """Outputs at ``positions`` for K runs at once.

    backward: "autograd" (autograd over the ops below; the default, and the recorded runs' bits) or
    "hand" (``hand_forward``: one node with a hand-written backward for the whole model); None reads
    ``$SOFTPRIOR_BACKWARD`` (default "autograd"). Without grad (evaluation) both run this forward.

    params: run-stacked parameters [K, ...] named as ``SoftPriorTransformer.named_parameters()``.
    inputs: [K, B, T] tokens or [K, B, T, d_in] vectors (or without K: shared by all runs).
    g_pos, g_content: [K, L, H] gate values (as ``model.gates`` gives them, per run).
    Returns [K, B, P, vocab] logits (or [K, B, P, d_out]), equal to
    ``model(inputs, g_pos, g_content, positions=positions)`` for each run.
    """
    contextual = _scheme_kind(cfg.positional) in _CONTEXTUAL
    if torch.is_grad_enabled() and _backward_mode(backward) == "hand" and not contextual:
        return hand_forward(params, cfg, inputs, g_pos, g_content, positions)
    L, H, d, dh, r = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    e = dh + r
    K = g_pos.shape[0]
    tokens = cfg.d_in is None
    if inputs.dim() == (2 if tokens else 3):
        inputs = inputs.expand(K, *inputs.shape)
    B, T = inputs.shape[1], inputs.shape[2]
    pos = tuple(int(p) for p in positions.tolist())
    P = len(pos)
    off_all, mask_all = _geometry(T, cfg.n_ctx, None, inputs.device)
    off_q, mask_q = _geometry(T, cfg.n_ctx, pos, inputs.device)
    dtype = params["blocks.0.attn.in_proj.weight"].dtype
    static = _biases(params, cfg, K, T, pos, dtype, inputs.device)
    pe, rot = _absolute(params, cfg, K, T, dtype), _rope_tables(cfg, T, dtype, inputs.device)  # point 7
    kpos = torch.arange(T, device=inputs.device)

    if tokens:
        E = params["embed.weight"]  # [K, V, d]
        V = E.shape[1]
        idx = inputs + (torch.arange(K, device=inputs.device) * V).view(K, 1, 1)
        x = _gather(E.reshape(K * V, d), idx)  # [K, B, T, d]
    else:
        x = torch.baddbmm(params["read_in.bias"].unsqueeze(1), inputs.reshape(K, B * T, -1),
                          params["read_in.weight"].transpose(1, 2)).view(K, B, T, d)
    if pe is not None:  # vanilla: layer 0 then sees token + position, so it runs the plain way
        x = x + pe[:, None]
    x = x.reshape(K, B * T, d)

    # the last layer computes queries at the loss positions only, re-associated onto n (point 4): a
    # saving while few positions carry loss; with loss on most positions (Markov ``loss_on="determined"``,
    # P = T) the re-associated products cost ~3x a plain layer, so that layer runs the plain way
    few = _few(cfg, P, T)
    for l in range(L):
        pre = f"blocks.{l}."
        W = params[pre + "attn.in_proj.weight"]  # [K, 3d + 2Hr, d]
        ln_w, ln_b = params[pre + "ln.weight"], params[pre + "ln.bias"]  # [K, d]
        W_out = params[pre + "attn.out_proj.weight"]  # [K, d, d]
        table = params[pre + "attn.pos_bias"]  # [K, H, n_ctx]
        gp, gc = g_pos[:, l], g_content[:, l]  # [K, H]
        if l < L - 1 or not few:
            if l == 0 and tokens and pe is None:
                # layer 0 sees token embeddings only (point 3): LN(E) W^T for the V vocabulary rows
                # with all in_proj rows in per-head order, scaled, laid out [K, H, V, .], gathered by token
                W_p, scale = _per_head_rows(W, gc, d, H, dh, r)
                w = 2 * e + dh
                rows = torch.addcmul(ln_b[:, None, :], _layer_norm(E), ln_w[:, None, :])  # [K, V, d]
                tab = torch.bmm(rows, W_p.transpose(1, 2)) * scale[:, None, :]  # [K, V, H*w]
                tab = tab.view(K, V, H, w).transpose(1, 2)  # [K, H, V, w]
                hidx = inputs.unsqueeze(1) + (torch.arange(K * H, device=inputs.device) * V).view(K, H, 1, 1)  # [K, H, B, T]
                qe, ke, v = (_gather(tab[..., a:b].reshape(K * H * V, b - a), hidx).view(K * H * B, T, b - a)
                             for a, b in ((0, e), (e, 2 * e), (2 * e, w)))
            else:
                W_p, scale = _per_head_rows(W, gc, d, H, dh, r)
                Wh = (W_p * scale[:, :, None]).view(K, H, -1, d)
                W_qu, W_kw, W_v = (Wh[:, :, a:b].reshape(K, -1, d) for a, b in ((0, e), (e, 2 * e), (2 * e, None)))
                n = _layer_norm(x)  # [K, B*T, d] (the affine part is folded into the weights)

                def heads(Wr, width):  # three projections of one n: slicing a fused output costs more
                    y = _proj(n, Wr, ln_w, ln_b).view(K, B, T, H, width)
                    return y.permute(0, 3, 1, 2, 4).reshape(K * H * B, T, width)
                qe, ke, v = heads(W_qu, e), heads(W_kw, e), heads(W_v, dh)
            bias = _with_static(_pos_bias(table, gp, off_all, mask_all), static[l])
            if rot is not None:
                qe, ke = rotate_pairs(qe, *rot, dh), rotate_pairs(ke, *rot, dh)
            if contextual:  # CoPE, DAPE, GPSA: the scheme's own code between logits and pattern (point 7)
                z = _contextual_attention(params, cfg, l, qe, ke, v, bias, kpos)
            else:
                z = _Attention.apply(qe, ke, v, bias)  # [K*H*B, T, dh]
            z = z.view(K, H, B, T, dh).permute(0, 2, 3, 1, 4).reshape(K, B * T, d)
            x = torch.baddbmm(x, z, W_out.transpose(1, 2))  # residual + output projection (point 5)
        else:
            # queries at the loss positions only; keys and values re-associated onto n (point 4)
            # in_proj rows in per-head order [Q_h, U_h, K_h, W_h, V_h], scaled (1/sqrt(dh) on Q, the
            # content gate on U); the LayerNorm affine folded in (point 1)
            W_p, scale = _per_head_rows(W, gc, d, H, dh, r)
            w = 2 * e + dh
            Wp = W_p * scale[:, :, None]
            Wn = (Wp * ln_w[:, None, :]).view(K, H, w, d)
            bn = torch.bmm(Wp, ln_b[:, :, None]).view(K, H, w)  # each row applied to the LN bias
            n4 = _layer_norm(x).view(K, B, T, d)
            qa = torch.baddbmm(bn.view(K, 1, H * w), _take(n4, pos).reshape(K, B * P, d),
                               Wn.view(K, H * w, d).transpose(1, 2))  # [K, B*P, H*w]: all rows, P positions
            q = qa.view(K, B * P, H, w)[..., :e].transpose(1, 2).reshape(K * H, B * P, e)
            qt = torch.bmm(q, Wn[:, :, e:2 * e].reshape(K * H, e, d))  # [K*H, B*P, d] = W_K,h^T q_h
            qt = qt.view(K, H, B, P, d).permute(0, 2, 1, 3, 4).reshape(K * B, H * P, d)
            s = torch.bmm(qt, n4.reshape(K * B, T, d).transpose(1, 2)).view(K, B, H, P, T)
            bias = _with_static(_pos_bias(table, gp, off_q, mask_q), static[l])
            if contextual:  # point 7: the scheme's own code on these P queries' logits and pattern
                qs = None
                if _scheme_kind(cfg.positional) == "logits":
                    # CoPE and DAPE read the logits themselves, not only their softmax: add back point 4's
                    # const_i = q_ext,i . bn_K (the key and content-factor rows applied to the LayerNorm
                    # bias; it cancels only in a softmax), and pass the unscaled q; the keys are never
                    # formed here (neither scheme reads k)
                    const = torch.bmm(q, bn[:, :, e:2 * e].reshape(K * H, e, 1))  # [K*H, B*P, 1]
                    s = s + const.view(K, H, B, P, 1).transpose(1, 2)
                    qs = q.view(K, H, B, P, e)[..., :dh].transpose(1, 2) * math.sqrt(dh)
                # a mixed pattern's rows still sum to 1 (GPSA renormalises), so the values re-associate as before
                pm = _scheme_pattern(params, cfg, l, s, qs, None, bias, torch.tensor(pos, device=inputs.device), kpos)
            else:
                pm = (s + bias.unsqueeze(1)).softmax(-1)
            nbar = torch.bmm(pm.reshape(K * B, H * P, T), n4.reshape(K * B, T, d))  # [K*B, H*P, d]
            nbar = nbar.view(K, B, H, P, d).permute(0, 1, 3, 2, 4).reshape(K, B * P, H * d)
            W_o = W_out.view(K, d, H, dh).permute(0, 2, 1, 3)  # [K, H, d, dh]
            M = torch.matmul(W_o, Wn[:, :, 2 * e:])  # [K, H, d, d] = W_O,h W_V,h (LN weight folded)
            c = torch.bmm(W_out, bn[:, :, 2 * e:].reshape(K, d, 1))  # [K, d, 1] = W_O W_V b
            xq = _take(x.view(K, B, T, d), pos).reshape(K, B * P, d)
            x = torch.baddbmm(xq + c.transpose(1, 2), nbar, M.permute(0, 1, 3, 2).reshape(K, H * d, d))
    if not few:
        x = _take(x.view(K, B, T, d), pos).reshape(K, B * P, d)
    n = _layer_norm(x)  # [K, B*P, d]
    wf, bf = params["ln_final.weight"], params["ln_final.bias"]
    n = torch.addcmul(bf[:, None, :], n, wf[:, None, :])  # only B*P rows: the affine is cheaper here than folded
    if tokens:
        out = torch.bmm(n, E.transpose(1, 2))  # tied unembedding
    else:
        out = torch.baddbmm(params["read_out.bias"][:, None, :], n, params["read_out.weight"].transpose(1, 2))
    return out.view(K, B, P, -1)


# ===================================================================================== hand backward
# Issue 16: the whole fast forward as one ``autograd.Function`` whose backward is written out by hand,
# so that a training step builds no autograd graph over the ~150 forward ops (autograd's per-node
# bookkeeping is a large share of a step's time for a model this small). The forward is
# ``fast_forward``'s, op for op where it matters (points 1-5 above), saving what the backward reads.
# Opt-in (``backward="hand"`` or ``$SOFTPRIOR_BACKWARD=hand``): it rounds differently from autograd's
# backward in the last bits, so recorded runs would change bits.
#
# Formulas used (per run; rows are batch x position):
# - LayerNorm without affine, n = (x - mean) * rstd:  dx = rstd * (dn - mean(dn) - n * mean(dn * n))
#   (row means over the feature dim; aten's ``native_layer_norm_backward`` computes exactly this).
# - LayerNorm affine applied as h = n * w + b:  dw = sum_rows dh * n,  db = sum_rows dh,  dn = dh * w.
# - Linear y = x A^T + c:  dx = dy A,  dA = dy^T x,  dc = sum_rows dy.
# - Folded LayerNorm (point 1), A = Ws diag(w), c = Ws b:  dWs = dA diag(w) + dc b^T,
#   dw = sum_rows(dA * Ws),  db = Ws^T dc.
# - Per-head rows Ws = W[perm] * scale (scale = 1/sqrt(dh) on Q rows, g_content,h on U rows, 1 else):
#   dW[perm] = dWs * scale,  dscale = sum_cols(dWs * W[perm]),  dg_content,h = sum over the U rows of dscale.
# - Softmax P = softmax(S) row-wise:  dS = P * (dP - sum_j dP_j P_j).
# - Attention S = q k^T + bias, z = P v:  dP = dz v^T, dq = dS k, dk = dS^T q, dv = P^T dz, dbias = sum_B dS.
# - Position bias bias = g_pos,h * table_h[off] + mask:  dg_pos,h = sum(dbias * table_h[off]),
#   dtable_h = scatter-add of g_pos,h * dbias over the offsets (masked entries have dS = 0).
# - Gathers rows = table[idx]:  dtable = index_add of drows at idx.

_BACKWARDS = ("autograd", "hand")
_STATIC = "static_bias."  # the hand path's name of layer l's static scheme bias (an input of ``_Whole``)
_ABS = "absolute_positions"  # and of vanilla's position embedding [K, T, d]


def _backward_mode(backward: str | None) -> str:
    mode = backward or os.environ.get("SOFTPRIOR_BACKWARD") or "autograd"
    if mode not in _BACKWARDS:
        raise ValueError(f"backward must be one of {_BACKWARDS}, got {mode!r}")
    return mode


@lru_cache(maxsize=16)
def _inverse_perm(perm_key: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
    d, H, dh, r = perm_key
    perm = _head_columns(d, H, dh, r, device)[0]
    return torch.argsort(perm)


def _ln_fwd(x: torch.Tensor):
    """n = (x - mean) * rstd over the last dim: (n, mean, rstd)."""
    return torch.native_layer_norm(x, x.shape[-1:], None, None, 1e-5)


def _ln_bwd(dn: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx = rstd * (dn - mean(dn) - n * mean(dn * n)) (see the formulas above)."""
    return torch.ops.aten.native_layer_norm_backward(dn, x, x.shape[-1:], mean, rstd, None, None,
                                                    [True, False, False])[0]


def _unscale(dWs, W_p, scale, inv, dh, e):
    """Ws = W[perm] * scale -> (dW, dg_content [K, H])."""
    K = dWs.shape[0]
    dW = (dWs * scale[:, :, None]).index_select(1, inv)
    dscale = (dWs * W_p).sum(-1).view(K, -1, 2 * e + dh)
    return dW, dscale[:, :, dh:e].sum(-1)


def _fold_bwd(dA, dc, Ws, ln_w, ln_b):
    """A = Ws diag(w), c = Ws b -> (dWs, dw, db). dA [K, R, d], dc [K, R]."""
    dWs = torch.addcmul(dA * ln_w[:, None, :], dc[:, :, None], ln_b[:, None, :])
    return dWs, (dA * Ws).sum(1), torch.bmm(dc[:, None, :], Ws).squeeze(1)


def _bias_bwd(dbias, tb, gp, off, n_ctx):
    """bias = gp * tb + mask, tb = table[:, :, off] -> (dtable [K, H, n_ctx], dgp [K, H])."""
    K, H = dbias.shape[:2]
    dgp = (dbias * tb).sum((-1, -2))
    dt = dbias.new_zeros(K, H, n_ctx).index_add_(2, off.reshape(-1), (dbias * gp[:, :, None, None]).reshape(K, H, -1))
    return dt, dgp




def _hand_forward(params, cfg, inputs, g_pos, g_content, pos):
    """``fast_forward``'s computation without autograd; returns (logits [K, B, P, out], saved state)."""
    L, H, d, dh, r = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    e = dh + r
    w = 2 * e + dh
    K = g_pos.shape[0]
    tokens = cfg.d_in is None
    if inputs.dim() == (2 if tokens else 3):
        inputs = inputs.expand(K, *inputs.shape)
    B, T = inputs.shape[1], inputs.shape[2]
    P = len(pos)
    dev = inputs.device
    off_all, mask_all = _geometry(T, cfg.n_ctx, None, dev)
    off_q, mask_q = _geometry(T, cfg.n_ctx, pos, dev)
    pos_t = torch.tensor(pos, device=dev)
    absolute = _ABS in params
    rot = _rope_tables(cfg, T, params["blocks.0.attn.in_proj.weight"].dtype, dev)
    S = dict(K=K, B=B, T=T, P=P, tokens=tokens, pos_t=pos_t, off_all=off_all, off_q=off_q, layers=[],
             absolute=absolute, rot=rot)
    if tokens:
        E = params["embed.weight"]  # [K, V, d]
        V = E.shape[1]
        idx = (inputs + (torch.arange(K, device=dev) * V).view(K, 1, 1)).reshape(-1)
        x = E.reshape(K * V, d).index_select(0, idx).view(K, B * T, d)
        S.update(E=E, V=V, idx=idx)
    else:
        xin = inputs.reshape(K, B * T, -1)
        x = torch.baddbmm(params["read_in.bias"].unsqueeze(1), xin, params["read_in.weight"].transpose(1, 2))
        S["xin"] = xin
    if absolute:
        x = (x.view(K, B, T, d) + params[_ABS][:, None]).view(K, B * T, d)
    few = _few(cfg, P, T)
    S["few"] = few
    for l in range(L):
        pre = f"blocks.{l}."
        W = params[pre + "attn.in_proj.weight"]
        ln_w, ln_b = params[pre + "ln.weight"], params[pre + "ln.bias"]
        W_out = params[pre + "attn.out_proj.weight"]
        table = params[pre + "attn.pos_bias"]
        gp, gc = g_pos[:, l], g_content[:, l]
        W_p, scale = _per_head_rows(W, gc, d, H, dh, r)
        Ws = W_p * scale[:, :, None]  # [K, H*w, d]
        st = dict(W_p=W_p, scale=scale, Ws=Ws, ln_w=ln_w, ln_b=ln_b, W_out=W_out, gp=gp)
        S["layers"].append(st)
        if l < L - 1 or not few:
            tb = table[:, :, off_all]  # [K, H, T, T]
            if l == 0 and tokens and not absolute:
                nE, mE, rE = _ln_fwd(E)
                rows = torch.addcmul(ln_b[:, None, :], nE, ln_w[:, None, :])  # [K, V, d]
                tab = torch.bmm(rows, Ws.transpose(1, 2))  # [K, V, H*w]
                tab = tab.view(K, V, H, w).transpose(1, 2)  # [K, H, V, w]
                hidx = (inputs.unsqueeze(1) + (torch.arange(K * H, device=dev) * V).view(K, H, 1, 1)).reshape(-1)
                # q, k, v gathered each from its own (small, contiguous) table: the attention matmuls
                # then read contiguous operands (bmm on strided slices of one [.., w] tensor measured 2x slower)
                g = tuple(tab[..., a:b].reshape(K * H * V, b - a).index_select(0, hidx).view(K * H * B, T, b - a)
                          for a, b in ((0, e), (e, 2 * e), (2 * e, w)))
                st.update(kind="vocab", nE=nE, mE=mE, rE=rE, rows=rows, hidx=hidx)
            else:
                n, mean, rstd = _ln_fwd(x)
                A = Ws * ln_w[:, None, :]
                y = torch.baddbmm(torch.bmm(Ws, ln_b[:, :, None]).transpose(1, 2), n, A.transpose(1, 2))  # [K, BT, H*w]
                y = y.view(K, B, T, H, w)
                g = tuple(y[..., a:b].permute(0, 3, 1, 2, 4).reshape(K * H * B, T, b - a)  # contiguous, per head
                          for a, b in ((0, e), (e, 2 * e), (2 * e, w)))
                del y
                st.update(kind="plain", x=x, n=n, mean=mean, rstd=rstd, A=A)
            if rot is not None:  # RoPE: q and k rotated by position (the backward reads the rotated ones)
                g = (rotate_pairs(g[0], *rot, dh), rotate_pairs(g[1], *rot, dh), g[2])
            qe, ke, v = g
            s = torch.bmm(qe, ke.transpose(1, 2)).view(K, H, B, T, T)
            bias = _with_static(torch.addcmul(mask_all, gp[:, :, None, None], tb), params.get(f"{_STATIC}{l}"))
            s.add_(bias.unsqueeze(2))
            p = torch.softmax(s, -1).view(K * H * B, T, T)
            z = torch.bmm(p, v)
            zc = z.view(K, H, B, T, dh).permute(0, 2, 3, 1, 4).reshape(K, B * T, d)
            x = torch.baddbmm(x, zc, W_out.transpose(1, 2))
            st.update(g=g, p=p, zc=zc, tb=tb)
        else:
            tb = table[:, :, off_q]  # [K, H, P, T]
            x_in = x
            n, mean, rstd = _ln_fwd(x)
            Wn = (Ws * ln_w[:, None, :]).view(K, H, w, d)
            bn = torch.bmm(Ws, ln_b[:, :, None]).view(K, H, w)
            n4 = n.view(K, B, T, d)
            nq = _take(n4, pos).reshape(K, B * P, d)
            qa = torch.baddbmm(bn.view(K, 1, H * w), nq, Wn.view(K, H * w, d).transpose(1, 2))
            q = qa.view(K, B * P, H, w)[..., :e].transpose(1, 2).reshape(K * H, B * P, e)
            WnK = Wn[:, :, e:2 * e].reshape(K * H, e, d)
            qt = torch.bmm(q, WnK).view(K, H, B, P, d).permute(0, 2, 1, 3, 4).reshape(K * B, H * P, d)
            nf = n.view(K * B, T, d)
            s = torch.bmm(qt, nf.transpose(1, 2)).view(K, B, H, P, T)
            bias = _with_static(torch.addcmul(mask_q, gp[:, :, None, None], tb), params.get(f"{_STATIC}{l}"))
            s.add_(bias.unsqueeze(1))
            pm = torch.softmax(s, -1).view(K * B, H * P, T)
            nbar = torch.bmm(pm, nf).view(K, B, H, P, d).permute(0, 1, 3, 2, 4).reshape(K, B * P, H * d)
            W_o = W_out.view(K, d, H, dh).permute(0, 2, 1, 3)  # [K, H, d, dh]
            WnV = Wn[:, :, 2 * e:]  # [K, H, dh, d]
            Mc = torch.matmul(W_o, WnV).permute(0, 1, 3, 2).reshape(K, H * d, d)
            bnV = bn[:, :, 2 * e:].reshape(K, d)
            c = torch.bmm(W_out, bnV[:, :, None])
            xq = _take(x.view(K, B, T, d), pos).reshape(K, B * P, d)
            x = torch.baddbmm(xq + c.transpose(1, 2), nbar, Mc)
            st.update(kind="few", x=x_in, n=n, mean=mean, rstd=rstd, Wn=Wn, nq=nq, q=q, WnK=WnK, qt=qt, nf=nf,
                      pm=pm, nbar=nbar, W_o=W_o, WnV=WnV, Mc=Mc, bnV=bnV, tb=tb)
    if not few:
        x = _take(x.view(K, B, T, d), pos).reshape(K, B * P, d)
    nF, mF, rF = _ln_fwd(x)
    wf, bf = params["ln_final.weight"], params["ln_final.bias"]
    h = torch.addcmul(bf[:, None, :], nF, wf[:, None, :])
    if tokens:
        out = torch.bmm(h, E.transpose(1, 2))
    else:
        out = torch.baddbmm(params["read_out.bias"][:, None, :], h, params["read_out.weight"].transpose(1, 2))
    S.update(xF=x, nF=nF, mF=mF, rF=rF, wf=wf, h=h)
    if not tokens:
        S["Wro"] = params["read_out.weight"]
    return out.view(K, B, P, -1), S


def _hand_backward(S, cfg, dout):
    """Gradients of every parameter the fast forward reads, and of g_pos, g_content ([K, L, H]),
    from dlogits ``dout`` ([K, B, P, out]) and the state ``_hand_forward`` saved."""
    L, H, d, dh, r = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.content_rank
    e = dh + r
    w = 2 * e + dh
    K, B, T, P, tokens, few = S["K"], S["B"], S["T"], S["P"], S["tokens"], S["few"]
    inv = _inverse_perm((d, H, dh, r), dout.device)
    pos_t = S["pos_t"]
    grads = {}
    dout = dout.reshape(K, B * P, -1)
    h = S["h"]
    # logits = h E^T (tied) or h R^T + c; h = n * wf + bf; n = LN(xF)
    if tokens:
        E = S["E"]
        dh_ = torch.bmm(dout, E)
        dE = torch.bmm(dout.transpose(1, 2), h)  # [K, V, d]
    else:
        dh_ = torch.bmm(dout, S["Wro"])
        grads["read_out.weight"] = torch.bmm(dout.transpose(1, 2), h)
        grads["read_out.bias"] = dout.sum(1)
    grads["ln_final.weight"] = (dh_ * S["nF"]).sum(1)
    grads["ln_final.bias"] = dh_.sum(1)
    dx = _ln_bwd(dh_ * S["wf"][:, None, :], S["xF"], S["mF"], S["rF"])  # [K, B*P, d]
    if not few:  # back to all positions
        dx = dx.new_zeros(K, B, T, d).index_add_(2, pos_t, dx.view(K, B, P, d)).view(K, B * T, d)
    dgp = dout.new_zeros(K, L, H)
    dgc = dout.new_zeros(K, L, H)
    for l in reversed(range(L)):
        pre = f"blocks.{l}."
        st = S["layers"][l]
        Ws, ln_w, ln_b, W_out = st["Ws"], st["ln_w"], st["ln_b"], st["W_out"]
        if st["kind"] == "few":
            # x_out = x[pos] + c^T + nbar Mc, Mc = (W_O,h WnV_h)^T stacked, c = W_out bnV
            dxo = dx  # [K, B*P, d]
            dc = dxo.sum(1)  # [K, d]
            dnbar = torch.bmm(dxo, st["Mc"].transpose(1, 2))  # [K, B*P, H*d]
            dM = torch.bmm(st["nbar"].transpose(1, 2), dxo).view(K, H, d, d).transpose(-1, -2)  # d(W_O,h WnV_h)
            dW_o = torch.matmul(dM, st["WnV"].transpose(-1, -2))  # [K, H, d, dh]
            dWnV = torch.matmul(st["W_o"].transpose(-1, -2), dM)  # [K, H, dh, d]
            dW_out = torch.addcmul(dW_o.permute(0, 2, 1, 3).reshape(K, d, d), dc[:, :, None], st["bnV"][:, None, :])
            dbnV = torch.bmm(dc[:, None, :], W_out).view(K, H, dh)
            # nbar = pm nf; s = qt nf^T + bias; pm = softmax(s)
            dnbar = dnbar.view(K, B, P, H, d).permute(0, 1, 3, 2, 4).reshape(K * B, H * P, d)
            pm, nf, qt = st["pm"], st["nf"], st["qt"]
            dpm = torch.bmm(dnbar, nf.transpose(1, 2))
            ds = torch.ops.aten._softmax_backward_data(dpm, pm, -1, pm.dtype)  # [K*B, H*P, T]
            dnf = torch.bmm(pm.transpose(1, 2), dnbar)
            dnf = torch.baddbmm(dnf, ds.transpose(1, 2), qt)  # [K*B, T, d]
            dqt = torch.bmm(ds, nf).view(K, B, H, P, d).permute(0, 2, 1, 3, 4).reshape(K * H, B * P, d)
            dbias = ds.view(K, B, H, P, T).sum(1)
            # qt = q WnK; q = nq WnQ^T + bnQ
            q = st["q"]
            dq = torch.bmm(dqt, st["WnK"].transpose(1, 2)).view(K, H, B * P, e)
            dWnK = torch.bmm(q.transpose(1, 2), dqt).view(K, H, e, d)
            dWnQ = torch.matmul(dq.transpose(-1, -2), st["nq"].unsqueeze(1))  # [K, H, e, d]
            dbnQ = dq.sum(2)
            dnq = torch.bmm(dq.transpose(1, 2).reshape(K, B * P, H * e), st["Wn"][:, :, :e].reshape(K, H * e, d))
            dn = dnf.view(K, B, T, d).index_add_(2, pos_t, dnq.view(K, B, P, d)).view(K, B * T, d)
            dA = torch.cat([dWnQ, dWnK, dWnV], 2).view(K, H * w, d)
            dcb = torch.cat([dbnQ, dbnQ.new_zeros(K, H, e), dbnV], 2).view(K, H * w)
            dWs, dlw, dlb = _fold_bwd(dA, dcb, Ws, ln_w, ln_b)
            dx_new = _ln_bwd(dn, st["x"], st["mean"], st["rstd"])
            dx_new.view(K, B, T, d).index_add_(2, pos_t, dxo.view(K, B, P, d))  # the residual
            dtab, dgp[:, l] = _bias_bwd(dbias, st["tb"], st["gp"], S["off_q"], cfg.n_ctx)
            grads[f"{_STATIC}{l}"] = dbias
        else:
            # x_out = x + zc W_out^T
            # (saved tensors are popped as they are used: the step's peak memory, and with it the
            # allocator's page faults, stays at the autograd path's level)
            zc, p, g = st.pop("zc"), st.pop("p"), st.pop("g")
            dW_out = torch.bmm(dx.transpose(1, 2), zc)
            del zc
            dz = torch.bmm(dx, W_out).view(K, B, T, H, dh).permute(0, 3, 1, 2, 4).reshape(K * H * B, T, dh)
            qe, ke, v = g
            ds = torch.ops.aten._softmax_backward_data(torch.bmm(dz, v.transpose(1, 2)), p, -1, p.dtype)
            dbias = ds.view(K, H, B, T, T).sum(2)
            dtab, dgp[:, l] = _bias_bwd(dbias, st["tb"], st["gp"], S["off_all"], cfg.n_ctx)
            grads[f"{_STATIC}{l}"] = dbias
            # dq, dk, dv, each written straight to its place (no concatenation of activation gradients)
            rot = S["rot"]
            unrot = (lambda t: t) if rot is None else (lambda t: rotate_pairs(t, rot[0], -rot[1], dh))  # R^T
            pieces = ((0, e, lambda: unrot(torch.bmm(ds, ke))),
                      (e, 2 * e, lambda: unrot(torch.bmm(ds.transpose(1, 2), qe))),
                      (2 * e, w, lambda: torch.bmm(p.transpose(1, 2), dz)))
            if st["kind"] == "vocab":
                V = S["V"]
                # g = tab[hidx]; tab = rows Ws^T (head-major); rows = LN(E) * ln_w + ln_b
                dt = ds.new_zeros(K * H * V, w)
                for a, b, f in pieces:
                    dt[:, a:b].index_add_(0, st["hidx"], f().view(-1, b - a))
                del ds, p, g, dz
                dt = dt.view(K, H, V, w).transpose(1, 2).reshape(K, V, H * w)
                dWs = torch.bmm(dt.transpose(1, 2), st["rows"])
                drows = torch.bmm(dt, Ws)  # [K, V, d]
                dlw = (drows * st["nE"]).sum(1)
                dlb = drows.sum(1)
                dE += _ln_bwd(drows * ln_w[:, None, :], E, st["mE"], st["rE"])
                dx_new = dx
            else:
                # y = n A^T + c (A = Ws diag(ln_w), c = Ws ln_b), g = y per head; n = LN(x)
                dy = ds.new_empty(K, B, T, H, w)
                dyh = dy.permute(0, 3, 1, 2, 4)  # [K, H, B, T, w]
                for a, b, f in pieces:
                    dyh[..., a:b].copy_(f().view(K, H, B, T, b - a))
                del ds, p, g, dz
                dy = dy.view(K, B * T, H * w)
                dA = torch.bmm(dy.transpose(1, 2), st["n"])
                dn = torch.bmm(dy, st["A"])
                dWs, dlw, dlb = _fold_bwd(dA, dy.sum(1), Ws, ln_w, ln_b)
                dx_new = dx + _ln_bwd(dn, st["x"], st["mean"], st["rstd"])
        dW, dgc[:, l] = _unscale(dWs, st["W_p"], st["scale"], inv, dh, e)
        grads[pre + "attn.in_proj.weight"] = dW
        grads[pre + "ln.weight"], grads[pre + "ln.bias"] = dlw, dlb
        grads[pre + "attn.out_proj.weight"] = dW_out
        grads[pre + "attn.pos_bias"] = dtab
        dx = dx_new
    if S["absolute"]:
        grads[_ABS] = dx.view(K, B, T, d).sum(1)
    if tokens:
        V = S["V"]
        dE += dx.new_zeros(K * V, d).index_add_(0, S["idx"], dx.reshape(-1, d)).view(K, V, d)
        grads["embed.weight"] = dE
    else:
        grads["read_in.weight"] = torch.bmm(dx.transpose(1, 2), S["xin"])
        grads["read_in.bias"] = dx.sum(1)
    return grads, dgp, dgc


class _Whole(torch.autograd.Function):
    """The whole fast forward as one node: forward ``_hand_forward``, backward ``_hand_backward``.
    Inputs after the fixed ones are the stacked parameter tensors in the order of ``names``."""

    @staticmethod
    def forward(ctx, cfg, inputs, pos, names, g_pos, g_content, *tensors):
        out, S = _hand_forward(dict(zip(names, tensors)), cfg, inputs, g_pos, g_content, pos)
        ctx.S, ctx.cfg, ctx.names = S, cfg, names
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        grads, dgp, dgc = _hand_backward(ctx.S, ctx.cfg, dout.contiguous())
        del ctx.S
        return (None, None, None, None, dgp, dgc, *(grads.get(n) for n in ctx.names))


def hand_forward(params: dict[str, torch.Tensor], cfg: ModelConfig, inputs: torch.Tensor,
                 g_pos: torch.Tensor, g_content: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``fast_forward`` with the hand-written backward (one autograd node for the whole model)."""
    if _scheme_kind(cfg.positional) in _CONTEXTUAL:
        raise ValueError(f"the hand-written backward does not compute the contextual scheme {cfg.positional!r} "
                         "(fast_forward takes the autograd backward for it)")
    pos = tuple(int(p) for p in positions.tolist())
    K, T = g_pos.shape[0], inputs.shape[-1 if cfg.d_in is None else -2]
    dtype = params["blocks.0.attn.in_proj.weight"].dtype
    static = _biases(params, cfg, K, T, pos, dtype, inputs.device)
    # a static scheme's bias enters as one more input (computed here, in autograd, from the scheme's
    # parameters); the hand backward returns its gradient, dbias
    params = {**params, **{f"{_STATIC}{l}": b for l, b in enumerate(static) if b is not None}}
    pe = _absolute(params, cfg, K, T, dtype)
    if pe is not None:  # vanilla's position embedding: one more input, its gradient dx summed over the batch
        params[_ABS] = pe
    names = tuple(params)
    return _Whole.apply(cfg, inputs, pos, names, g_pos, g_content, *(params[n] for n in names))
