"""The model's configuration: architecture and initialisation (docs/DESIGN.md, "Model"), and the
paper's two sizes. Kept apart from ``model/transformer.py`` so that configs, run ids and listings need no torch.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..registry import Registry

__all__ = ["ModelConfig", "MODEL_PRESETS", "model_preset", "size_label", "UnknownModelError"]


class UnknownModelError(ValueError):
    pass


class ModelConfig(BaseModel):
    """Architecture and initialisation. Input/output kinds are filled in from the task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    d_model: int = Field(64, ge=2)
    n_ctx: int = Field(32, ge=2, description="training context length; the B^pos table has n_ctx offsets")
    vocab: int = Field(32, ge=2, description="token vocabulary (token tasks)")
    d_in: int | None = Field(None, ge=1, description="vector input size (linear ICL); None for tokens")
    d_out: int | None = Field(None, ge=1, description="vector output size (linear ICL); None for tied unembedding")
    content_rank: int = Field(2, ge=0, description="rank r of the bilinear content bias (0: no content bias, "
                              "so the content gate gates nothing and the model adds no parameters for it)")
    gate_granularity: Literal["shared", "layer", "head"] = "shared"
    gate_logit_init: float = 0.0
    embed_init_std: float = Field(1.0, gt=0, description="std of the token embedding (PyTorch's default is 1.0)")
    content_init_std: float = Field(0.02, ge=0)
    prior_init: Literal["zero", "locality", "bounded", "alibi"] = Field(
        "locality", description="B^pos init on prior_layers (the others start at zero): zero; locality "
        "B[h, r] = -scale (r - h)^2; bounded min(that, prior_cap) in magnitude; alibi -scale m_h r")
    prior_layers: tuple[int, ...] = (0,)
    prior_scale: float = 1.0
    prior_cap: float = Field(8.0, gt=0, description="bound on |B| for prior_init='bounded'")
    pos_beyond: Literal["clip", "zero"] = Field(
        "clip", description="B^pos at offsets >= n_ctx (evaluation lengths only): the last learned offset's "
        "value (clip) or no bias (zero)")
    norm: Literal["pre", "post", "none"] = Field(
        "pre", description="LayerNorm placement: before each attention block and the unembedding (pre), "
        "after each residual add (post, the original Transformer's), or no LayerNorm (none)")
    attn_scale: Literal["inverse_sqrt", "inverse", "one"] = Field(
        "inverse_sqrt", description="the factor on Q K^T: 1/sqrt(d_head) (the paper's equation), 1/d_head "
        "(muP's), or 1")
    prior: bool = Field(True, description="False: no soft prior (gates always 0), for static baselines")
    positional: str = Field("none", description="static positional scheme (softprior.positional), or none")
    prior_family: str = Field("soft", description="the prior's B^pos family (softprior.model.priors): soft, the paper's "
                              "table, or a registered one")
    prior_gain: float = Field(1.0, gt=0, description="a registered family's B^pos multiplied by this: its strength, "
                              "as prior_scale sets the soft table's (1 for the soft prior)")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data):
        """A zero-initialised B^pos has no scale, layers or cap: they take their defaults, so equal
        models have one config (and one run id)."""
        if isinstance(data, dict) and data.get("prior_init") == "zero":
            data = {k: v for k, v in data.items() if k not in ("prior_scale", "prior_layers", "prior_cap")}
        if isinstance(data, dict) and data.get("prior_init", "locality") != "bounded":
            data = {k: v for k, v in data.items() if k != "prior_cap"}
        return data

    @model_validator(mode="after")
    def _check(self):
        from ..positional import SCHEMES
        if self.positional != "none" and self.positional not in SCHEMES:
            raise ValueError(f"unknown positional scheme {self.positional!r}; allowed: none, {', '.join(SCHEMES)}")
        if self.prior_family != "soft":
            from .priors import prior_family
            prior_family(self.prior_family)  # UnknownPriorError (a ValueError) names the allowed families
        elif self.prior_gain != 1.0:
            raise ValueError(f"prior_gain={self.prior_gain} scales a registered family's B^pos; the soft prior's "
                             "table takes prior_scale")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        bad = [l for l in self.prior_layers if not 0 <= l < self.n_layers]
        if bad:
            raise ValueError(f"prior_layers {bad} out of range for n_layers={self.n_layers}")
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qk_scale(self) -> float:
        """The factor on Q K^T that ``attn_scale`` names."""
        return {"inverse_sqrt": 1.0 / math.sqrt(self.d_head), "inverse": 1.0 / self.d_head, "one": 1.0}[self.attn_scale]

    @property
    def qk_unscale(self) -> float:
        """1 / ``qk_scale``, as the fast path multiplies it back (sqrt(d_head) written as such: the same bits)."""
        return {"inverse_sqrt": math.sqrt(self.d_head), "inverse": float(self.d_head), "one": 1.0}[self.attn_scale]


MODEL_PRESETS = Registry("model", UnknownModelError, {
    "base": dict(n_layers=2, n_heads=4, d_model=64),
    "large": dict(n_layers=4, n_heads=4, d_model=128),
}, describe=lambda sizes: ", ".join(f"{k}={v}" for k, v in sizes.items()))


def model_preset(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


def size_label(cfg: ModelConfig) -> str:
    """The preset whose depth and width a model has (the run index's ``model`` column), else "L{n}d{d}"."""
    for name, sizes in MODEL_PRESETS.items():
        if (cfg.n_layers, cfg.d_model) == (sizes["n_layers"], sizes["d_model"]):
            return name
    return f"L{cfg.n_layers}d{cfg.d_model}"
