"""The paper's three tasks (Sec. 4), each a seeded batch generator with a loss, a metric and a
stated chance level. Generators take an explicit ``torch.Generator``; no global random state.
Every task, these three and any a plugin registers, has one entry in the task registry
(``tasks.registry.TASK_SPECS``, also ``TASKS`` here); ``make_task`` builds a config's generator from it.

Associative recall (our own generator, in the spirit of zoology's MQAR):
    [PAD ... PAD, k1 v1 k2 v2 ... kn vn, q]  ->  target v_i where k_i = q.
    Token 0 is PAD; keys come from [1, 1 + n_keys), values from the top n_values tokens, so keys and
    values are disjoint. Keys are distinct in a sequence and so are values: with values drawn with
    replacement "predict the most frequent value in context" beats chance (docs/DESIGN.md, "What the
    first prototype showed").
    Sequences are left-padded to the requested length, so the same task runs at length 120.
    Loss and accuracy on the final (query) position only. Chance = 1 / n_pairs.
    Options (calibration axes, all validated config fields; defaults are the form above):
    - ``layout``: "disjoint" key/value halves (above) or "pool": keys and values drawn together from
      one pool of tokens 1..V-1, all 2n distinct, so a token's role is only known from its position.
    - ``n_queries``: Q >= 1 distinct keys queried at the end, [..pairs.., q_1 ... q_Q], the target at
      q_i being its value (zoology's MQAR asks several queries per sequence; the answers are not
      written into the sequence here, so no query can copy an earlier answer).
    - ``loss_on``: "last" (the final query only) or "queries" (every query position, averaged).
      The metric is always the final query's accuracy, so tables stay comparable.
    - ``placement``: "packed" (pairs adjacent, left padding) or "spread": the n pairs occupy n of the
      (T - Q) // 2 two-token slots before the queries, chosen uniformly, PAD (0) filling the rest.
    - ``keys``: "distinct" (above) or "replacement": the paper says only "pairs of keys and values ...
      the value associated with a query key" (Sec. 4). With replacement each sequence draws a key set
      of ``n_keys`` tokens (disjoint: tokens 1..n_keys; pool: ``n_keys`` tokens of the pool, the values
      being n more distinct pool tokens) and the n keys i.i.d. uniform from it, so a queried key may
      occur m > 1 times with m different values. The queried pair is uniform over the n pairs.
    - ``repeat_target`` (keys="replacement" only): the answer when the queried key repeats: "uniform",
      the queried pair's own value (a uniformly chosen occurrence: ambiguous, the Bayes ceiling is
      E[1/m] = (1 - (1 - 1/K)^n) K / n for K = n_keys, see ``bayes_accuracy``), or the value of the
      "first" / "last" occurrence (learnable: ceiling 1.0). The search can so tell ambiguity apart
      from more keys. Copying a random context value scores 1/n either way.

Markov induction with repeat probability p:
    each sequence draws its own successor map s (a random bijection of V); x_0 is uniform;
    x_{t+1} = s(x_t) with probability p, else uniform. The final token a is drawn uniformly from the
    distinct tokens that occurred earlier directly followed by s(a); the target is s(a).
    Chance is the best order-free heuristic (see ``Markov.chance``), since the target always occurs
    in context and so guessing among seen tokens beats 1/V.
    Options: ``loss_on`` "final" (the final prediction only, as above) or "determined": next-token
    loss at every position t whose successor is determined by the context, i.e. x_{t+1} = s(x_t) and
    x_t already occurred earlier directly followed by s(x_t) (the in-context Markov-chain objective
    restricted to predictable targets), plus the final position; the metric stays the final
    prediction. ``query``: "distinct" (the final token is uniform over the distinct tokens with an
    occurrence, above) or "occurrence" (uniform over the occurrences, which favours frequent tokens;
    the order-free chance level, measured, accounts for it).
    ``answer``: "successor" (above: the final token is one that occurred earlier directly followed by
    s(a), the target s(a); if a also occurred followed by a random token the context is ambiguous, and
    the Bayes ceiling is below 1, see ``bayes_accuracy``) or "recent", the classic induction rule: the
    final token a is any token with an earlier occurrence that has a follower, and the target is the
    token that followed a's most recent occurrence (ceiling 1.0; a low p still makes the rule harder
    to learn, since fewer transitions repeat). ``query`` then picks a among the distinct tokens or the
    occurrences, as above.

Linear regression ICL (Garg et al. 2022; dtsip/in-context-learning):
    w ~ N(0, I_d), x_k ~ N(0, I_d), y_k = w . x_k; the input is x_1, [y_1, 0..0], ..., x_n, [y_n, 0..0],
    x_query (left-padded with zero vectors to the requested length). The model reads in with a linear
    layer and reads out a scalar at every x position; the loss is the mean squared error over all x
    positions (Garg's objective). The metric is the query's squared error divided by d, so the
    zero predictor scores 1.0 (its "chance"); least squares is exact (0) once n >= d.
    Options:
    - ``n_points``: the number of in-context points (None: as many as fit: (T - 1) // 2 interleaved,
      T - 1 paired).
    - ``format``: "interleaved" (above) or "paired": one token per example, [x_k ; y_k] (d + 1
      inputs), the query [x_q ; 0], the prediction read (and the loss taken) at the query only. The
      paper does not give its format; with one token per example one attention layer can compute
      sum_k y_k x_k . x_q, one step of gradient descent (von Oswald et al. 2023).
    - ``w_scale``: "unit", w ~ N(0, I_d), or "inv_d", w ~ N(0, I_d / d); ``noise``: the std of Gaussian
      label noise on every y (the query's included). The metric divides the query's squared error by
      E[y^2] = d s + noise^2 (s = 1 or 1/d), so the zero predictor scores 1.0 in every variant (for
      the default, E[y^2] = d as before).
    ``reference_mse`` gives least squares, the Bayes posterior mean (ridge with lambda = noise^2 / s)
    and one step of gradient descent from w = 0 with the best scalar step size, on the same metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
import math

import torch
import torch.nn.functional as F

from .registry import TASK_SPECS, LinearICLConfig, MarkovConfig, task_spec

__all__ = ["Batch", "Task", "make_task", "TASKS", "list_tasks"]


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T] long tokens, or [B, T, d] float vectors
    targets: torch.Tensor  # [B] long (token tasks) or [B, P] float (linear ICL, one per x position)




class Task:
    """Common interface. ``metric`` is 'acc' (higher is better) or 'mse' (lower is better).

    What the rest of the package asks of a task beyond its batches, loss and metric lives here too, each
    with a default, so that a plugin task may leave it out: ``answer_mask`` (the context positions that
    hold the answer: the mechanism trace's successor-value mass; by default none, and the trace leaves
    that measure out), ``chance_text`` (the figures' chance line in words; by default none),
    ``ceiling_text`` and ``ceiling_options`` (what ``softprior tasks --ceilings`` prints: the Bayes
    ceiling where the task defines ``bayes_accuracy``) and ``row_options`` (the task options of the one
    row that stands for a configuration, the calibration's fade point: ``calibration.robustness.fade_row``).
    ``bayes_accuracy`` and ``reference_mse`` have no default: a task without them has no ceiling and no
    references, and the callers check for them."""

    metric: str
    input_kind: str  # "tokens" or "vectors"
    # the task options ``softprior tasks --ceilings`` measures a registered default at, one line each
    ceiling_options: tuple[dict, ...] = ({},)
    # the task options of the row that stands for a configuration where the paper reads the task in
    # several settings (``calibration.robustness.fade_row``)
    row_options: dict = {}

    def __init__(self, cfg):
        self.cfg = cfg

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def loss_positions(self, length: int) -> torch.Tensor:
        """Positions whose outputs carry loss (the model may compute only these in its last layer)."""
        return torch.tensor([length - 1])

    def min_length(self) -> int:
        raise NotImplementedError

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """out: [B, P, V] logits at ``loss_positions``."""
        return F.cross_entropy(out[:, -1], targets)

    def score(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The metric over a batch (a 0-d tensor): accuracy or query MSE."""
        return (out[:, -1].argmax(-1) == targets).float().mean()

    @property
    def chance(self) -> float:
        """The chance level at the base length 32."""
        raise NotImplementedError

    def chance_at(self, length: int) -> float:
        """The chance level for sequences of ``length`` (the same at every length unless overridden)."""
        return self.chance

    def answer_mask(self, batch: Batch) -> torch.Tensor:
        """[B, T] bool: the context positions that hold the correct answer token (``analysis.mechanism.
        answer_mask``). ValueError where the task has no answer position (the default; linear ICL)."""
        raise ValueError(f"successor-value mass needs a task whose generator defines answer_mask(batch) "
                         f"(the positions holding the answer); {type(self).__name__} does not")

    @classmethod
    def chance_text(cls, configs) -> str | None:
        """The chance line of a figure of this task's ``configs`` in words (None: not said; the default)."""
        return None

    def ceiling_text(self) -> str:
        """What ``softprior tasks --ceilings`` says of this config: its Bayes ceiling (``bayes_accuracy``),
        with the standard error where that is a Monte Carlo estimate."""
        if not hasattr(self, "bayes_accuracy"):
            return "no Bayes ceiling (the task defines no bayes_accuracy)"
        acc, se = self.bayes_accuracy()
        return f"Bayes ceiling {acc:.3f}" + (f" ± {se:.3f}" if se else "")


def _answer_in_context(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (an ``answer_mask``), refused where some sequence does not hold its answer in context."""
    if not mask.any(1).all():
        raise ValueError("some sequences do not contain the answer token in context")
    return mask


class _TokenTask(Task):
    """Token in, next-token logits out; accuracy on the final position."""
    metric = "acc"
    input_kind = "tokens"

    @property
    def vocab(self) -> int:
        return self.cfg.vocab


class AssocRecall(_TokenTask):
    def min_length(self) -> int:
        return 2 * self.cfg.n_pairs + self.cfg.n_queries

    @property
    def chance(self) -> float:
        return 1.0 / self.cfg.n_pairs

    def loss_positions(self, length: int) -> torch.Tensor:
        c = self.cfg
        if c.loss_on == "queries":
            return torch.arange(length - c.n_queries, length)
        return torch.tensor([length - 1])

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        c = self.cfg
        if length < self.min_length():
            raise ValueError(f"assoc_recall with n_pairs={c.n_pairs}, n_queries={c.n_queries} needs length >= "
                             f"{self.min_length()}, got {length}")
        n, B, Q = c.n_pairs, batch_size, c.n_queries
        if c.keys == "replacement":
            keys, vals = self._keys_with_replacement(B, generator)
        elif c.layout == "disjoint":
            n_values = c.vocab - 1 - c.n_keys
            # distinct keys / values: the first n of a random permutation (argsort of uniform noise)
            keys = torch.rand(B, c.n_keys, generator=generator).argsort(-1)[:, :n] + 1
            vals = torch.rand(B, n_values, generator=generator).argsort(-1)[:, :n] + (c.vocab - n_values)
        else:  # one pool: 2n distinct tokens, the first n keys, the next n values
            perm = torch.rand(B, c.vocab - 1, generator=generator).argsort(-1)[:, :2 * n] + 1
            keys, vals = perm[:, :n], perm[:, n:]
        if Q == 1:
            which = torch.randint(0, n, (B,), generator=generator)[:, None]
        else:
            which = torch.rand(B, n, generator=generator).argsort(-1)[:, :Q]  # Q distinct queried pairs
        answer = vals.gather(1, which if c.keys == "distinct" else self._answer_pair(keys, which))
        seq = torch.zeros(B, length, dtype=torch.long)
        if c.placement == "packed":
            start = length - (2 * n + Q)
            seq[:, start:start + 2 * n:2] = keys
            seq[:, start + 1:start + 2 * n:2] = vals
        else:  # n of the (length - Q) // 2 two-token slots before the queries, in order
            n_slots = (length - Q) // 2
            slots = torch.rand(B, n_slots, generator=generator).argsort(-1)[:, :n].sort(-1).values
            first = (length - Q) - 2 * n_slots + 2 * slots  # [B, n] key positions
            seq.scatter_(1, first, keys)
            seq.scatter_(1, first + 1, vals)
        seq[:, length - Q:] = keys.gather(1, which)
        return Batch(seq, answer[:, 0] if Q == 1 else answer)

    def _keys_with_replacement(self, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """keys="replacement": a key set of n_keys tokens per sequence, n keys i.i.d. from it, n distinct
        values (disjoint: keys 1..n_keys, values from the top tokens; pool: n_keys + n distinct pool tokens)."""
        c, n = self.cfg, self.cfg.n_pairs
        if c.layout == "disjoint":
            n_values = c.vocab - 1 - c.n_keys
            key_set = torch.arange(1, c.n_keys + 1).expand(B, c.n_keys)
            vals = torch.rand(B, n_values, generator=generator).argsort(-1)[:, :n] + (c.vocab - n_values)
        else:
            perm = torch.rand(B, c.vocab - 1, generator=generator).argsort(-1)[:, :c.n_keys + n] + 1
            key_set, vals = perm[:, :c.n_keys], perm[:, c.n_keys:]
        keys = key_set.gather(1, torch.randint(0, c.n_keys, (B, n), generator=generator))
        return keys, vals

    def _answer_pair(self, keys: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """The pair whose value answers each queried pair ``which`` [B, Q]: itself ("uniform"), or the
        first / last pair with the same key (``repeat_target``)."""
        rule = self.cfg.repeat_target
        if rule == "uniform":
            return which
        n = keys.shape[1]
        same = keys[:, None, :] == keys.gather(1, which)[:, :, None]  # [B, Q, n]
        idx = torch.arange(n).expand_as(same)
        if rule == "first":
            return torch.where(same, idx, n).amin(-1)
        return torch.where(same, idx, -1).amax(-1)

    def bayes_accuracy(self, n: int = 0, seed: int = 0) -> tuple[float, float]:
        """The generator's Bayes ceiling for the final query and its standard error (0: exact).

        Distinct keys, or a "first" / "last" rule: the answer is a function of the context, 1.0.
        Keys with replacement and the "uniform" rule: if the queried key occurs m times (with m distinct
        values) each is the answer with probability 1/m, so the best guess scores 1/m. With the
        queried pair uniform, the other n - 1 keys hit its key independently with probability 1/K, so
        m - 1 ~ Binomial(n - 1, 1/K) and E[1/m] = sum_j C(n-1, j) K^-j (1-1/K)^(n-1-j) / (j+1)
        = (1 - (1 - 1/K)^n) K / n (the binomial identity sum C(n-1,j)/(j+1) a^j b^(n-1-j) =
        ((a+b)^n - b^n) / (n a)). Several distinct queried pairs (Q > 1) leave the last one uniform.
        ``n`` and ``seed`` are unused (the interface of tasks whose ceiling is Monte Carlo)."""
        return self.cfg.ceiling(), 0.0

    def heuristic_accuracy(self) -> float:
        """Copying a random value from the context: 1 / n_pairs (the values are distinct)."""
        return 1.0 / self.cfg.n_pairs

    def answer_mask(self, batch: Batch) -> torch.Tensor:
        """The position of the target value v_i in the context (exactly one: values are distinct and
        disjoint from keys; the final query position is excluded). With several queries, the final
        one's (targets [B, Q]: its last column), the answer the final position reads."""
        target = batch.targets if batch.targets.dim() == 1 else batch.targets[:, -1]
        mask = batch.inputs == target[:, None]
        mask[:, -1] = False
        return _answer_in_context(mask)

    @classmethod
    def chance_text(cls, configs) -> str | None:
        """Copying a random value of the context (1 / n_pairs, where the configs agree on n_pairs)."""
        pairs = {c.n_pairs for c in configs}
        return "chance: copy a random value\nof the context" + (f" (1/{next(iter(pairs))})" if len(pairs) == 1 else "")

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """out: [B, P, V] at ``loss_positions``; targets [B] (one query) or [B, Q]."""
        if targets.dim() == 1:
            return F.cross_entropy(out[:, -1], targets)
        if out.shape[1] == 1:  # several queries, loss on the last
            return F.cross_entropy(out[:, -1], targets[:, -1])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    def score(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        last = targets if targets.dim() == 1 else targets[:, -1]
        return (out[:, -1].argmax(-1) == last).float().mean()


class Markov(_TokenTask):
    ceiling_options = ({"p": 0.2}, {"p": 0.5}, {"p": 0.8})  # the paper's three repeat probabilities (Sec. 4.3)
    row_options = {"p": 0.5}  # the middle one

    def min_length(self) -> int:
        return 4

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        c, B, V = self.cfg, batch_size, self.cfg.vocab
        if length < 4:
            raise ValueError(f"markov needs length >= 4, got {length}")
        succ = torch.rand(B, V, generator=generator).argsort(-1)  # a random bijection per sequence
        follow = torch.rand(B, length - 1, generator=generator) < c.p
        noise = torch.randint(0, V, (B, length - 1), generator=generator)
        seq = torch.empty(B, length, dtype=torch.long)
        seq[:, 0] = noise[:, 0]
        for t in range(1, length - 1):
            nxt = succ.gather(1, seq[:, t - 1:t])[:, 0]
            seq[:, t] = torch.where(follow[:, t], nxt, noise[:, t])
        body = seq[:, : length - 1]
        if c.answer == "recent":
            return self._recent(seq, succ, generator)
        ok = body[:, 1:] == succ.gather(1, body[:, :-1])  # [B, length-2]: body[t+1] == s(body[t])
        none = ~ok.any(1)
        if none.any():  # guarantee one occurrence (rare: ~(1-p)^30)
            rows = none.nonzero()[:, 0]
            tt = torch.randint(0, length - 2, (len(rows),), generator=generator)
            seq[rows, tt + 1] = succ[rows, seq[rows, tt]]
            body = seq[:, : length - 1]
            ok = body[:, 1:] == succ.gather(1, body[:, :-1])
        if c.query == "distinct":
            # a is uniform over the *distinct* tokens with such an occurrence: picking an occurrence
            # instead favours frequent tokens and leaks the answer to a most-frequent-token heuristic
            cand = torch.zeros(B, V).scatter_add_(1, body[:, :-1], ok.float()) > 0
            a = torch.where(cand, torch.rand(B, V, generator=generator), torch.full((B, V), -1.0)).argmax(1)
        else:  # uniform over the occurrences t with body[t+1] == s(body[t])
            t = torch.where(ok, torch.rand(B, length - 2, generator=generator), torch.full((B, length - 2), -1.0)).argmax(1)
            a = body.gather(1, t[:, None])[:, 0]
        seq[:, -1] = a
        target = succ.gather(1, a[:, None])[:, 0]
        if c.loss_on == "final":
            return Batch(seq, target)
        return Batch(seq, self._determined_targets(seq, succ, target))

    def _recent(self, seq: torch.Tensor, succ: torch.Tensor, generator: torch.Generator) -> Batch:
        """answer="recent": a is drawn among the tokens at positions t <= T-3 (those with a follower in
        the context; ``query`` picks distinct tokens or occurrences), the target is the token that
        followed a's most recent such occurrence."""
        B, T, V = seq.shape[0], seq.shape[1], self.cfg.vocab
        body = seq[:, : T - 1]
        head = body[:, :-1]  # positions with a follower
        if self.cfg.query == "distinct":
            cand = torch.zeros(B, V).scatter_(1, head, 1.0) > 0
            a = torch.where(cand, torch.rand(B, V, generator=generator), torch.full((B, V), -1.0)).argmax(1)
        else:
            a = head.gather(1, torch.randint(0, T - 2, (B, 1), generator=generator))[:, 0]
        pos = torch.where(head == a[:, None], torch.arange(T - 2), -1).amax(1)
        target = body.gather(1, (pos + 1)[:, None])[:, 0]
        seq[:, -1] = a
        if self.cfg.loss_on == "final":
            return Batch(seq, target)
        return Batch(seq, self._determined_targets(seq, succ, target))

    def bayes_accuracy(self, n: int = 4000, seed: int = 0) -> tuple[float, float]:
        """The generator's Bayes ceiling at T = 32 and its standard error.

        answer="recent": the answer is read off the context, 1.0 exactly. answer="successor": the
        target s(a) is among the tokens that followed a in the context, and a follower that is not s(a)
        is uniform noise, so the best guess is the most frequent follower of a (ties broken
        uniformly); its accuracy is estimated by Monte Carlo over ``n`` sequences from ``seed``
        (a correct tie among k counts 1/k), with the standard error of that mean."""
        if self.cfg.answer == "recent":
            return 1.0, 0.0
        return _successor_ceiling(self.cfg, n, seed)

    def _successor_ceiling(self, n: int, seed: int) -> tuple[float, float]:
        b = self.sample(n, 32, torch.Generator().manual_seed(seed))
        x = b.inputs
        target = b.targets if b.targets.dim() == 1 else b.targets[:, -1]
        body = x[:, :-1]
        after_a = (body[:, :-1] == x[:, -1:])  # [n, T-2]: positions holding a with a follower
        counts = torch.zeros(n, self.cfg.vocab).scatter_add_(1, body[:, 1:], after_a.float())
        best = counts.max(1, keepdim=True).values
        top = counts == best
        score = top.gather(1, target[:, None])[:, 0].double() / top.sum(1).double()
        return float(score.mean()), float(score.std() / n ** 0.5)

    @staticmethod
    def _determined_targets(seq: torch.Tensor, succ: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """[B, T] next-token targets where the successor is determined by the context, -100 elsewhere:
        position t < T-1 carries x_{t+1} when x_{t+1} = s(x_t) and x_t occurred at some u < t with
        x_{u+1} = s(x_u) (so the pair was shown before t). The final position carries ``final``."""
        B, T = seq.shape
        nxt = succ.gather(1, seq[:, :-1])  # s(x_t) for t < T-1
        follow = seq[:, 1:] == nxt  # [B, T-1]
        # seen[b, t]: some u < t has x_u = x_t and a followed transition; shown[u] holds for u+1 <= t
        same = seq[:, :-1, None] == seq[:, None, :-1]  # [B, t, u]
        earlier = torch.ones(T - 1, T - 1, dtype=torch.bool).tril(-1)  # u < t
        seen = (same & earlier & follow[:, None, :]).any(-1)
        targets = torch.full((B, T), -100, dtype=torch.long)
        det = follow & seen
        targets[:, :-1] = torch.where(det, seq[:, 1:], targets[:, :-1])
        targets[:, -1] = final
        return targets

    def loss_positions(self, length: int) -> torch.Tensor:
        if self.cfg.loss_on == "determined":
            return torch.arange(length)
        return torch.tensor([length - 1])

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """out: [B, P, V]; targets [B] (final only) or [B, T] with -100 where not determined."""
        if targets.dim() == 1:
            return F.cross_entropy(out[:, -1], targets)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1), ignore_index=-100)

    def score(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        last = targets if targets.dim() == 1 else targets[:, -1]
        return (out[:, -1].argmax(-1) == last).float().mean()

    @cached_property
    def _chances(self) -> dict[int, float]:
        return {}

    def chance_at(self, length: int) -> float:
        """The best order-free heuristic for sequences of ``length`` (Monte Carlo, 8,192 sequences,
        fixed seed): the larger of guessing among the tokens seen and predicting the most frequent
        context token. Without an induction lookup (using the token order) a model cannot beat it.
        It depends on the length: a longer context shows more distinct tokens."""
        if length not in self._chances:
            b = self.sample(8192, length, torch.Generator().manual_seed(0))
            counts = F.one_hot(b.inputs[:, :-1], self.cfg.vocab).sum(1)  # [B, V]
            target = b.targets if b.targets.dim() == 1 else b.targets[:, -1]
            guess_seen = (1.0 / (counts > 0).sum(1).float()).mean()
            most_frequent = (counts.argmax(1) == target).float().mean()
            self._chances[length] = float(max(guess_seen, most_frequent))
        return self._chances[length]

    @property
    def chance(self) -> float:
        """``chance_at(32)``, the base length."""
        return self.chance_at(32)

    def answer_mask(self, batch: Batch) -> torch.Tensor:
        """With a = the final token and s(a) = the target, every position j <= T-2 with x_{j-1} = a and
        x_j = s(a), i.e. where the target sits right after an earlier occurrence of a that is followed by
        s(a) (the generator guarantees at least one; when there are several the successor mass sums over
        them)."""
        x, y = batch.inputs, batch.targets
        a = x[:, -1]
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[:, 1:-1] = (x[:, :-2] == a[:, None]) & (x[:, 1:-1] == y[:, None])
        return _answer_in_context(mask)

    @classmethod
    def chance_text(cls, configs) -> str | None:
        return "chance: the best guess that\nignores order (Markov.chance)"


@lru_cache(maxsize=256)
def _successor_ceiling(cfg: MarkovConfig, n: int, seed: int) -> tuple[float, float]:
    """``Markov.bayes_accuracy`` of the successor rule, computed once per (config, n, seed): it is a
    function of them alone (a seeded Monte Carlo), and the search, the reports and the robustness map
    all ask for the same configurations."""
    return Markov(cfg)._successor_ceiling(n, seed)


class LinearICL(Task):
    metric = "mse"
    input_kind = "vectors"
    chance = 1.0  # the zero predictor's normalised MSE, E[y^2] / E[y^2] = 1

    @property
    def d(self) -> int:
        return self.cfg.d

    @property
    def paired(self) -> bool:
        return self.cfg.format == "paired"

    def min_length(self) -> int:
        return 2 if self.paired else 3

    def n_points(self, length: int) -> int:
        fit = length - 1 if self.paired else (length - 1) // 2
        if self.cfg.n_points is None:
            return fit
        if self.cfg.n_points > fit:
            raise ValueError(f"linear_icl n_points={self.cfg.n_points} does not fit in length {length} "
                             f"(max {fit} in the {self.cfg.format} format)")
        return self.cfg.n_points

    def loss_positions(self, length: int) -> torch.Tensor:
        if self.paired:
            return torch.tensor([length - 1])
        n = self.n_points(length)
        start = length - (2 * n + 1)
        return torch.arange(start, length, 2)  # the n in-context x positions and the query

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        c, B = self.cfg, batch_size
        d = c.d
        n = self.n_points(length)
        if n < 1:
            raise ValueError(f"linear_icl needs length >= {self.min_length()}, got {length}")
        w = torch.randn(B, d, generator=generator)
        if c.w_scale == "inv_d":
            w = w / d ** 0.5
        x = torch.randn(B, n + 1, d, generator=generator)
        y = torch.einsum("bkd,bd->bk", x, w)
        if c.noise > 0:
            y = y + c.noise * torch.randn(B, n + 1, generator=generator)
        if self.paired:
            seq = torch.zeros(B, length, d + 1)
            start = length - (n + 1)
            seq[:, start:, :d] = x
            seq[:, start:length - 1, d] = y[:, :n]
            return Batch(seq, y[:, -1:])
        seq = torch.zeros(B, length, d)
        start = length - (2 * n + 1)
        seq[:, start::2] = x
        seq[:, start + 1::2, 0] = y[:, :n]
        return Batch(seq, y)

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out[..., 0], targets)

    def score(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ((out[:, -1, 0] - targets[:, -1]) ** 2).mean() / self.cfg.y_var

    def context(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(X [B, n, d], y [B, n], x_query [B, d], y_query [B]) of a batch, in either format."""
        seq, y, d = batch.inputs, batch.targets, self.cfg.d
        if self.paired:
            n = self.n_points(seq.shape[1])
            ctx = seq[:, seq.shape[1] - 1 - n:-1]
            return ctx[..., :d], ctx[..., d], seq[:, -1, :d], y[:, -1]
        n = y.shape[1] - 1
        start = seq.shape[1] - (2 * n + 1)
        return seq[:, start::2][:, :n], y[:, :n], seq[:, -1], y[:, -1]

    def reference_mse(self, batch: Batch) -> dict[str, float]:
        """The metric (query squared error / E[y^2]) of three reference estimators on ``batch``:
        "least_squares" (min-norm, pinv), "bayes" (the posterior mean under the generator's prior:
        ridge with lambda = noise^2 / s for w ~ N(0, s I); least squares when noise = 0 and n >= d),
        and "gd_step": one step of gradient descent on the context's squared loss from w = 0,
        w = eta X^T y, with the best scalar eta on this batch (a least-squares fit of eta).
        With label noise and n context points, d - 1 <= n <= d + 1, least squares' expected error is
        infinite (for Gaussian x, E[tr((X^T X)^-1)] = d / (n - d - 1) for n > d + 1 and, min-norm below d,
        E[tr((X X^T)^-1)] = n / (d - n - 1) for n < d - 1; both diverge in between): "least_squares" is then
        inf, not a Monte Carlo average of a heavy tail."""
        X, yc, xq, yq = (t.double() for t in self.context(batch))
        s = 1.0 if self.cfg.w_scale == "unit" else 1.0 / self.cfg.d
        lam = self.cfg.noise ** 2 / s

        def err(w):
            return float(((xq[:, None] @ w)[:, 0, 0] - yq).pow(2).mean() / self.cfg.y_var)

        n, d = X.shape[1], X.shape[2]
        heavy = self.cfg.noise > 0 and d - 1 <= n <= d + 1
        out = {"least_squares": math.inf if heavy else err(torch.linalg.pinv(X) @ yc[..., None])}
        if lam > 0:
            eye = torch.eye(X.shape[-1], dtype=X.dtype)
            out["bayes"] = err(torch.linalg.solve(X.transpose(1, 2) @ X + lam * eye, X.transpose(1, 2) @ yc[..., None]))
        else:
            out["bayes"] = out["least_squares"]
        a = (xq[:, None] @ (X.transpose(1, 2) @ yc[..., None]))[:, 0, 0]
        eta = float((a * yq).sum() / (a * a).sum())
        out["gd_step"] = float((eta * a - yq).pow(2).mean() / self.cfg.y_var)
        return out

    def ceiling_text(self) -> str:
        """The references (``reference_mse``) on 4,096 sequences of length 32 from seed 0."""
        ref = self.reference_mse(self.sample(4096, 32, torch.Generator().manual_seed(0)))
        return ("query MSE / E[y^2]: " + ", ".join(f"{k} {v:.4f}" for k, v in ref.items())
                + " (the zero predictor: 1.0)")

    @staticmethod
    def least_squares_mse(batch: Batch, d: int) -> float:
        """Normalised query MSE of the least-squares (min-norm) estimate, default (interleaved) format."""
        return LinearICL(LinearICLConfig(d=d)).reference_mse(batch)["least_squares"]


TASKS = TASK_SPECS  # the task registry (``tasks.registry``): name -> TaskSpec


def make_task(cfg) -> Task:
    """The generator of a task config, by its registry entry (``tasks.registry.task_spec``)."""
    return task_spec(cfg.name).task_class()(cfg)


def list_tasks() -> list[tuple[str, str]]:
    return TASKS.listing()
