"""Run configuration: everything that determines a run's numbers, hashed into its run id.

Training defaults follow the paper's protocol (docs/DESIGN.md, "Training"): AdamW, lr 1e-3, weight decay
0.01, gradient clipping at norm 1.0 (per run), batch 64, fresh batches each step from the run's seeded
generator, 512 validation examples from a fixed validation seed, 3,600 steps.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from .model.config import ModelConfig, model_preset
from .paths import PathConfig, get_path
from .preregistration import LATER_DEFAULTS, default_options, without_later_defaults
from .tasks.registry import task_config, task_spec, validate_task_config

__all__ = ["RunConfig", "make_run_config", "config_hash", "validation_message", "NON_SEMANTIC_FIELDS"]

# fields that do not change a run's numbers, so they are left out of its hash
NON_SEMANTIC_FIELDS = {"checkpoint_every", "label"}


def config_hash(canonical: dict) -> str:
    """A run id: the first 16 hex digits of the SHA-256 of a canonical config (``RunConfig.canonical``)
    as sorted, compact JSON. ``store.integrity`` checks stored configs against their run ids with it."""
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def validation_message(e: Exception) -> str:
    """One line saying why a configuration was refused, for the CLI and the calibration search alike:
    pydantic's errors as "field: message (got input)", the field as typed (a name that is no identifier,
    such as an empty key, in quotes), without pydantic's "Value error, " prefix or documentation link;
    a check on the whole model names its fields in its own message. Any other error as it reads, its
    whitespace (newlines included) collapsed."""
    errs = e.errors() if callable(getattr(e, "errors", None)) else None
    if not errs:
        return " ".join(str(e).split())
    parts = []
    for err in errs:
        loc = ".".join(str(x) if isinstance(x, int) or str(x).isidentifier() else repr(str(x))
                       for x in err.get("loc", ()))
        msg = " ".join(str(err.get("msg", "")).removeprefix("Value error, ").split())
        got = f" (got {err['input']!r})" if loc and "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{loc}: {msg}{got}" if loc else msg)
    return "; ".join(parts)


class RunConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    task: Annotated[Any, BeforeValidator(validate_task_config)]  # a registered task's config (tasks.registry)
    model: ModelConfig
    path: PathConfig
    seed: int = Field(0, ge=0)
    steps: int = Field(3600, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm per run; None disables")
    eval_every: int = Field(150, ge=1)
    n_val: int = Field(512, ge=1)
    val_seed: int = Field(1_000_003, ge=0, description="fixed validation seed, shared by all runs")
    checkpoint_every: int = Field(0, ge=0, description="steps between resumable checkpoints (0: never)")
    snapshot_every: int = Field(0, ge=0, description="keep the weights every N steps (and at step 0) for "
                                "mechanism traces; 0: never")
    label: str = Field("", description="free text, not hashed")

    @model_validator(mode="after")
    def _check(self):
        t, m = self.task, self.model
        if task_spec(t.name).io == "vectors":
            if m.d_in != t.d_in or m.d_out != 1:
                raise ValueError(f"model.d_in must be {t.d_in} and model.d_out 1 for {t.name}")
            fit = m.n_ctx - 1 if getattr(t, "format", None) == "paired" else (m.n_ctx - 1) // 2
            if getattr(t, "n_points", None) is not None and t.n_points > fit:
                raise ValueError(f"task.n_points={t.n_points} does not fit in the context of {m.n_ctx} tokens "
                                 f"(at most {fit} in the {t.format} format)")
        elif m.d_in is not None or m.vocab != t.vocab:
            raise ValueError(f"model.vocab must equal task.vocab={t.vocab} and d_in be None for {t.name}")
        return self

    def validation_batch(self, task=None, n: int | None = None, length: int | None = None):
        """The fixed validation set (docs/DESIGN.md, "Training"): ``n`` (default ``n_val``) examples at ``length``
        (default the training context) from ``val_seed``, the same for every run that shares them."""
        import torch

        from .tasks.generators import make_task
        task = task if task is not None else make_task(self.task)
        return task.sample(n or self.n_val, length or self.model.n_ctx, torch.Generator().manual_seed(self.val_seed))

    @property
    def total_steps(self) -> int:
        return self.path.steps or self.steps

    def canonical(self) -> dict[str, Any]:
        """The hashed content: every field that changes the numbers (not labels or descriptions)."""
        d = self.model_dump(mode="json", exclude=NON_SEMANTIC_FIELDS)
        for part, defaults in LATER_DEFAULTS.items():
            d[part] = without_later_defaults(d[part], defaults)
        p = d["path"]
        while p is not None:  # a path's help text is not part of its identity
            p.pop("description", None)
            p = p.get("parent")
        return d

    @property
    def run_id(self) -> str:
        return config_hash(self.canonical())

    def parent(self) -> "RunConfig | None":
        """The run a derived path (post hoc continuation) starts from."""
        if self.path.parent is None:
            return None
        return self.model_copy(update={"path": self.path.parent,
                                       "steps": self.path.parent_steps or self.steps})


def make_run_config(task: str | Any = "assoc_recall", path: str | PathConfig = "unforced", seed: int = 0,
                    model: str | ModelConfig = "base", steps: int | None = None,
                    task_options: dict | None = None, model_options: dict | None = None,
                    baseline: str | None = None, calibrated: bool = True, **overrides) -> RunConfig:
    """Build a RunConfig from names (as the CLI does) plus overrides. ``baseline`` (one of
    ``softprior.model.baselines.BASELINES``) sets the model's positional scheme and the path.
    ``calibrated``: start from the task's pre-registered calibration (``preregistration.default_options``, from
    ``calibration/registered``; True) or from the plain config defaults (False: the first version's task
    and initialisation)."""
    if isinstance(task, str) and calibrated:  # the task's pre-registered calibration is the default
        t_def, m_def = default_options(task)
        task_options = {**t_def, **(task_options or {})}
        model_options = {**m_def, **(model_options or {})}
    tcfg = task_config(task, **(task_options or {})) if isinstance(task, str) else task
    pcfg = get_path(path) if isinstance(path, str) else path
    if baseline is not None:
        from .model.baselines import resolve_baseline
        extra, pcfg = resolve_baseline(baseline)
        model_options = {**(model_options or {}), **extra}
    io = dict(d_in=tcfg.d_in, d_out=1) if task_spec(tcfg.name).io == "vectors" else dict(vocab=tcfg.vocab)
    if isinstance(model, str):
        mcfg = model_preset(model, **{**io, **(model_options or {})})
    else:
        mcfg = model.model_copy(update=io)
    if steps is not None:
        overrides["steps"] = steps
    return RunConfig(task=tcfg, model=mcfg, path=pcfg, seed=seed, **overrides)
