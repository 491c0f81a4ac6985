"""Training paths (gate trajectories) as data.

The paper's training paths: all share optimiser, model, data and step budget; they differ only in how
strongly the prior is applied over training. A path is a gate config per gate kind (position and
content) plus options. Each gate is in one of three modes (the model's gates, docs/DESIGN.md "Model"):

- ``learned``:   g = sigmoid(logit), the logit is trained (init from the model config);
- ``fixed``:     g = value for the whole run (the logit is masked: it gets no gradient);
- ``scheduled``: g = schedule(step) (logit masked).

Named paths (``get_path``) cover the paper; new paths can be registered from Python
(``register_path``) or loaded from a JSON/TOML file (``load_path_file``) with no library change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .registry import Registry
from .schedules import Fade, HardSwitch, Linear, Schedule

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli is the same parser (a dependency there, see pyproject.toml)
    import tomli as tomllib

__all__ = [
    "GateConfig", "PathConfig", "get_path", "register_path", "list_paths", "load_path_file",
    "UnknownPathError",
]


class UnknownPathError(ValueError):
    pass


class GateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["learned", "fixed", "scheduled"] = "learned"
    value: float | None = Field(None, ge=0.0, le=1.0, description="the constant for mode=fixed")
    schedule: Schedule | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data):
        """A constant schedule is the fixed mode: both spellings of one trajectory are one config (one
        run id)."""
        if isinstance(data, dict) and data.get("mode") == "scheduled":
            sch = data.get("schedule")
            kind, value = (sch.get("kind"), sch.get("value")) if isinstance(sch, dict) else \
                (getattr(sch, "kind", None), getattr(sch, "value", None))
            if kind == "constant":
                data = {k: v for k, v in data.items() if k != "schedule"} | {"mode": "fixed", "value": value}
        return data

    @model_validator(mode="after")
    def _check(self) -> "GateConfig":
        if self.mode == "fixed" and self.value is None:
            raise ValueError("gate mode 'fixed' needs a 'value' in [0, 1]")
        if self.mode == "scheduled" and self.schedule is None:
            raise ValueError("gate mode 'scheduled' needs a 'schedule'")
        if self.mode == "learned" and (self.value is not None or self.schedule is not None):
            raise ValueError("gate mode 'learned' takes neither 'value' nor 'schedule'")
        return self

    def value_at(self, step: int, total_steps: int) -> float | None:
        """The forced gate value at ``step``, or None when the gate is learned."""
        if self.mode == "learned":
            return None
        if self.mode == "fixed":
            return float(self.value)
        return float(self.schedule(step, total_steps))


LEARNED = GateConfig(mode="learned")


def _fixed(v: float) -> GateConfig:
    return GateConfig(mode="fixed", value=v)


def _sched(s) -> GateConfig:
    return GateConfig(mode="scheduled", schedule=s)


class PathConfig(BaseModel):
    """One gate trajectory. ``parent`` makes a derived run (post hoc continuation): the run starts
    from the final checkpoint of the same run config trained along ``parent`` for ``parent_steps``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    pos: GateConfig = LEARNED
    content: GateConfig = LEARNED
    prior_dropout: float = Field(0.0, ge=0.0, lt=1.0,
                                 description="fraction of steps on which both gates are forced to 0")
    dual_loss: bool = Field(False, description="optimise loss(normal gates) + loss(zero gates)")
    parent: "PathConfig | None" = None
    parent_steps: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1, description="overrides the run's step budget")


# ---------------------------------------------------------------- registry of named paths
_FIXED_PATHS: Registry[PathConfig] = Registry("path", describe=lambda p: p.description)


def register_path(path: PathConfig, *, overwrite: bool = False) -> PathConfig:
    """Make ``path`` available by name to ``get_path`` and the CLI."""
    return _FIXED_PATHS.register(path.name, path, overwrite=overwrite)


register_path(PathConfig(name="unforced", description="both gates learned freely (sigmoid of a trained logit)"))
register_path(PathConfig(name="forced_zero", description="g = 0 throughout: a plain NoPE model",
                         pos=_fixed(0.0), content=_fixed(0.0)))
register_path(PathConfig(name="forced_const0.5", description="g = 0.5 throughout",
                         pos=_fixed(0.5), content=_fixed(0.5)))
register_path(PathConfig(name="linear0.5->0", description="g linear from 0.5 at step 0 to 0 at the final step",
                         pos=_sched(Linear()), content=_sched(Linear())))
register_path(PathConfig(name="prior_dropout", description="unforced, but both gates are 0 on a random 50% of steps",
                         prior_dropout=0.5))
register_path(PathConfig(name="dual_loss", description="unforced, each step optimises loss(normal) + loss(zero gates)",
                         dual_loss=True))
register_path(PathConfig(
    name="posthoc", description="post hoc continuation: an unforced run's final checkpoint, 2,550 more steps at g=0",
    pos=_fixed(0.0), content=_fixed(0.0), parent=PathConfig(name="unforced"), steps=2550))

_PATTERNS = [
    (re.compile(r"^fade(\d+)(?:->0)?(?::(\w+))?$"), "fadeS->0[:shape]", "hold 0.5 until step S, fade to 0 over "
     "450 steps (shape linear|cosine|convex|concave|two_step), then g=0"),
    (re.compile(r"^(?:hard_)?switch(\d+)$"), "hard_switchS", "g=0.5 until step S, then 0"),
    (re.compile(r"^forced_const([0-9.]+)$"), "forced_constC", "g = C throughout"),
    (re.compile(r"^prior_dropout([0-9.]+)$"), "prior_dropoutF", "unforced, gates 0 on a random fraction F of steps"),
]


def get_path(name: str) -> PathConfig:
    """Resolve a path name (a registered one, or a parametrised family such as ``fade600->0:cosine``)."""
    if name in _FIXED_PATHS:
        return _FIXED_PATHS[name]
    if name.endswith((".json", ".toml")):
        return load_path_file(name)
    m = _PATTERNS[0][0].match(name)
    if m:
        start, shape = int(m.group(1)), (m.group(2) or "linear")
        try:
            fade = Fade(start_step=start, shape=shape)
        except Exception:
            raise UnknownPathError(f"unknown fade shape {shape!r} in path {name!r}; "
                                   "allowed: linear, cosine, convex, concave, two_step") from None
        canon = f"fade{start}->0" + ("" if shape == "linear" else f":{shape}")
        return PathConfig(name=canon, description=f"hold 0.5 until {start}, {shape} fade to 0 over 450 steps",
                          pos=_sched(fade), content=_sched(fade))
    m = _PATTERNS[1][0].match(name)
    if m:
        at = int(m.group(1))
        hs = HardSwitch(at=at)
        return PathConfig(name=f"hard_switch{at}", description=f"g=0.5 until step {at}, then 0",
                          pos=_sched(hs), content=_sched(hs))
    m = _PATTERNS[2][0].match(name)
    if m:
        c = _float_in_unit(m.group(1), name)
        return PathConfig(name=f"forced_const{c:g}", description=f"g = {c:g} throughout",
                          pos=_fixed(c), content=_fixed(c))
    m = _PATTERNS[3][0].match(name)
    if m:
        f = _float_in_unit(m.group(1), name)
        if f >= 1.0:
            raise UnknownPathError(f"prior dropout fraction {f} in path {name!r} must lie in [0, 1)")
        return PathConfig(name=f"prior_dropout{f:g}", description=f"unforced, gates 0 on a random {f:g} of steps",
                          prior_dropout=f)
    raise UnknownPathError(f"unknown path {name!r}; allowed: {', '.join(_FIXED_PATHS)}, "
                           "fadeS->0[:shape], hard_switchS, forced_constC, prior_dropoutF, or a .json/.toml file")


def _float_in_unit(text: str, name: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UnknownPathError(f"bad number {text!r} in path {name!r}") from None
    if not 0.0 <= v < 1.0 + 1e-12:
        raise UnknownPathError(f"value {v} in path {name!r} must lie in [0, 1]")
    return v


def load_path_file(file: str | Path) -> PathConfig:
    """Load a PathConfig from a JSON or TOML file (the same fields as ``PathConfig``). Every problem
    (missing or unreadable file, not UTF-8, not JSON/TOML, invalid fields) is a one-line
    ``UnknownPathError`` naming the file."""
    p = Path(file)
    try:
        ok = p.is_file()
    except (OSError, ValueError):  # e.g. a NUL byte in the name
        ok = False
    if not ok:
        raise UnknownPathError(f"path file {str(p)!r} does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        return PathConfig.model_validate(data)
    except ValidationError as e:  # name the fields, on one line
        raise UnknownPathError(f"invalid path file {str(p)!r}: {_validation_summary(e)}") from None
    except Exception as e:  # noqa: BLE001 - OSError, UnicodeDecodeError, JSON/TOML syntax errors
        raise UnknownPathError(f"invalid path file {str(p)!r}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def _validation_summary(e: ValidationError) -> str:
    """A pydantic error on one line: 'field.sub: message (got value); ...'."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
        parts.append(f"{loc}: {err.get('msg')}{got}")
    return " ".join("; ".join(parts).split("\n"))


def list_paths() -> list[tuple[str, str]]:
    """(name, one-line description) for every named path and parametrised family."""
    rows = _FIXED_PATHS.listing()
    rows += [(name, desc) for _, name, desc in _PATTERNS]
    return rows



# ---------------------------------------------------------------- scaling to another budget
_STEP_FIELDS = ("start_step", "end_step", "width", "at")


def scale_path(path: PathConfig, factor: float) -> PathConfig:
    """The same trajectory on a budget ``factor`` times the paper's: every step number of every
    schedule (fade start and width, switch step, linear end) and the derived run's budgets are
    multiplied by ``factor`` and rounded (at least 1 for widths and budgets). ``--quick`` uses it so a
    smoke run keeps every path's shape: fade600 of 3,600 becomes a fade at 1/6 of the quick budget."""
    def s(v, least=0):
        return None if v is None else max(least, int(round(v * factor)))

    def gate(g: GateConfig) -> GateConfig:
        if g.schedule is None:
            return g
        fields = type(g.schedule).model_fields
        upd = {k: s(getattr(g.schedule, k), 1 if k in ("width", "end_step") else 0) for k in _STEP_FIELDS
               if k in fields and getattr(g.schedule, k) is not None}
        return g.model_copy(update={"schedule": g.schedule.model_copy(update=upd)})

    out = path.model_copy(update={"pos": gate(path.pos), "content": gate(path.content),
                                  "parent": scale_path(path.parent, factor) if path.parent else None,
                                  "parent_steps": s(path.parent_steps, 1), "steps": s(path.steps, 1)})
    if factor == 1:
        return out
    # the help text follows the schedule (it is not hashed: run ids are those of the same path unscaled so far)
    return out.model_copy(update={"description": f"{path.name} scaled x{factor:.4g}: {schedule_text(out)}"})


def schedule_text(path: PathConfig) -> str:
    """The path's gate trajectories in words, with their step numbers: 'g = ...' when both gates
    share one, else 'pos ...; content ...'."""
    def one(g: GateConfig) -> str:
        if g.mode == "learned":
            return "learned"
        return f"{g.value:g} throughout" if g.mode == "fixed" else g.schedule.describe()
    pos, content = one(path.pos), one(path.content)
    return f"g = {pos}" if pos == content else f"pos {pos}; content {content}"


def settles_at(path: PathConfig) -> int | None:
    """The first step from which every gate schedule of ``path`` holds its final value (a fade's end, a
    switch's step; ``Schedule.settles_at``), or None when no schedule needs a particular budget (learned
    or fixed gates, a linear schedule to the final step). A run of N steps (0 .. N - 1) follows the whole
    trajectory only if ``settles_at < N``."""
    ends = [g.schedule.settles_at for g in (path.pos, path.content) if g.schedule is not None]
    ends = [e for e in ends if e is not None]
    return max(ends) if ends else None


def fits_budget(path: PathConfig, steps: int) -> bool:
    """Whether a run of ``steps`` steps along ``path`` (and its parent's run, for a derived path)
    follows the whole trajectory the path's name promises: False for fade600->0 on 200 steps, which
    would never fade. ``path.steps`` / ``parent_steps``, where set, override ``steps`` as in ``RunConfig``."""
    end = settles_at(path)
    if end is not None and end >= (path.steps or steps):
        return False
    return path.parent is None or fits_budget(path.parent, path.parent_steps or steps)


def scale_to_budget(path: PathConfig, steps: int, paper_steps: int = 3600) -> PathConfig:
    """``path`` on a budget of ``steps`` instead of the paper's ``paper_steps``, scaled as ``--quick``
    scales it (``scale_path``, factor steps / paper_steps), and named so: 'fade600->0 scaled 200/3600'
    (a new name, so a new run id: it is not the paper's fade600->0)."""
    if steps == paper_steps:
        return path
    out = scale_path(path, steps / paper_steps)
    return out.model_copy(update={"name": f"{path.name} scaled {steps}/{paper_steps}"})


__all__ += ["scale_path", "schedule_text", "settles_at", "fits_budget", "scale_to_budget"]
