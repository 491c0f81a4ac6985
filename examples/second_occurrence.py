"""A task that is not in the paper: copy the token that followed the *second-most-recent* earlier
occurrence of the final token.

    x_0 ... x_{T-2} a   ->   the token after the second-to-last occurrence of a in x_0 .. x_{T-3}

Tokens are uniform over 1..vocab-1; the final token a is planted at two more positions (so it occurs
at least twice with a follower). Plain induction (the follower of the most recent occurrence) is the
wrong answer unless both followers agree; the position prior has to help the model count back one
occurrence further. The answer is a function of the context, so the Bayes ceiling is 1.0. The chance
level is the best order-free guess (Monte Carlo, as ``tasks.generators.Markov.chance_at``): a uniform pick among
the distinct tokens in the context, or its most frequent token, whichever scores more.

    softprior study --plugin examples/second_occurrence.py --task second_occurrence --prior soft --quick

The file registers the task with its search space (the vocabulary); it states no difficulty criteria,
so a study uses its defaults (the prior-on path learns, the no-prior path does not).
"""

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from softprior.tasks.registry import TaskConfigBase, register_task
from softprior.tasks.generators import Batch, Task


class SecondOccurrenceConfig(TaskConfigBase):
    name: Literal["second_occurrence"] = "second_occurrence"
    vocab: int = Field(16, ge=4, description="tokens 1..vocab-1 (0 unused)")


class SecondOccurrence(Task):
    metric = "acc"
    input_kind = "tokens"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._chances: dict[int, float] = {}

    @property
    def vocab(self) -> int:
        return self.cfg.vocab

    def min_length(self) -> int:
        return 5

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        B, T, V = batch_size, length, self.cfg.vocab
        if T < self.min_length():
            raise ValueError(f"second_occurrence needs length >= {self.min_length()}, got {T}")
        x = torch.randint(1, V, (B, T), generator=generator)
        a = torch.randint(1, V, (B,), generator=generator)
        two = torch.rand(B, T - 2, generator=generator).argsort(-1)[:, :2]  # two positions with a follower
        x.scatter_(1, two, a[:, None].expand(B, 2))
        x[:, -1] = a
        target = x.gather(1, (self.second_position(x) + 1)[:, None])[:, 0]
        return Batch(x, target)

    @staticmethod
    def second_position(x: torch.Tensor) -> torch.Tensor:
        """[B]: the second-most-recent position t <= T-3 holding the final token."""
        T = x.shape[1]
        occ = x[:, : T - 2] == x[:, -1:]
        from_end = occ.flip(1).cumsum(1).flip(1)  # occurrences at positions >= t
        return torch.where(occ & (from_end == 2), torch.arange(T - 2), -1).amax(1)

    def answer_mask(self, batch) -> torch.Tensor:
        """The context position of the answer (the mechanism trace's successor-value mass)."""
        x = batch.inputs
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask.scatter_(1, (self.second_position(x) + 1)[:, None], True)
        return mask

    def bayes_accuracy(self, n: int = 0, seed: int = 0) -> tuple[float, float]:
        """1.0, exactly: the answer is read off the context."""
        return 1.0, 0.0

    def chance_at(self, length: int) -> float:
        if length not in self._chances:
            b = self.sample(8192, length, torch.Generator().manual_seed(0))
            counts = F.one_hot(b.inputs[:, :-1], self.cfg.vocab).sum(1)
            guess_seen = (1.0 / (counts > 0).sum(1).float()).mean()
            most_frequent = (counts.argmax(1) == b.targets).float().mean()
            self._chances[length] = float(max(guess_seen, most_frequent))
        return self._chances[length]

    @property
    def chance(self) -> float:
        return self.chance_at(32)


register_task("second_occurrence", config=SecondOccurrenceConfig, generator=SecondOccurrence,
              description="copy the token after the second-most-recent earlier occurrence of the final token (acc)",
              space={"task": "second_occurrence", "sampler": "grid", "seeds": 3, "first_seeds": 1,
                     "axes": {"task.vocab": [16, 24, 32], "model.prior_scale": [1.0, 2.0]}})
