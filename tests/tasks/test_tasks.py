"""The three tasks of SPEC section 4: seeded generators, layout, targets and chance levels.

The shortcut tests compute simple heuristics here, independently of the library, on the library's
samples: if any of them beats the stated chance level the task leaks its answer.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from softprior.tasks.generators import Batch, LinearICL, list_tasks, make_task
from softprior.tasks.registry import AssocRecallConfig, UnknownTaskError, task_config


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


ALL_TASKS = [("assoc_recall", {}), ("markov", {"p": 0.5}), ("linear_icl", {})]


# ------------------------------------------------------------------ common
@pytest.mark.parametrize("name,opts", ALL_TASKS)
def test_same_generator_seed_same_batch(name, opts):
    t = make_task(task_config(name, **opts))
    a, b = t.sample(32, 32, gen(7)), t.sample(32, 32, gen(7))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    c = t.sample(32, 32, gen(8))
    assert not torch.equal(a.inputs, c.inputs)


@pytest.mark.parametrize("name,opts", ALL_TASKS)
def test_sampling_does_not_touch_global_rng(name, opts):
    t = make_task(task_config(name, **opts))
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    t.sample(16, 32, gen(0))
    assert torch.equal(torch.rand(4), expected)
    # and the global seed does not change the batch
    torch.manual_seed(1)
    a = t.sample(8, 32, gen(3))
    torch.manual_seed(2)
    b = t.sample(8, 32, gen(3))
    assert torch.equal(a.inputs, b.inputs)


@pytest.mark.parametrize("name,opts", ALL_TASKS)
def test_consecutive_batches_from_one_generator_differ(name, opts):
    t = make_task(task_config(name, **opts))
    g = gen(0)
    assert not torch.equal(t.sample(8, 32, g).inputs, t.sample(8, 32, g).inputs)


def test_task_config_errors():
    with pytest.raises(UnknownTaskError) as ei:
        task_config("sorting")
    assert "sorting" in str(ei.value) and "assoc_recall" in str(ei.value) and "markov" in str(ei.value)
    with pytest.raises(ValidationError):
        task_config("markov", p=0.0)
    with pytest.raises(ValidationError):
        task_config("markov", p=1.5)
    with pytest.raises(ValidationError):
        task_config("assoc_recall", n_pairs=20)  # needs 20 keys and 20 values in a vocab of 32
    with pytest.raises(UnknownTaskError) as ei:  # an unknown option names the task and its valid options
        task_config("assoc_recall", bogus=3)
    assert "'bogus'" in str(ei.value) and "assoc_recall" in str(ei.value) and "n_pairs" in str(ei.value)


def test_list_tasks():
    """The three built-in tasks; a plugin's (registered by another test in this process) is listed beside them."""
    from softprior.tasks.registry import TASK_SPECS
    names = [n for n, _ in list_tasks()]
    assert {n for n in names if TASK_SPECS[n].plugin is None} == {"assoc_recall", "markov", "linear_icl"}
    assert len(names) == len(set(names)) == len(TASK_SPECS)


# ------------------------------------------------------------------ associative recall
def _check_assoc_batch(b: Batch, cfg: AssocRecallConfig, length: int):
    n = cfg.n_pairs
    B = b.inputs.shape[0]
    assert b.inputs.shape == (B, length) and b.inputs.dtype == torch.long
    assert b.targets.shape == (B,) and b.targets.dtype == torch.long
    start = length - (2 * n + 1)
    # left padding with PAD = 0
    assert (b.inputs[:, :start] == 0).all()
    keys = b.inputs[:, start:start + 2 * n:2]
    vals = b.inputs[:, start + 1:start + 2 * n:2]
    query = b.inputs[:, -1]
    # keys in 1..n_keys, values in the top (vocab - 1 - n_keys) tokens: disjoint
    assert ((keys >= 1) & (keys <= cfg.n_keys)).all()
    assert ((vals > cfg.n_keys) & (vals < cfg.vocab)).all()
    for i in range(B):
        k, v = keys[i].tolist(), vals[i].tolist()
        assert len(set(k)) == n, "keys must be distinct within a sequence"
        assert len(set(v)) == n, "values must be distinct within a sequence"
        assert not set(k) & set(v)
        q = int(query[i])
        assert q in k, "the query is one of the sequence's keys"
        assert int(b.targets[i]) == v[k.index(q)], "the target is the value paired with the query key"


def test_assoc_recall_layout_and_targets():
    cfg = task_config("assoc_recall")
    t = make_task(cfg)
    _check_assoc_batch(t.sample(64, 32, gen(0)), cfg, 32)


def test_assoc_recall_at_length_120_is_left_padded():
    cfg = task_config("assoc_recall")
    t = make_task(cfg)
    b = t.sample(64, 120, gen(1))
    _check_assoc_batch(b, cfg, 120)
    assert (b.inputs[:, : 120 - 21] == 0).all() and (b.inputs[:, 120 - 21:] != 0).all()


def test_assoc_recall_other_pair_counts():
    cfg = task_config("assoc_recall", n_pairs=8)
    t = make_task(cfg)
    assert t.chance == pytest.approx(1 / 8)
    _check_assoc_batch(t.sample(32, 32, gen(2)), cfg, 32)
    cfg2 = task_config("assoc_recall", n_pairs=4, vocab=16, n_keys=6)
    _check_assoc_batch(make_task(cfg2).sample(32, 9, gen(2)), cfg2, 9)


def test_assoc_recall_too_short_raises():
    t = make_task(task_config("assoc_recall"))
    with pytest.raises(ValueError, match="21"):
        t.sample(4, 20, gen(0))


def test_assoc_recall_metric_and_loss_on_answer_position():
    t = make_task(task_config("assoc_recall"))
    b = t.sample(16, 32, gen(0))
    V = 32
    perfect = torch.full((16, 1, V), -10.0)
    perfect[torch.arange(16), 0, b.targets] = 10.0
    assert float(t.score(perfect, b.targets)) == 1.0
    wrong = torch.zeros(16, 1, V)
    wrong[:, 0, 0] = 1.0  # always PAD
    assert float(t.score(wrong, b.targets)) == 0.0
    # uniform logits: cross-entropy log V
    assert float(t.loss(torch.zeros(16, 1, V), b.targets)) == pytest.approx(float(torch.log(torch.tensor(32.0))))
    assert t.loss_positions(32).tolist() == [31]


def test_assoc_recall_query_is_uniform_over_pairs():
    cfg = task_config("assoc_recall")
    b = make_task(cfg).sample(8192, 32, gen(5))
    start = 32 - 21
    keys = b.inputs[:, start:start + 20:2]
    idx = (keys == b.inputs[:, -1:]).float().argmax(1)
    freq = torch.bincount(idx, minlength=10).float() / 8192
    assert (freq - 0.1).abs().max() < 0.02


def test_assoc_recall_heuristics_score_chance():
    """No shortcut: simple heuristics score 1/n_pairs (within 0.03 on 8192 samples)."""
    cfg = task_config("assoc_recall")
    t = make_task(cfg)
    N, T, n = 8192, 32, cfg.n_pairs
    b = t.sample(N, T, gen(11))
    x, y = b.inputs, b.targets
    chance = 1.0 / n
    assert t.chance == pytest.approx(chance)
    rng = gen(99)
    ctx = x[:, :-1]
    is_val = ctx > cfg.n_keys  # value tokens (independent of the library's layout)
    # most frequent value token in context (ties broken at random)
    counts = torch.zeros(N, cfg.vocab).scatter_add_(1, ctx, is_val.float())
    counts[:, : cfg.n_keys + 1] = -1
    most_freq = (counts + 0.5 * torch.rand(N, cfg.vocab, generator=rng)).argmax(1)
    # last / first value in context
    pos = torch.arange(T - 1).expand(N, -1)
    last_pos = torch.where(is_val, pos, -1).max(1).values
    first_pos = torch.where(is_val, pos, T).min(1).values
    last_val = ctx.gather(1, last_pos[:, None])[:, 0]
    first_val = ctx.gather(1, first_pos[:, None])[:, 0]
    # a random value from the context
    pick = torch.where(is_val, torch.rand(N, T - 1, generator=rng), -1.0).argmax(1)
    rand_val = ctx.gather(1, pick[:, None])[:, 0]
    # the value right after the first key / the most frequent token overall
    overall = (torch.nn.functional.one_hot(ctx, cfg.vocab).sum(1).float()
               + 0.5 * torch.rand(N, cfg.vocab, generator=rng))
    overall[:, 0] = -1  # never PAD
    overall_mf = overall.argmax(1)
    for name, guess in [("most frequent value", most_freq), ("last value", last_val), ("first value", first_val),
                        ("random value in context", rand_val), ("most frequent token", overall_mf)]:
        acc = float((guess == y).float().mean())
        if name == "most frequent token":
            assert acc <= chance + 0.03, (name, acc)
        else:
            assert abs(acc - chance) < 0.03, (name, acc)


# ------------------------------------------------------------------ Markov induction
@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_markov_target_is_successor_seen_earlier(p):
    t = make_task(task_config("markov", p=p))
    T = 32
    b = t.sample(256, T, gen(3))
    x, y = b.inputs, b.targets
    assert x.shape == (256, T) and y.shape == (256,) and x.dtype == torch.long
    assert ((x >= 0) & (x < 32)).all() and ((y >= 0) & (y < 32)).all()
    a = x[:, -1]
    for i in range(256):
        row = x[i].tolist()
        pairs = {(row[j], row[j + 1]) for j in range(T - 2)}  # pairs entirely before the final token
        assert (int(a[i]), int(y[i])) in pairs, f"row {i}: ({int(a[i])}, {int(y[i])}) never occurs earlier"


def test_markov_p1_follows_one_successor_map():
    """With p = 1 every transition follows the map, so the map read off the context is a function and
    the target is the successor of the final token under it."""
    t = make_task(task_config("markov", p=1.0))
    b = t.sample(128, 32, gen(4))
    for i in range(128):
        row = b.inputs[i].tolist()
        succ = {}
        for j in range(30):
            assert succ.setdefault(row[j], row[j + 1]) == row[j + 1], "one successor per token"
        assert succ[row[-1]] == int(b.targets[i])
        # a bijection: no two tokens share a successor
        assert len(set(succ.values())) == len(succ)


def test_markov_repeat_probability_controls_transitions():
    """The share of context transitions consistent with an earlier occurrence grows with p."""
    shares = []
    for p in (0.2, 0.5, 0.8):
        b = make_task(task_config("markov", p=p)).sample(512, 32, gen(6))
        x = b.inputs[:, :-1]
        agree = total = 0
        for row in x.tolist():
            seen = {}
            for j in range(len(row) - 1):
                if row[j] in seen:
                    total += 1
                    agree += seen[row[j]] == row[j + 1]
                seen.setdefault(row[j], row[j + 1])
        shares.append(agree / total)
    assert shares[0] < shares[1] < shares[2]


def test_markov_too_short_raises():
    with pytest.raises(ValueError):
        make_task(task_config("markov")).sample(4, 3, gen(0))


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_markov_order_free_heuristics_at_most_chance(p):
    t = make_task(task_config("markov", p=p))
    N, T, V = 8192, 32, 32
    b = t.sample(N, T, gen(21))
    x, y = b.inputs, b.targets
    chance = t.chance
    assert 1.0 / V <= chance < 0.5
    rng = gen(77)
    ctx, a = x[:, :-1], x[:, -1]
    counts = torch.nn.functional.one_hot(ctx, V).sum(1).float()
    jitter = 0.5 * torch.rand(N, V, generator=rng)  # random tie-breaking
    most_freq = (counts + jitter).argmax(1)
    excl = counts.clone()
    excl[torch.arange(N), a] = -1.0  # most frequent token other than the final token
    most_freq_excl = (excl + jitter).argmax(1)
    last_before_final = x[:, -2]
    seen = counts > 0
    guess_seen = torch.where(seen, torch.rand(N, V, generator=rng), -1.0).argmax(1)  # uniform among seen
    for name, guess in [("most frequent", most_freq), ("most frequent excluding final", most_freq_excl),
                        ("last before final", last_before_final), ("uniform among seen", guess_seen)]:
        acc = float((guess == y).float().mean())
        assert acc <= chance + 0.03, (p, name, acc, chance)


def test_markov_chance_depends_on_the_length():
    """A longer context shows more distinct tokens, so guessing among them gets harder; the chance
    at the base length is ``chance``; tasks whose chance does not depend on length say so."""
    t = make_task(task_config("markov", p=0.5))
    assert t.chance_at(32) == t.chance
    assert t.chance_at(120) < t.chance_at(32) - 0.01
    assert t.chance_at(16) > t.chance_at(32) + 0.01
    a = make_task(task_config("assoc_recall"))
    assert a.chance_at(120) == a.chance == pytest.approx(0.1)


# ------------------------------------------------------------------ linear regression ICL
def test_linear_icl_layout():
    cfg = task_config("linear_icl", d=5)
    t = make_task(cfg)
    T = 32
    n = (T - 1) // 2  # 15 points + query
    b = t.sample(64, T, gen(0))
    assert b.inputs.shape == (64, T, 5) and b.inputs.dtype == torch.float32
    assert b.targets.shape == (64, n + 1)
    start = T - (2 * n + 1)
    assert (b.inputs[:, :start] == 0).all()  # left padding (T=32 -> one pad vector)
    xs = b.inputs[:, start::2]  # n context x's and the query
    ys = b.inputs[:, start + 1::2]
    assert xs.shape[1] == n + 1 and ys.shape[1] == n
    assert torch.equal(ys[..., 0], b.targets[:, :n])
    assert (ys[..., 1:] == 0).all()
    assert t.loss_positions(T).tolist() == list(range(start, T, 2))


def test_linear_icl_targets_are_linear_in_x():
    """y = w . x with one w per sequence: solving for w from d points predicts all other points."""
    d, T = 5, 32
    t = make_task(task_config("linear_icl", d=d))
    b = t.sample(64, T, gen(1))
    n = (T - 1) // 2
    start = T - (2 * n + 1)
    X = b.inputs[:, start::2].double()  # [B, n+1, d]
    Y = b.targets.double()  # [B, n+1]
    w = torch.linalg.solve(X[:, :d], Y[:, :d, None])  # exact from the first d points
    pred = (X @ w)[..., 0]
    assert torch.allclose(pred, Y, atol=1e-4)
    # w looks like N(0, I): its empirical variance is near 1
    assert 0.7 < float(w.var()) < 1.3


def test_linear_icl_least_squares_is_exact_once_n_ge_d():
    d = 5
    t = make_task(task_config("linear_icl", d=d))
    b = t.sample(256, 32, gen(2))
    assert LinearICL.least_squares_mse(b, d) < 1e-8
    # fewer points than dimensions (T=7 -> 3 points): least squares cannot be exact
    b_short = t.sample(256, 7, gen(2))
    assert LinearICL.least_squares_mse(b_short, d) > 0.1


def test_linear_icl_metric_and_chance():
    d = 5
    t = make_task(task_config("linear_icl", d=d))
    assert t.metric == "mse" and t.chance == 1.0
    b = t.sample(4096, 32, gen(3))
    P = b.targets.shape[1]
    zero = torch.zeros(4096, P, 1)
    # the zero predictor scores E[y^2]/d = 1
    assert float(t.score(zero, b.targets)) == pytest.approx(1.0, abs=0.1)
    exact = b.targets[..., None].clone()
    assert float(t.score(exact, b.targets)) == 0.0
    assert float(t.loss(exact, b.targets)) == 0.0
    # score uses the query (last) position only: corrupting the others leaves it at 0
    exact[:, :-1] += 5.0
    assert float(t.score(exact, b.targets)) == 0.0
    assert float(t.loss(exact, b.targets)) > 0.0
