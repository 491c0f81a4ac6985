"""A calibration search space: data, validated by pydantic (TOML or JSON on disk).

    name = "assoc_recall"
    task = "assoc_recall"          # which difficulty criteria apply (criteria.DIFFICULTY)
    model = "base"
    sampler = "tpe"                # tpe | grid | random (Optuna samplers)
    seeds = 3                      # seeds a promising candidate is measured on
    first_seeds = 1                # seeds every candidate is measured on first (successive halving)
    [base.task]                    # options every candidate shares
    [base.model]
    [axes]                         # "task.<field>" or "model.<field>" -> the values to try
    "task.n_pairs" = [6, 8, 10, 12]
    "model.embed_init_std" = [0.02, 0.3, 1.0]
    [[enqueue]]                    # optional: candidates to measure first (other axes: first value)
    "task.n_pairs" = 8

Axes may only name task-design and initialisation fields (``TASK_AXES`` / ``MODEL_AXES``): training
defaults and model sizes stay as the paper gives them (docs/DESIGN.md, "Calibration"). A combination the task or model
config rejects (e.g. 12 pairs in a 'pool' layout that cannot hold them) is recorded as infeasible.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .criteria import Criterion, declared_criteria

__all__ = ["SearchSpace", "load_space", "shipped_spaces", "TASK_AXES", "MODEL_AXES", "SpaceError"]

TASK_AXES = {"vocab", "n_pairs", "n_keys", "layout", "n_queries", "loss_on", "placement", "query", "d", "n_points",
             "keys", "repeat_target", "answer", "format", "w_scale", "noise"}
MODEL_AXES = {"embed_init_std", "content_rank", "content_init_std", "gate_granularity", "gate_logit_init",
              "prior_init", "prior_layers", "prior_scale", "prior_cap", "pos_beyond", "prior_gain", "norm",
              "attn_scale"}


MIN_SET = 10  # an identified set holds at least this many configurations unless its space says (``min_set``)


class SpaceError(ValueError):
    pass


class SearchSpace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    task: str = Field(description="a registered task (tasks.registry.TASK_SPECS)")
    model: Literal["base", "large"] = "base"
    sampler: Literal["tpe", "grid", "random"] = "tpe"
    sampler_seed: int = 0
    seeds: int = Field(3, ge=1)
    first_seeds: int = Field(1, ge=1)
    base: dict[str, dict[str, Any]] = Field(default_factory=dict, description="fixed task / model options")
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    enqueue: list[dict[str, Any]] = Field(default_factory=list, description="candidates measured first "
                                          "(axis -> value; axes left out take their first value)")
    identify: bool = Field(False, description="score candidates on the identification rows (tiers.py), the "
                           "per-seed difficulty criteria kept as hard constraints, instead of the difficulty rows")
    effect: bool = Field(False, description="exploratory: maximise the trajectory effect itself (fade600 zero "
                         "minus the larger of forced_zero and hard_switch600 zero; unforced zero <= .15 on every "
                         "seed); its runs belong in a store of their own and never enter a verdict table")
    difficulty: list[Criterion] | None = Field(None, description="this space's difficulty criteria (`softprior "
                                               "study`: the user's, or its defaults); None: the task's")
    hard: list[Criterion] | None = Field(None, description="an identification search's hard constraints (a "
                                         "regime of its own, e.g. a blocked constant gate); None: the task's "
                                         "per-seed difficulty criteria")
    reads: dict[str, str] = Field(default_factory=dict, description="an identification search's reading of a "
                                  "row other than the row's own (row name -> a tiers.READS value), e.g. the constant "
                                  "gate's normal at the gate it trained with, g=.5")
    min_set: int = Field(MIN_SET, ge=1, description="an identification search's identified set: at least this many "
                         "configurations on five seeds (identify.identified)")

    @field_validator("task")
    @classmethod
    def _check_task(cls, v):
        from ..tasks.registry import UnknownTaskError, task_spec
        try:
            task_spec(v)
        except UnknownTaskError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("base")
    @classmethod
    def _check_base(cls, v):
        bad = set(v) - {"task", "model"}
        if bad:
            raise ValueError(f"base may hold only 'task' and 'model', got {sorted(bad)}")
        return v

    @field_validator("axes")
    @classmethod
    def _check_axes(cls, v, info):
        from ..tasks.registry import TASK_SPECS
        spec = TASK_SPECS.get(info.data.get("task", ""))
        task_axes = TASK_AXES if spec is None or spec.plugin is None else set(spec.search_axes)
        for key, values in v.items():
            part, _, fld = key.partition(".")
            allowed = task_axes if part == "task" else MODEL_AXES if part == "model" else None
            if allowed is None or fld not in allowed:
                raise ValueError(f"axis {key!r} is not a task-design or initialisation field; allowed: "
                                 + ", ".join(sorted([f"task.{a}" for a in task_axes] + [f"model.{a}" for a in MODEL_AXES])))
            if not values:
                raise ValueError(f"axis {key!r} has no values")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.first_seeds > self.seeds:
            raise ValueError(f"first_seeds={self.first_seeds} must be <= seeds={self.seeds}")
        for point in self.enqueue:
            for k, v in point.items():
                if k not in self.axes or v not in self.axes[k]:
                    raise ValueError(f"enqueue: {k}={v!r} is not a value of an axis")
        if self.identify and self.effect:
            raise ValueError("identify and effect exclude each other: one objective per search")
        if self.reads:
            from ..tiers import READS, rows_for
            names = {r.name for r in rows_for(self.task)}
            for name, read in self.reads.items():
                if name not in names or read not in READS:
                    raise ValueError(f"reads: {name!r} -> {read!r}: not an identification row of {self.task} "
                                     f"and one of {', '.join(READS)}")
        if (self.hard is not None or self.reads) and not self.identify:
            raise ValueError("hard, reads: the hard constraints and reads of an identification search (identify = true)")
        if self.difficulty is None:
            declared_criteria(self.task)  # ValueError: the task declares none
        elif not self.difficulty:
            raise ValueError("difficulty: at least one criterion (or none given: the task's)")
        return self

    @property
    def digest(self) -> str:
        d = self.model_dump(mode="json")
        for later in ("identify", "effect"):  # added later: a difficulty space keeps its digest (and its study)
            if not d[later]:
                del d[later]
        for later, default in (("difficulty", None), ("hard", None), ("reads", {}), ("min_set", MIN_SET)):  # likewise
            if d[later] == default:
                del d[later]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def criteria(self):
        from .criteria import criteria_for, effect_criteria, identification_criteria
        if self.effect:
            return effect_criteria(self.task)
        if self.difficulty is not None and not self.identify:
            return list(self.difficulty)
        if self.identify:
            return identification_criteria(self.task, self.model, self.hard, self.reads)
        return criteria_for(self.task)

    def rows(self):
        """The rows every candidate trains: those its criteria read, in declaration order."""
        return list(dict.fromkeys(c.row for c in self.criteria()))

    def distance(self, results, means: dict) -> float:
        """What the search minimises: the sum of the criteria's gaps (difficulty or identification), or
        for an effect search minus the trajectory effect (``criteria.trajectory_effect``) plus 1 per
        broken hard constraint."""
        if not self.effect:
            return sum(r.gap for r in results)
        from .criteria import trajectory_effect
        return -trajectory_effect(means) + sum(not r.ok for r in results)

    def labels(self, key: str) -> list[str]:
        """Optuna's categorical choices: each value's JSON text (lists such as prior_layers included)."""
        return [json.dumps(v) for v in self.axes[key]]

    def options(self, params: dict[str, str]) -> tuple[dict, dict]:
        """(task_options, model_options) of a candidate from its Optuna params (JSON labels)."""
        t, m = dict(self.base.get("task", {})), dict(self.base.get("model", {}))
        for key, label in params.items():
            part, _, fld = key.partition(".")
            val = json.loads(label)
            if fld == "prior_layers":
                val = tuple(val)
            (t if part == "task" else m)[fld] = val
        return t, m

    def grid_size(self) -> int:
        n = 1
        for v in self.axes.values():
            n *= len(v)
        return n


def load_space(spec: str | Path) -> SearchSpace:
    """A shipped space by name (``shipped_spaces()``) or a .toml / .json file."""
    p = Path(spec)
    if not p.exists():
        shipped = shipped_spaces()
        if str(spec) in shipped:
            p = shipped[str(spec)]
        else:
            raise SpaceError(f"search space {str(spec)!r} is neither a file nor a shipped space "
                             f"({', '.join(shipped)})")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error becomes one clear line
        raise SpaceError(f"search space {str(p)!r} cannot be parsed: {e}") from None
    try:
        return SearchSpace(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise SpaceError(f"search space {str(p)!r}: {loc}: {err['msg']}") from None


def shipped_spaces() -> dict[str, Path]:
    root = resources.files("softprior.calibration") / "spaces"
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}
