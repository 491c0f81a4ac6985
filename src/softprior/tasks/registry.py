"""The tasks' configurations (docs/DESIGN.md, "Tasks"; the generators and their options are described
in ``tasks/generators.py``), validated by pydantic. Kept apart from ``tasks/generators.py`` so that configs, run ids and
``softprior tasks`` need no torch. ``AssocRecallConfig.ceiling`` is the associative-recall Bayes
ceiling in closed form (``tasks.generators.AssocRecall.bayes_accuracy`` derives it).

**The task registry** (``TASK_SPECS``, ``register_task``, ``task_spec``) lives here too, below the
configs: one ``TaskSpec`` per task, the one place that names the tasks (docs/STUDY.md, "Your own prior
or task"). An entry carries

- ``config``: its pydantic config class (a ``TaskConfigBase`` whose ``name`` field is ``Literal[<name>]``);
  a run config's ``task`` is validated by the entry its ``name`` picks (``validate_task_config``);
- ``generator``: its ``tasks.generators.Task`` subclass (the batch generator, loss, metric "acc" or "mse", chance
  level, and ``bayes_accuracy`` where the task has a Bayes ceiling), or ``"module:Class"`` for the
  built-ins, so that configs and run ids need no torch;
- ``io``: "tokens" (the model's vocabulary is the config's ``vocab``) or "vectors" (``d_in``, one output);
- ``difficulty``: its difficulty criteria (``calibration.criteria.Criterion`` objects or their dicts);
  None for the built-ins, whose criteria are declared in ``calibration/criteria.py`` (``DIFFICULTY``);
- ``identification``: further criteria (rows a search measures beside the difficulty rows), where any;
- ``space``: its calibration search space (``calibration.space.SearchSpace`` fields as a dict, or a
  .toml / .json file); None for the built-ins, whose spaces ship in ``calibration/spaces/<name>.toml``;
- ``axes``: the config fields a search may vary (None: every field but ``name``);

(What the rest of the package asks of a task beyond its batches lives on its generator, each part with a
default a plugin may keep: ``answer_mask``, ``chance_text``, ``ceiling_text``, ``ceiling_options``,
``row_options``; ``tasks.generators.Task`` says what each is for. On the config, ``filling``: the context
filled with pairs, the length reading "pairs fill" of ``cells.length_view``; by default the config as it is.)

Adding a task is one file: a config (subclass ``TaskConfigBase``), a generator (subclass
``tasks.generators.Task``) and a ``register_task`` call, loaded with ``--plugin FILE`` (``softprior.plugins``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..registry import Registry

__all__ = ["AssocRecallConfig", "MarkovConfig", "LinearICLConfig", "TaskConfig", "UnknownTaskError",
           "TASK_CONFIGS", "task_config", "describe_tasks", "TaskConfigBase", "TaskSpec", "TASK_SPECS",
           "register_task", "task_spec", "validate_task_config"]


class UnknownTaskError(ValueError):
    pass


class TaskConfigBase(BaseModel):
    """The base of every task config: frozen, no unknown fields, and pickled by value through the
    registry (``_rebuild_task``), so a plugin task's config reaches a spawned worker process, which
    loads the plugin file to rebuild it (``softprior.plugins``)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __reduce__(self):
        return _rebuild_task, (self.name, self.model_dump(mode="json"))

    def filling(self, length: int, n_ctx: int) -> "TaskConfigBase":
        """The config whose context fills ``length`` as MQAR's does, for a model trained at ``n_ctx``
        (``cells.length_view``'s "pairs fill"): a task without pairs keeps its config (the default)."""
        return self


def _rebuild_task(name: str, data: dict):
    return task_spec(name).config.model_validate(data)


_TaskBase = TaskConfigBase


class AssocRecallConfig(_TaskBase):
    name: Literal["assoc_recall"] = "assoc_recall"
    n_pairs: int = Field(10, ge=2)
    vocab: int = Field(32, ge=5)
    n_keys: int = Field(15, ge=2, description="keys are tokens 1..n_keys (0 is PAD); layout='disjoint' only")
    layout: Literal["disjoint", "pool"] = Field(
        "disjoint", description="disjoint key/value halves, or one pool of tokens 1..vocab-1 for both")
    n_queries: int = Field(1, ge=1, description="distinct keys queried at the end of the sequence (MQAR-style)")
    loss_on: Literal["last", "queries"] = Field("last", description="loss on the final query, or on every query")
    placement: Literal["packed", "spread"] = Field(
        "packed", description="pairs adjacent, or spread over two-token slots with PAD filler between them")
    keys: Literal["distinct", "replacement"] = Field(
        "distinct", description="keys distinct in a sequence, or drawn i.i.d. from a key set of n_keys tokens")
    repeat_target: Literal["uniform", "first", "last"] = Field(
        "uniform", description="keys='replacement': the queried pair's value, or the first / last occurrence's")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data):
        """One query: loss on the queries is loss on the last, so both spell the same config (one run id);
        with distinct keys no key repeats, so every ``repeat_target`` spells the same config too."""
        if isinstance(data, dict) and data.get("n_queries", 1) == 1 and data.get("loss_on") == "queries":
            data = {**data, "loss_on": "last"}
        if isinstance(data, dict) and data.get("keys", "distinct") == "distinct" and "repeat_target" in data:
            data = {**data, "repeat_target": "uniform"}
        return data

    @model_validator(mode="after")
    def _check(self):
        distinct = self.keys == "distinct"
        if self.layout == "disjoint":
            n_values = self.vocab - 1 - self.n_keys
            if n_values < self.n_pairs or (distinct and self.n_keys < self.n_pairs):
                raise ValueError(f"n_pairs={self.n_pairs} needs vocab-1-n_keys (={n_values})"
                                 + (" and n_keys" if distinct else "") + " >= n_pairs")
        elif distinct and 2 * self.n_pairs > self.vocab - 1:
            raise ValueError(f"layout='pool' needs 2*n_pairs <= vocab-1, got n_pairs={self.n_pairs}, vocab={self.vocab}")
        elif not distinct and self.n_keys + self.n_pairs > self.vocab - 1:
            raise ValueError(f"layout='pool' with keys='replacement' needs n_keys+n_pairs <= vocab-1, got "
                             f"n_keys={self.n_keys}, n_pairs={self.n_pairs}, vocab={self.vocab}")
        if self.n_queries > self.n_pairs:
            raise ValueError(f"n_queries={self.n_queries} must be <= n_pairs={self.n_pairs}")
        return self


    def filling(self, length: int, n_ctx: int) -> "AssocRecallConfig":
        """More pairs in a longer context, as in MQAR: n_pairs x length / n_ctx, at most as many as there
        are values to draw (vocab - 1 - n_keys with keys drawn with replacement, else (vocab - 1) // 2)."""
        room = self.vocab - 1 - self.n_keys if self.keys == "replacement" else (self.vocab - 1) // 2
        return self.model_copy(update={"n_pairs": max(self.n_pairs, min(room, self.n_pairs * length // n_ctx))})

    def ceiling(self) -> float:
        """The Bayes ceiling of the final query (derivation: ``tasks.generators.AssocRecall.bayes_accuracy``):
        1 unless keys repeat and the answer is the queried pair's own value, then
        E[1/m] = (1 - (1 - 1/K)^n) K / n for K = n_keys keys and n pairs."""
        if self.keys == "distinct" or self.repeat_target != "uniform":
            return 1.0
        K, n = self.n_keys, self.n_pairs
        return (1.0 - (1.0 - 1.0 / K) ** n) * K / n


class MarkovConfig(_TaskBase):
    name: Literal["markov"] = "markov"
    p: float = Field(0.5, gt=0.0, le=1.0)
    vocab: int = Field(32, ge=4)
    loss_on: Literal["final", "determined"] = Field(
        "final", description="loss on the final prediction, or next-token loss wherever the successor is determined")
    query: Literal["distinct", "occurrence"] = Field(
        "distinct", description="final token uniform over distinct tokens with an occurrence, or over occurrences")
    answer: Literal["successor", "recent"] = Field(
        "successor", description="target: the successor s(a) shown earlier, or what followed a's most recent occurrence")


class LinearICLConfig(_TaskBase):
    name: Literal["linear_icl"] = "linear_icl"
    d: int = Field(5, ge=1)
    n_points: int | None = Field(None, ge=1, description="in-context points; None: as many as fit in the format")
    format: Literal["interleaved", "paired"] = Field(
        "interleaved", description="x and y tokens in turn, or one [x; y] token per example and the query [x; 0]")
    w_scale: Literal["unit", "inv_d"] = Field("unit", description="w ~ N(0, I) or N(0, I/d)")
    noise: float = Field(0.0, ge=0.0, description="std of Gaussian label noise")

    @property
    def d_in(self) -> int:
        """The model's input width: d (interleaved, y in the first slot of its own token) or d + 1."""
        return self.d + (self.format == "paired")

    @property
    def y_var(self) -> float:
        """E[y^2]: the zero predictor's squared error, the metric's unit."""
        return self.d * (1.0 if self.w_scale == "unit" else 1.0 / self.d) + self.noise ** 2


TaskConfig = Annotated[Union[AssocRecallConfig, MarkovConfig, LinearICLConfig], Field(discriminator="name")]


def task_config(name: str, **overrides):
    cls = task_spec(name).config
    valid = [k for k in cls.model_fields if k != "name"]
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise UnknownTaskError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                               f"for task {name}; valid options: {', '.join(valid)}")
    return cls(**overrides)


def _options(cls, cfg=None) -> str:
    """Each option of ``cls`` as name=value {choices}: the value ``cfg`` holds (a registered calibration,
    what a run uses) with the config default beside it where they differ, or the default."""
    out = []
    for name, f in cls.model_fields.items():
        if name == "name":
            continue
        choices = getattr(f.annotation, "__args__", None)
        lit = f" {{{'|'.join(map(str, choices))}}}" if choices and all(isinstance(x, str) for x in choices) else ""
        value = getattr(cfg, name) if cfg is not None else f.default
        differs = f" (default {f.default!r})" if value != f.default else ""
        out.append(f"{name}={value!r}{differs}{lit}")
    return ", ".join(out)


def describe_tasks(defaults=None) -> list[tuple[str, str]]:
    """(name, text) per task: what it is, its options (``_options``: the registered value a run uses,
    ``defaults``: task -> task options, with the config default beside it where it differs, and
    {choices}), and the Bayes ceiling of its registered default where it has a closed form."""
    rows = []
    for name, (cls, desc) in TASK_CONFIGS.items():
        cfg = cls(**((defaults or {}).get(name, {})))
        if name == "assoc_recall":
            ceil = f"ceiling of the default {cfg.ceiling():.3f} (copying a random value: {1 / cfg.n_pairs:.3f})"
        elif name == "markov":
            ceil = ("ceiling of the default 1.0 (answer='recent')" if cfg.answer == "recent" else
                    "ceiling of the default: Monte Carlo (`softprior tasks --ceilings`)")
        elif TASK_SPECS[name].plugin is not None:
            ceil = f"from plugin {TASK_SPECS[name].plugin}"
        else:
            ceil = "references: least squares, Bayes ridge, one GD step (`softprior tasks --ceilings`)"
        given = (defaults or {}).get(name)
        head = "options (the registered value a run uses; the config default beside it where it differs)" \
            if given else "options"
        rows.append((name, f"{desc}; {ceil}; {head}: {_options(cls, cfg if given else None)}"))
    return rows


# ============================================================================ the task registry
@dataclass(frozen=True)
class TaskSpec:
    """One task's entry (module docstring)."""
    name: str
    config: type
    generator: Any  # a tasks.Task subclass, or "module:Class"
    description: str
    io: Literal["tokens", "vectors"] = "tokens"
    difficulty: tuple | None = None
    identification: tuple = ()
    space: dict | str | None = None
    axes: tuple[str, ...] | None = None
    plugin: str | None = None  # the file that registered it (None: built in)

    def task_class(self) -> type:
        """The generator class (imported on first use for the built-ins)."""
        if isinstance(self.generator, str):
            mod, _, attr = self.generator.partition(":")
            return getattr(importlib.import_module(mod), attr)
        return self.generator

    @property
    def search_axes(self) -> tuple[str, ...]:
        """The config fields a calibration search may vary."""
        return self.axes if self.axes is not None else tuple(k for k in self.config.model_fields if k != "name")


TASK_SPECS: Registry[TaskSpec] = Registry("task", UnknownTaskError, describe=lambda e: e.description)


def register_task(name: str, *, config: type, generator, description: str, io: str = "tokens",
                  difficulty=None, identification=(), space=None, axes=None,
                  overwrite: bool = False) -> TaskSpec:
    """Register a task (module docstring). Refuses a config class that is not a ``TaskConfigBase``
    (its instances must reach worker processes) or whose ``name`` does not default to ``name``."""
    from ..plugins import current_plugin
    if not (isinstance(config, type) and issubclass(config, TaskConfigBase)):
        raise TypeError(f"task {name!r}: config must subclass softprior.tasks.registry.TaskConfigBase")
    field = config.model_fields.get("name")
    if field is None or field.default != name:
        raise ValueError(f"task {name!r}: its config's 'name' field must default to {name!r} (Literal[{name!r}])")
    if io not in ("tokens", "vectors"):
        raise ValueError(f"task {name!r}: io must be 'tokens' or 'vectors', got {io!r}")
    if io == "tokens" and "vocab" not in config.model_fields:
        raise ValueError(f"task {name!r}: a token task's config needs a 'vocab' field (the model's vocabulary)")
    spec = TaskSpec(name, config, generator, description, io, None if difficulty is None else tuple(difficulty),
                    tuple(identification), space, None if axes is None else tuple(axes), current_plugin())
    return TASK_SPECS.register(name, spec, overwrite=overwrite)


def task_spec(name: str) -> TaskSpec:
    """The entry of task ``name``. A name not registered in this process is looked for in the plugin
    files it was started with (``plugins.load_noted_plugins``: a worker process) before
    ``UnknownTaskError``."""
    if name not in TASK_SPECS:
        from ..plugins import load_noted_plugins
        load_noted_plugins()
    return TASK_SPECS[name]


def validate_task_config(value):
    """A run config's ``task``: a registered task's config instance as is; a dict by its ``name``."""
    if isinstance(value, dict):
        name = value.get("name")
        if not isinstance(name, str):
            raise ValueError("a task needs a 'name' (a registered task)")
        try:
            spec = task_spec(name)
        except UnknownTaskError as e:
            raise ValueError(str(e)) from None
        return spec.config.model_validate(value)
    name = getattr(value, "name", None)
    if isinstance(name, str) and name in TASK_SPECS and isinstance(value, TASK_SPECS[name].config):
        return value
    raise ValueError(f"not a registered task's config: {type(value).__name__} (softprior.tasks.registry.register_task)")


class _ConfigView(Mapping):
    """``TASK_CONFIGS``: name -> (config class, description), read from the registry (plugins included)."""

    def __getitem__(self, name):
        spec = TASK_SPECS[name]
        return spec.config, spec.description

    def __iter__(self):
        return iter(TASK_SPECS)

    def __len__(self):
        return len(TASK_SPECS)

    def __contains__(self, name):
        return name in TASK_SPECS


TASK_CONFIGS = _ConfigView()

register_task("assoc_recall", config=AssocRecallConfig, generator="softprior.tasks.generators:AssocRecall",
              description="key/value pairs then a query key; predict its value (acc)")
register_task("markov", config=MarkovConfig, generator="softprior.tasks.generators:Markov",
              description="Markov induction: per-sequence successor map, repeat prob p (acc)")
register_task("linear_icl", config=LinearICLConfig, generator="softprior.tasks.generators:LinearICL", io="vectors",
              description="in-context linear regression, Garg et al. 2022 (query MSE / E[y^2])")
