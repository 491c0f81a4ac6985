"""Gate schedules: the value of a gate as a function of the training step.

The paper's training paths (arXiv 2609.10287) as data: every path is a schedule per gate. A schedule is plain data
(a pydantic model) so it can live in a JSON/TOML config file, be hashed into a run id and be
evaluated vectorised over all steps for plotting.

Fade shapes. Let u = clip((step - start_step) / width, 0, 1) be the progress through the fade and
g = start_value + (end_value - start_value) * f(u). With start > end (a fade to zero):

- linear:   f(u) = u
- cosine:   f(u) = (1 - cos(pi u)) / 2              (slow, fast, slow)
- convex:   f(u) = 1 - (1 - u)^2                    (g is a convex curve: drops fast, then slowly)
- concave:  f(u) = u^2                              (g is a concave curve: drops slowly, then fast)
- two_step: f(u) = 0 for u < 1/2, 1/2 for 1/2 <= u < 1, 1 at u = 1  (two equal drops)

All shapes share start value, end value, start step and width, as the paper requires.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Constant", "Linear", "Fade", "HardSwitch", "Schedule", "FADE_SHAPES", "gate_value"]

FADE_SHAPES = ("linear", "cosine", "convex", "concave", "two_step")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Constant(_Frozen):
    """g(step) = value."""

    kind: Literal["constant"] = "constant"
    value: float = Field(ge=0.0, le=1.0)

    def __call__(self, step: int, total_steps: int) -> float:
        return self.value

    @property
    def settles_at(self) -> int:
        return 0

    def describe(self) -> str:
        return f"{self.value:g} throughout"


class _Ramp(_Frozen):
    """A schedule from start_value to end_value: g = start_value + (end_value - start_value) * f, f in [0, 1]."""

    start_value: float = Field(0.5, ge=0.0, le=1.0)
    end_value: float = Field(0.0, ge=0.0, le=1.0)

    def _at(self, f: float) -> float:
        return self.start_value + (self.end_value - self.start_value) * f


class Linear(_Ramp):
    """Linear from start_value at start_step to end_value at end_step (default: the final step)."""

    kind: Literal["linear"] = "linear"
    start_step: int = Field(0, ge=0)
    end_step: int | None = Field(None, ge=1, description="None means the run's final step")

    def __call__(self, step: int, total_steps: int) -> float:
        end = self.end_step if self.end_step is not None else max(total_steps - 1, 1)
        if step <= self.start_step:
            return self.start_value
        if step >= end:
            return self.end_value
        return self._at((step - self.start_step) / (end - self.start_step))

    @property
    def settles_at(self) -> int | None:
        return self.end_step  # None: the run's final step, whatever its budget

    def describe(self) -> str:
        end = "the final step" if self.end_step is None else f"step {self.end_step}"
        return f"linear {self.start_value:g} -> {self.end_value:g} from step {self.start_step} to {end}"


class Fade(_Ramp):
    """Hold start_value until start_step, fade to end_value over `width` steps, then hold."""

    kind: Literal["fade"] = "fade"
    start_step: int = Field(600, ge=0)
    width: int = Field(450, ge=1)
    shape: Literal["linear", "cosine", "convex", "concave", "two_step"] = "linear"

    def __call__(self, step: int, total_steps: int) -> float:
        u = min(max((step - self.start_step) / self.width, 0.0), 1.0)
        if self.shape == "linear":
            f = u
        elif self.shape == "cosine":
            f = (1.0 - math.cos(math.pi * u)) / 2.0
        elif self.shape == "convex":
            f = 1.0 - (1.0 - u) ** 2
        elif self.shape == "concave":
            f = u * u
        else:  # two_step
            f = 0.0 if u < 0.5 else (0.5 if u < 1.0 else 1.0)
        return self._at(f)

    @property
    def end_step(self) -> int:
        return self.start_step + self.width

    @property
    def settles_at(self) -> int:
        return self.end_step

    def describe(self) -> str:
        return f"{self.start_value:g} until step {self.start_step}, {self.shape} fade to {self.end_value:g} by step {self.end_step}"


class HardSwitch(_Frozen):
    """g = before for step < at, then after."""

    kind: Literal["hard_switch"] = "hard_switch"
    before: float = Field(0.5, ge=0.0, le=1.0)
    after: float = Field(0.0, ge=0.0, le=1.0)
    at: int = Field(ge=0)

    def __call__(self, step: int, total_steps: int) -> float:
        return self.before if step < self.at else self.after

    @property
    def settles_at(self) -> int:
        return self.at

    def describe(self) -> str:
        return f"{self.before:g} until step {self.at}, then {self.after:g}"


Schedule = Annotated[Union[Constant, Linear, Fade, HardSwitch], Field(discriminator="kind")]


def gate_value(schedule: Constant | Linear | Fade | HardSwitch, step: int, total_steps: int) -> float:
    """Evaluate a schedule at one step (a convenience for callers that hold a Schedule union)."""
    return float(schedule(step, total_steps))
