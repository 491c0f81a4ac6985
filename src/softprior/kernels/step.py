"""The whole training forward and backward in one C++ operator (``step.cpp``), for the fast path's
commonest model; built with the attention operator into one library (``attention.py``).

``step_logits(params, cfg, tokens, g_pos, g_content, positions)`` returns what
``fastpath.fast_forward`` returns, the logits at the loss positions for K run-stacked runs, as one
autograd node: ``softprior::step_forward`` computes them (and keeps what the backward reads) and
``softprior::step_backward`` every parameter's gradient and the gates', without an autograd graph
of the model's hundreds of operators (docs/PERFORMANCE.md, "The whole-step operator").

A layer's B^pos reaches it as the soft prior's table ([K, H, n_ctx], indexed by offset) or, for any
other prior family, as the family's whole bias ([K, H, T, T], ungated, evaluated by the family's own
code: ``fastpath._family_bias``); the operator returns that input's gradient, and autograd carries it
into the family's parameters.

``supports(cfg, tokens, T, P)`` says where it applies: any prior (``fastpath.supports`` keeps the
families that replace B^content on the readable model) with no positional scheme, LayerNorm before each block, a token task, a context that fits the position table, at
least two layers and a last layer that reads few positions (2P <= T, fastpath point 4).
Elsewhere the fast path runs as before (with the attention operator where it applies).
``SOFTPRIOR_KERNELS=attention`` keeps the attention operator but not this one.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

__all__ = ["supports", "why_not", "step_logits", "param_names", "enabled"]

def enabled() -> bool:
    """Whether the whole-step operator may run: the library built and not switched off
    (``SOFTPRIOR_KERNELS=0``, or ``=attention`` for the attention operator alone)."""
    from .attention import ENV, available
    if os.environ.get(ENV, "").strip().lower() == "attention":
        return False
    return available()


def supports(cfg, tokens: bool, T: int, P: int) -> bool:
    """Whether ``step_logits`` computes this model (``cfg``: its ``model.config.ModelConfig``, read for its
    fields only: the kernels import nothing of the model) at context T with P loss positions."""
    return why_not(cfg, tokens, T, P) is None


def why_not(cfg, tokens: bool, T: int, P: int) -> str | None:
    """Why ``step_logits`` does not compute this model at context T with P loss positions (None: it does)."""
    for bad, why in ((not tokens, "the task's inputs are vectors, not tokens"),
                     (cfg.positional != "none", f"positional scheme {cfg.positional!r}"),
                     (cfg.norm != "pre", f"norm {cfg.norm!r} (the operator has pre-LayerNorm)"),
                     (cfg.n_layers < 2, f"{cfg.n_layers} layer (the operator needs at least 2)"),
                     (T > cfg.n_ctx, f"context {T} past the position table's {cfg.n_ctx}"),
                     (2 * P > T, f"{P} loss positions of {T} (the operator's last layer reads at most half)")):
        if bad:
            return why
    return None


def _param_lists() -> dict[str, list[str]]:
    """The parameter names of ``step.cpp``'s three lists (``SOFTPRIOR_EMBED_PARAM``, ``_LAYER_PARAMS``,
    ``_FINAL_PARAMS``): the one place the operator's parameter order is written."""
    text = (Path(__file__).parent / "step.cpp").read_text()
    out = {}
    for part in ("EMBED_PARAM", "LAYER_PARAMS", "FINAL_PARAMS"):
        line = re.search(rf"^#define SOFTPRIOR_{part}\(X\) (.*)$", text, re.M)
        if line is None:
            raise RuntimeError(f"softprior step: step.cpp lost its SOFTPRIOR_{part} list")
        out[part] = re.findall(r'X\(\w+, "([^"]+)"\)', line.group(1))
    return out


@lru_cache(maxsize=None)
def param_names(L: int) -> tuple[str, ...]:
    """The parameters in the operator's order (``step.cpp``'s lists): the embedding, per layer (LayerNorm
    weight and bias, in_proj, out_proj, B^pos), the final LayerNorm."""
    lists = _param_lists()
    names = lists["EMBED_PARAM"] + [f"blocks.{l}.{n}" for l in range(L) for n in lists["LAYER_PARAMS"]]
    return tuple(names + lists["FINAL_PARAMS"])


class _Step(torch.autograd.Function):
    """logits = the model at the loss positions; backward: every parameter's and gate's gradient."""

    @staticmethod
    def forward(ctx, meta, g_pos, g_content, *params):
        tokens, pos, qs, rank, save = meta
        # (grad mode is off in here, so the dispatcher's autograd fallback gives the outputs no nodes)
        out = torch.ops.softprior.step_forward(list(params), g_pos, g_content, tokens, pos, qs, rank, save)
        ctx.meta, ctx.saved, ctx.inputs = meta, out[1:], (g_pos, g_content, *params)
        return out[0]

    @staticmethod
    @once_differentiable  # its backward is not itself differentiable: a double backward raises, never wrong
    def backward(ctx, dlogits):
        tokens, pos, qs, rank, _ = ctx.meta
        if not ctx.saved:
            raise RuntimeError("softprior step: backward through a step whose forward kept nothing for it")
        g_pos, g_content, *params = ctx.inputs
        with torch.no_grad():  # as in the forward: no autograd around the operator's own calls
            grads = torch.ops.softprior.step_backward(params, g_pos, g_content, tokens, pos, qs, rank, ctx.saved, dlogits)
        return (None, grads[-2], grads[-1], *grads[:-2])


def step_logits(params: dict[str, torch.Tensor], cfg, tokens: torch.Tensor, g_pos: torch.Tensor,
                g_content: torch.Tensor, positions: tuple[int, ...]) -> torch.Tensor:
    """[K, B, P, vocab] logits of K runs (``fastpath.fast_forward``'s contract): params run-stacked
    [K, ...]; tokens [K, B, T] or [B, T] (shared); g_pos, g_content [K, L, H]; positions the loss positions."""
    from .attention import available, build_error
    if not available():  # builds the library at the first call (fastpath asks ``enabled()`` first)
        raise RuntimeError(f"softprior step: the kernels' library is unavailable ({build_error() or 'switched off'})")
    if tokens.dim() == 2:
        tokens = tokens.unsqueeze(0)
    dtype = params["embed.weight"].dtype
    ps = [params[n] for n in param_names(cfg.n_layers)]
    # what the backward reads is kept only where a gradient will be taken (not in evaluation)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (g_pos, g_content, *ps))
    meta = (tokens.long(), list(positions), float(cfg.qk_scale), int(cfg.content_rank), save)
    return _Step.apply(meta, g_pos.to(dtype), g_content.to(dtype), *ps)
