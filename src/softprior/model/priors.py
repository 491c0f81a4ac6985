"""The prior registry: the B^pos families a model's removable prior can take (docs/STUDY.md, "Your
own prior or task"; the paper's prior is Sec. 3).

The model adds ``g_pos * B^pos_h(i, j) + g_content * B^content_h(x_i, x_j)`` to its attention logits
(``model.transformer.Attention``); a *prior family* says what B^pos is, how it starts and what it learns, and may
replace B^content. ``ModelConfig.prior_family`` names the family; the gates, the paths that anneal
them, and the whole method stay as they are.

- ``soft`` (the first entry): the paper's learned table B^pos[h, i - j] over offsets 0..n_ctx-1, its
  initialisation set by ``prior_init`` / ``prior_scale`` / ``prior_layers`` (``model.transformer.initial_pos_bias``),
  and the rank-r bilinear B^content. The model computes it itself; the fast path supports it.
- every static positional scheme whose bias is a function of the offsets (an ``AdditiveBias`` of
  ``softprior.positional``: alibi, t5, kerple_log, kerple_power, fire) under the gate, as
  ``<scheme>`` (e.g. ``alibi``): its bias b_h(i, j) is B^pos, built on the layers ``prior_layers``
  names (no B^pos on the others), with the scheme's own initialisation and parameters;
- any family a plugin file registers (``register_prior``): a module class whose instances, built per
  prior layer as ``cls(cfg, layer)``, compute ``bias(qpos, kpos) -> [H, Tq, T]`` (``PositionalPrior``;
  offsets i - j >= 0 on the allowed keys; future keys are masked after it) and, optionally,
  ``content_bias(xq, xk) -> [B, H, Tq, T]``, which replaces the bilinear B^content.

Families other than ``soft`` train through the readable model (``fastpath.supports`` is False). The
model keeps its B^pos table parameter for every family (unused, and so untouched, by the others), so
state dicts keep one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from ..registry import Registry

__all__ = ["PriorFamily", "PRIORS", "register_prior", "prior_family", "build_prior", "PositionalPrior",
           "UnknownPriorError"]


class UnknownPriorError(ValueError):
    pass


class PositionalPrior(nn.Module):
    """The base of a plugin's B^pos family: ``__init__(cfg, layer)`` (``cfg``: the ModelConfig) and
    ``bias(qpos, kpos) -> [H, Tq, T]``. ``content_bias(xq, xk)`` (LayerNorm-ed residuals [B, Tq, d]
    and [B, T, d]) may return [B, H, Tq, T] to replace B^content; None keeps the model's own."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.n_heads, self.n_ctx, self.layer = cfg.n_heads, cfg.n_ctx, layer

    def bias(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def content_bias(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor | None:
        return None


@dataclass(frozen=True)
class PriorFamily:
    name: str
    build: Callable | None  # (cfg, layer) -> module with bias(qpos, kpos); None: the model's own table
    description: str
    axes: dict = field(default_factory=dict)  # model-axis -> values a study's search may vary
    plugin: str | None = None


PRIORS: Registry[PriorFamily] = Registry("prior", UnknownPriorError, describe=lambda e: e.description)


def register_prior(name: str, build, description: str, *, axes: dict | None = None,
                   overwrite: bool = False) -> PriorFamily:
    """Register a family: ``build`` is a ``PositionalPrior`` subclass (or any ``(cfg, layer) -> module``
    with ``bias(qpos, kpos)``); ``axes``: calibration axes of the model config that set its
    initialisation (e.g. ``{"model.prior_scale": [0.5, 1, 2]}``), which ``softprior study`` searches."""
    from ..plugins import current_plugin
    if not callable(build) or (isinstance(build, type) and not (issubclass(build, nn.Module)
                                                                  and callable(getattr(build, "bias", None)))):
        what = build.__name__ if isinstance(build, type) else type(build).__name__
        raise TypeError(f"prior {name!r}: build must be a PositionalPrior subclass (an nn.Module with "
                        f"bias(qpos, kpos)) or a callable (cfg, layer); got {what}")
    return PRIORS.register(name, PriorFamily(name, build, description, dict(axes or {}), current_plugin()),
                           overwrite=overwrite)


def prior_family(name: str) -> PriorFamily:
    """The entry of family ``name``; a name not registered in this process is looked for in the plugin
    files it was started with (``plugins.load_noted_plugins``) before ``UnknownPriorError``."""
    if name not in PRIORS:
        from ..plugins import load_noted_plugins
        load_noted_plugins()
    return PRIORS[name]


class _NoBias(nn.Module):
    """No B^pos (a layer outside ``prior_layers`` of a non-table family)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads

    def bias(self, qpos, kpos):
        return torch.zeros(self.n_heads, len(qpos), len(kpos), device=qpos.device)


def build_prior(cfg, layer: int) -> nn.Module | None:
    """The B^pos module of ``layer``, or None for the model's own table (family ``soft``)."""
    fam = prior_family(cfg.prior_family)
    if fam.build is None:
        return None
    if layer not in cfg.prior_layers:
        return _NoBias(cfg.n_heads)
    return fam.build(cfg, layer)


# the strengths a study searches for a built-in family (``ModelConfig.prior_gain``): its bias as the
# scheme defines it, and 4 and 16 times that, as the soft table's search spans prior_scale .5-4 on an
# initialisation whose offsets differ by up to prior_cap (8) logits where ALiBi's steepest head moves
# .25 a position (docs/STUDY.md, "The atlas")
GAINS = (1.0, 4.0, 16.0)


def _scheme_prior(scheme: str):
    def build(cfg, layer):
        from ..positional import make_scheme
        return make_scheme(scheme, n_heads=cfg.n_heads, d_head=cfg.d_head, d_model=cfg.d_model, n_ctx=cfg.n_ctx,
                           layer=layer, n_layers=cfg.n_layers)
    return build


PRIORS.register("soft", PriorFamily("soft", None, "the paper's learned B^pos table over offsets (prior_init) and "
                                   "rank-r B^content"))
for _name, _what in (("alibi", "ALiBi's fixed slopes -m_h|i-j|"), ("t5", "T5's learned bucketed bias"),
                     ("kerple_log", "Kerple's learned -r1 log(1 + r2|i-j|)"),
                     ("kerple_power", "Kerple's learned -r1 |i-j|^r2"), ("fire", "FIRE's MLP of the offset")):
    register_prior(_name, _scheme_prior(_name), f"{_what} as B^pos under the gate (softprior.positional)",
                   axes={"model.prior_gain": list(GAINS)})
