"""The thirteen static baselines the paper compares against (docs/DESIGN.md, "Baselines") as (model
options, path) pairs on the same backbone, optimiser and budget. Ten are positional schemes
(``softprior.positional``) on a model whose soft prior is switched off; three are the model's own gated
soft prior:

- soft_bias:         both gates learned (the ``unforced`` path);
- soft_pos_only:     position gate learned, content gate fixed at 0;
- soft_content_only: content gate learned, position gate fixed at 0.

Kerple counts as one baseline with two variants: ``kerple`` (= ``kerple_log``) and ``kerple_power``.

This module is the one definition of the baselines (``BASELINES``, ``GATED_BASELINES``); the
positional schemes themselves are registered in ``softprior.positional.SCHEMES``.
"""

from __future__ import annotations

from ..paths import GateConfig, PathConfig
from ..positional import SCHEMES

__all__ = ["BASELINES", "GATED_BASELINES", "list_baselines", "resolve_baseline", "UnknownBaselineError",
           "STATIC_PATH"]


class UnknownBaselineError(ValueError):
    pass


_ZERO = GateConfig(mode="fixed", value=0.0)
STATIC_PATH = PathConfig(name="static", description="no soft prior: a static positional scheme", pos=_ZERO,
                         content=_ZERO)
# the model's own gated soft prior on a NoPE backbone: name -> (path, description)
GATED_BASELINES: dict[str, tuple[PathConfig, str]] = {
    "soft_bias": (PathConfig(name="unforced", description="both gates learned freely (sigmoid of a trained logit)"),
                  "soft prior, position and content gates both learned"),
    "soft_pos_only": (PathConfig(name="soft_pos_only", description="position gate learned, content gate 0",
                                 content=_ZERO), "soft prior, position gate learned, content gate fixed at 0"),
    "soft_content_only": (PathConfig(name="soft_content_only", description="content gate learned, position gate 0",
                                     pos=_ZERO), "soft prior, content gate learned, position gate fixed at 0"),
}
_ALIASES = {"kerple": "kerple_log"}
# the thirteen names, in the order of the static-baselines table
BASELINES = ["vanilla", "nope", "rope", "alibi", "t5", "dape", "cope", "fire", "kerple", "gpsa",
             "soft_bias", "soft_pos_only", "soft_content_only"]


def resolve_baseline(name: str) -> tuple[dict, PathConfig]:
    """(model options, path) for a baseline name."""
    if name in GATED_BASELINES:
        return {}, GATED_BASELINES[name][0]
    scheme = _ALIASES.get(name, name)
    if scheme in SCHEMES:
        return {"positional": scheme, "prior": False}, STATIC_PATH
    raise UnknownBaselineError(f"unknown baseline {name!r}; allowed: {', '.join(BASELINES)}, kerple_power")


def list_baselines() -> list[tuple[str, str]]:
    rows = []
    for name in BASELINES:
        if name in GATED_BASELINES:
            rows.append((name, GATED_BASELINES[name][1]))
        elif name == "kerple":
            rows.append((name, f"{SCHEMES['kerple_log'][1]} (variant kerple_power: {SCHEMES['kerple_power'][1]})"))
        else:
            rows.append((name, SCHEMES[name][1]))
    return rows
