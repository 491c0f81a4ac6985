"""The tasks' configurations (docs/DESIGN.md, "Tasks"; the generators and their options are described
in ``tasks.py``), validated by pydantic. Kept apart from ``tasks.py`` so that configs, run ids and
``softprior tasks`` need no torch. ``AssocRecallConfig.ceiling`` is the associative-recall Bayes
ceiling in closed form (``tasks.AssocRecall.bayes_accuracy`` derives it).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["AssocRecallConfig", "MarkovConfig", "LinearICLConfig", "TaskConfig", "UnknownTaskError",
           "TASK_CONFIGS", "task_config", "describe_tasks"]


class UnknownTaskError(ValueError):
    pass


class _TaskBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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


    def ceiling(self) -> float:
        """The Bayes ceiling of the final query (derivation: ``tasks.AssocRecall.bayes_accuracy``):
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


TASK_CONFIGS = {"assoc_recall": (AssocRecallConfig, "key/value pairs then a query key; predict its value (acc)"),
                "markov": (MarkovConfig, "Markov induction: per-sequence successor map, repeat prob p (acc)"),
                "linear_icl": (LinearICLConfig, "in-context linear regression, Garg et al. 2022 (query MSE / E[y^2])")}


def task_config(name: str, **overrides):
    if name not in TASK_CONFIGS:
        raise UnknownTaskError(f"unknown task {name!r}; allowed: {', '.join(TASK_CONFIGS)}")
    cls = TASK_CONFIGS[name][0]
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
        else:
            ceil = "references: least squares, Bayes ridge, one GD step (`softprior tasks --ceilings`)"
        given = (defaults or {}).get(name)
        head = "options (the registered value a run uses; the config default beside it where it differs)" \
            if given else "options"
        rows.append((name, f"{desc}; {ceil}; {head}: {_options(cls, cfg if given else None)}"))
    return rows
