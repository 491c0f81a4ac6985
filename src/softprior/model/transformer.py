"""The annealable soft-prior Transformer (arXiv 2609.10287; docs/DESIGN.md, "Model").

A causal, attention-only Transformer: token embedding, L blocks of pre-LayerNorm multi-head
self-attention with residual connections, a final LayerNorm, and an unembedding tied to the token
embedding. The paper does not say where its LayerNorms sit: ``norm="post"`` normalises after each
residual add instead (the original Transformer's placement; no final LayerNorm), ``norm="none"`` has
none (docs/CALIBRATION.md, "Identification": both are axes of the identification search). There is no positional encoding other than the priors, so at zero gate this is a plain
causal NoPE attention-only Transformer. Attention logits of head h (the paper's equation):

    S_ij = Q_i K_j^T / sqrt(d_head) + g_pos * B^pos_h[i - j] + g_content * B^content_h(x_i, x_j)

then the causal mask, then softmax. ``attn_scale`` may replace the paper's 1/sqrt(d_head) by 1/d_head
(muP's) or 1, an axis of the identification search.

- B^pos is a learned table over relative offsets 0..n_ctx-1 per head and layer. Offsets at or beyond
  n_ctx (only at evaluation lengths > n_ctx) are clipped to the last learned offset, or carry no bias
  (``pos_beyond="zero"``): the paper does not say (its soft_bias at T = 120, Sec. 4, is evidence).
- B^content is a learned rank-r bilinear form of the two tokens' LayerNorm-ed residual vectors:
  B^content_h(x_i, x_j) = (x_i U_h) . (x_j V_h), U_h, V_h in R^{d x r}.
- Gates g_pos, g_content are separate; each is either learned (sigmoid of a logit) or forced to a
  value (a float or tensor passed to ``forward``: fixed, scheduled, or an evaluation override).
  Gate granularity: one logit per kind shared by all layers ("shared"), per layer, or per head.

Intermediates are exposed TransformerLens-style under stable hook names (see ``hook_names``):
``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_q|hook_k|hook_v`` [B, T, H, d_head],
``blocks.{l}.attn.hook_pos_bias`` [H, Tq, T] (ungated), ``blocks.{l}.attn.hook_content_bias``
[B, H, Tq, T] (ungated), ``blocks.{l}.attn.hook_attn_scores`` [B, H, Tq, T] (priors added, masked),
``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.attn.hook_z`` [B, Tq, H, d_head],
``blocks.{l}.attn.hook_result`` [B, Tq, H, d_model] (each head's output; only computed when asked
for), ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized``.
``run_with_cache`` returns them by name; ``hooks(...)`` installs functions that may replace them.
A replacement takes effect everywhere except at the observe-only point ``hook_result`` (the forward
applies the output projection to ``hook_z``, not to the per-head results), where returning a tensor
raises ``HookError`` instead of being ignored. B^content is normally folded into the QK matmul (see
``Attention.forward``); when a hook replaces it, the layer adds ``g_content * replacement`` to the
logits instead, so the replacement enters the equation exactly where B^content does.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig

__all__ = ["SoftPriorTransformer", "build_model", "HookError", "OBSERVE_ONLY_HOOKS", "shape_gate"]


class HookError(ValueError):
    """A hook function returned a replacement at a hook point whose value the forward does not use."""


# hook points whose value the forward computes for inspection only (a replacement raises HookError)
OBSERVE_ONLY_HOOKS = ("hook_result",)

def initial_pos_bias(cfg: ModelConfig) -> torch.Tensor:
    """The B^pos table [H, n_ctx] a prior layer starts from (docs/DESIGN.md, "What the first prototype showed"):
    - "locality": B[h, r] = -scale (r - h)^2, head h centred on offset h (the prototype's prior);
    - "bounded": the same, clipped at -prior_cap, so far offsets keep a usable softmax gradient
      (an unbounded quadratic on every layer reaches -450 and layer 1 cannot learn: the prototype);
    - "alibi": B[h, r] = -scale m_h r with ALiBi's geometric slopes m_h = 2^(-8 (h+1) / H)
      (Press et al. 2022, section 3);
    - "zero": all zeros."""
    H = cfg.n_heads
    r = torch.arange(cfg.n_ctx, dtype=torch.float32)
    h = torch.arange(H, dtype=torch.float32)[:, None]
    if cfg.prior_init == "zero":
        return torch.zeros(H, cfg.n_ctx)
    if cfg.prior_init == "alibi":
        return -cfg.prior_scale * 2.0 ** (-8.0 * (h + 1) / H) * r
    quad = -cfg.prior_scale * (r - h) ** 2
    return quad if cfg.prior_init == "locality" else quad.clamp(min=-cfg.prior_cap)


def shape_gate(g: torch.Tensor, L: int, H: int, kind: str = "gate") -> torch.Tensor:
    """A forced gate value as [L, H]: a number or one-element tensor -> every head of every layer;
    [L] or [L, 1] -> per layer; [1, H] -> per head, the same in every layer; [L, H] as is. A 1-D
    tensor is per layer even when L = H (broadcasting it would silently make it per head)."""
    shape = tuple(g.shape)
    if g.numel() == 1 and g.dim() <= 2:
        return g.reshape(1, 1).expand(L, H)
    if shape == (L,):
        return g[:, None].expand(L, H)
    if g.dim() == 2 and shape[0] in (1, L) and shape[1] in (1, H):
        return g.expand(L, H)
    raise ValueError(f"{kind} gate tensor of shape {list(shape)} does not fit a model with L={L} layers and "
                     f"H={H} heads; use a number, [L] or [L, 1] (per layer), [1, H] (per head) or [L, H]")


# ------------------------------------------------------------------------------------------ hooks
class HookState:
    """Shared by every module of one model. Inactive (the default) it costs one attribute check."""

    def __init__(self):
        self.fns: dict[str, list[Callable]] = {}
        self.cache: dict[str, torch.Tensor] | None = None
        self.cache_filter: Callable[[str], bool] | None = None
        self.active = False

    def wants(self, name: str) -> bool:
        return self.active and (name in self.fns or (self.cache is not None and self.cache_filter(name)))

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Pass ``t`` through the hook functions on ``name`` (each may return a replacement) and
        into the cache. At an ``OBSERVE_ONLY_HOOKS`` point the result is discarded, so a replacement
        raises ``HookError``."""
        if not self.active:
            return t
        for fn in self.fns.get(name, ()):
            out = fn(t, name)
            if out is not None:
                if name.rsplit(".", 1)[-1] in OBSERVE_ONLY_HOOKS:
                    raise HookError(f"hook {getattr(fn, '__name__', fn)!r} on {name!r} returned a replacement, but "
                                    f"{name.rsplit('.', 1)[-1]} is observe-only (the forward does not use it); "
                                    f"return None there, or change {name.rsplit('.', 1)[0]}.hook_z instead")
                t = out
        if self.cache is not None and self.cache_filter(name):
            self.cache[name] = t.detach()
        return t


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookState):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self._hooks = [hooks]  # a list, so nn.Module does not register it as state
        d, H, r = cfg.d_model, cfg.n_heads, cfg.content_rank
        # fused projection: Q, K, V (d each) and the content-bias factors U, V (H*r each)
        self.in_proj = nn.Linear(d, 3 * d + 2 * H * r, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(H, cfg.n_ctx))  # B^pos[h, offset]
        self.scheme = None  # a static positional scheme (baselines), see softprior.positional
        if cfg.positional != "none":
            from ..positional import make_scheme
            self.scheme = make_scheme(cfg.positional, n_heads=H, d_head=cfg.d_head, d_model=d, n_ctx=cfg.n_ctx,
                                      layer=layer, n_layers=cfg.n_layers)
        with torch.no_grad():
            self.in_proj.weight[3 * d:].normal_(0.0, cfg.content_init_std)
            if cfg.prior_init != "zero" and layer in cfg.prior_layers:
                self.pos_bias.copy_(initial_pos_bias(cfg))
        self.prior_module = None  # a registered prior family's B^pos (softprior.model.priors); None: the table above
        if cfg.prior_family != "soft":
            from .priors import build_prior
            self.prior_module = build_prior(cfg, layer)

    def forward(self, x: torch.Tensor, g_pos: torch.Tensor, g_content: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, d] (already LayerNorm-ed). g_*: [H]. positions: query positions to compute
        (None = all). Returns [B, Tq, d]."""
        hk, cfg = self._hooks[0], self.cfg
        B, T, d = x.shape
        H, dh, r = cfg.n_heads, cfg.d_head, cfg.content_rank
        pre = f"blocks.{self.layer}.attn."
        # one linear per slice of the fused weight: the backward then sums small weight-slice
        # gradients instead of concatenating the large activation gradients of a split
        W = self.in_proj.weight
        sq, sk, sv, su, sw = (slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d),
                              slice(3 * d, 3 * d + H * r), slice(3 * d + H * r, 3 * d + 2 * H * r))
        dev = x.device
        qpos = torch.arange(T, device=dev) if positions is None else positions.to(dev)
        xq = x if positions is None else x[:, qpos]  # the last layer: queries only where loss is read
        q, u = F.linear(xq, W[sq]), F.linear(xq, W[su])
        k, v, w = F.linear(x, W[sk]), F.linear(x, W[sv]), F.linear(x, W[sw])
        Tq = q.shape[1]
        q = hk(pre + "hook_q", q.view(B, Tq, H, dh)).transpose(1, 2)  # (B, H, Tq, dh)
        k = hk(pre + "hook_k", k.view(B, T, H, dh)).transpose(1, 2)  # (B, H, T, dh)
        v = hk(pre + "hook_v", v.view(B, T, H, dh)).transpose(1, 2)  # (B, H, T, dh)
        kpos = torch.arange(T, device=dev)
        if self.scheme is not None:
            q, k = self.scheme.rotate(q, k, qpos, kpos)

        rel = qpos[:, None] - kpos[None, :]
        offsets = rel.clamp(0, cfg.n_ctx - 1)  # (Tq, T)
        if self.prior_module is None:
            b_pos = self.pos_bias[:, offsets]
            if cfg.pos_beyond == "zero" and T > cfg.n_ctx:  # offsets the table never learned carry no bias
                b_pos = b_pos.masked_fill(rel >= cfg.n_ctx, 0.0)
        else:  # a registered family's B^pos_h(i, j) (softprior.model.priors)
            b_pos = self.prior_module.bias(qpos, kpos).to(x.dtype)
            if cfg.prior_gain != 1.0:  # the family's strength (ModelConfig.prior_gain)
                b_pos = b_pos * cfg.prior_gain
        b_pos = hk(pre + "hook_pos_bias", b_pos)  # (H, Tq, T)
        u = u.view(B, Tq, H, r).transpose(1, 2)  # (B, H, Tq, r)
        w = w.view(B, T, H, r).transpose(1, 2)  # (B, H, T, r)
        b_content = None  # None: B^content folded into the QK matmul below
        if hk.wants(pre + "hook_content_bias"):
            b_c = u @ w.transpose(-1, -2)  # (B, H, Tq, T)
            b_hooked = hk(pre + "hook_content_bias", b_c)
            if b_hooked is not b_c:  # replaced by a hook: add g_content * replacement instead of folding
                b_content = b_hooked
        family_content = getattr(self.prior_module, "content_bias", None)
        if b_content is None and family_content is not None:  # a family that replaces B^content
            b_fam = family_content(xq, x)
            if b_fam is not None:
                b_content = hk(pre + "hook_content_bias", b_fam)
        causal = torch.zeros(Tq, T, device=dev).masked_fill_(qpos[:, None] < kpos[None, :], float("-inf"))

        # The paper's equation  S = Q K^T / sqrt(d_head) + g_pos B^pos + g_content B^content,  with
        # B^content = (x U)(x V)^T folded into the same matmul:  [Q/sqrt(d_head), g_content xU] . [K, xV]^T.
        # The causal mask (0 / -inf) rides along with the (batch-independent) position bias.
        if b_content is None:
            q_ext = torch.cat([q * cfg.qk_scale, g_content.view(H, 1, 1) * u], dim=-1)  # (B, H, Tq, dh+r)
            k_ext = torch.cat([k, w], dim=-1)  # (B, H, T, dh+r)
            scores = q_ext @ k_ext.transpose(-1, -2)
        else:  # the same equation, unfused, with the hook's B^content
            scores = (q * cfg.qk_scale) @ k.transpose(-1, -2) + g_content.view(H, 1, 1) * b_content
        if self.scheme is not None:  # static baselines (whose soft prior is off) adjust the content logits
            scores = self.scheme.adjust_logits(scores, q, k, qpos, kpos)
        scores = hk(pre + "hook_attn_scores", scores + (g_pos.view(H, 1, 1) * b_pos + causal))
        pattern = scores.softmax(-1)
        if self.scheme is not None:
            pattern = self.scheme.mix_pattern(pattern, qpos, kpos)
        pattern = hk(pre + "hook_pattern", pattern)
        z = hk(pre + "hook_z", (pattern @ v).transpose(1, 2))  # (B, Tq, H, dh)
        if hk.wants(pre + "hook_result"):  # each head's contribution to the residual stream
            W_O = self.out_proj.weight.T.view(H, dh, d)
            hk(pre + "hook_result", torch.einsum("bqhe,hed->bqhd", z, W_O))  # observe-only
        return self.out_proj(z.reshape(B, Tq, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookState):
        super().__init__()
        self.layer = layer
        self._hooks = [hooks]
        self.norm = cfg.norm
        if cfg.norm != "none":
            self.ln = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, layer, hooks)

    def forward(self, x, g_pos, g_content, positions=None):
        hk, pre = self._hooks[0], f"blocks.{self.layer}."
        x = hk(pre + "hook_resid_pre", x)
        a = hk(pre + "hook_attn_out", self.attn(self.ln(x) if self.norm == "pre" else x, g_pos, g_content, positions))
        if positions is not None:
            x = x[:, positions]
        x = x + a
        return hk(pre + "hook_resid_post", self.ln(x) if self.norm == "post" else x)


class SoftPriorTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hook_state = HookState()
        d = cfg.d_model
        if cfg.d_in is None:
            self.embed = nn.Embedding(cfg.vocab, d)
            nn.init.normal_(self.embed.weight, 0.0, cfg.embed_init_std)
        else:
            self.read_in = nn.Linear(cfg.d_in, d)
        self.blocks = nn.ModuleList(Block(cfg, l, self.hook_state) for l in range(cfg.n_layers))
        # post: the last block's LayerNorm already normalised the stream; none: no LayerNorm
        self.ln_final = nn.LayerNorm(d) if cfg.norm == "pre" else nn.Identity()
        if cfg.d_out is not None:
            self.read_out = nn.Linear(d, cfg.d_out)
        shape = {"shared": (1, 1), "layer": (cfg.n_layers, 1), "head": (cfg.n_layers, cfg.n_heads)}
        # gate_logits[0] -> position gate, [1] -> content gate
        self.gate_logits = nn.Parameter(torch.full((2, *shape[cfg.gate_granularity]), cfg.gate_logit_init))

    # ---------------------------------------------------------------- gates
    def gates(self, pos=None, content=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate values [L, H] for (position, content). None = learned (sigmoid of the logit);
        a float or tensor forces the gate (fixed/scheduled modes and evaluation overrides).

        A forced tensor is read by shape (``shape_gate``): a number (or one element) for every head of
        every layer, ``[L]`` or ``[L, 1]`` per layer, ``[1, H]`` per head (the same in every layer),
        ``[L, H]`` per layer and head. A 1-D tensor is always per layer, also when L = H (as in the
        large preset); any other shape raises ``ValueError``."""
        L, H = self.cfg.n_layers, self.cfg.n_heads
        if not self.cfg.prior:
            z = torch.zeros(L, H, device=self.gate_logits.device, dtype=self.gate_logits.dtype)
            return z, z
        out = []
        for i, forced in enumerate((pos, content)):
            if forced is None:
                g = torch.sigmoid(self.gate_logits[i])  # [1, 1], [L, 1] or [L, H]: broadcasts as is
                out.append(g.expand(L, H))
            else:
                g = torch.as_tensor(forced, dtype=self.gate_logits.dtype, device=self.gate_logits.device)
                out.append(shape_gate(g, L, H, ("position", "content")[i]))
        return out[0], out[1]

    # ---------------------------------------------------------------- forward
    def forward(self, inputs: torch.Tensor, gate_pos=None, gate_content=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """inputs: [B, T] tokens or [B, T, d_in] vectors. Returns logits [B, T, vocab] (or
        [B, T, d_out]); with ``positions`` only those positions, and the last layer computes queries
        only there."""
        hk = self.hook_state
        gp, gc = self.gates(gate_pos, gate_content)
        x = self.embed(inputs) if self.cfg.d_in is None else self.read_in(inputs)
        scheme = self.blocks[0].attn.scheme
        if scheme is not None:
            p = scheme.embed_positions(x.shape[1])  # only 'vanilla' adds absolute positions
            if p is not None:
                x = x + p
        x = hk("hook_embed", x)
        last = len(self.blocks) - 1
        for l, block in enumerate(self.blocks):
            x = block(x, gp[l], gc[l], positions if l == last else None)
        x = hk("ln_final.hook_normalized", self.ln_final(x))
        if self.cfg.d_out is None:
            return x @ self.embed.weight.T  # tied unembedding
        return self.read_out(x)

    # ---------------------------------------------------------------- hooks / cache
    def hook_names(self) -> list[str]:
        names = ["hook_embed"]
        for l in range(self.cfg.n_layers):
            names += [f"blocks.{l}.hook_resid_pre"]
            names += [f"blocks.{l}.attn.{n}" for n in ("hook_q", "hook_k", "hook_v", "hook_pos_bias",
                      "hook_content_bias", "hook_attn_scores", "hook_pattern", "hook_z", "hook_result")]
            names += [f"blocks.{l}.hook_attn_out", f"blocks.{l}.hook_resid_post"]
        return names + ["ln_final.hook_normalized"]

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[str, Callable]] = (), cache: dict | None = None,
              names_filter: Callable[[str], bool] | None = None):
        """Install forward hooks ``fn(tensor, name) -> tensor | None`` and/or a cache for the duration."""
        hs = self.hook_state
        known = set(self.hook_names())
        for name, _ in fwd_hooks:
            if name not in known:
                raise KeyError(f"unknown hook {name!r}; see model.hook_names()")
        old = (hs.fns, hs.cache, hs.cache_filter, hs.active)
        hs.fns = {k: list(v) for k, v in old[0].items()}  # nested contexts add to the outer hooks
        for name, fn in fwd_hooks:
            hs.fns.setdefault(name, []).append(fn)
        if cache is not None or old[1] is None:
            hs.cache, hs.cache_filter = cache, (names_filter or (lambda n: True))
        hs.active = True
        try:
            yield self
        finally:
            hs.fns, hs.cache, hs.cache_filter, hs.active = old

    def run_with_cache(self, inputs, *args, names_filter=None, **kwargs):
        """Run forward and return (output, {hook name: tensor})."""
        if isinstance(names_filter, str):
            wanted = names_filter
            names_filter = lambda n: n == wanted  # noqa: E731
        elif isinstance(names_filter, (list, tuple, set)):
            wanted_set = set(names_filter)
            names_filter = lambda n: n in wanted_set  # noqa: E731
        cache: dict[str, torch.Tensor] = {}
        with self.hooks(cache=cache, names_filter=names_filter):
            out = self(inputs, *args, **kwargs)
        return out, cache

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg) -> SoftPriorTransformer:
    """A run's model, initialised from a forked global RNG seeded with the run seed (``cfg``: a
    RunConfig; the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return SoftPriorTransformer(cfg.model)
