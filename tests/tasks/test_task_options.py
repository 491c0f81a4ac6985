"""The task-design options of the calibration search (issue 14): each option's layout is checked
against the specification in ``tasks/generators.py``'s docstring with code written here, and each is tested for
shortcuts the way the default task is (``test_tasks.py``): order-free heuristics score chance."""

from __future__ import annotations

import itertools

import pytest
import torch

from softprior.config import make_run_config
from softprior.model.config import ModelConfig
from softprior.model.transformer import initial_pos_bias
from softprior.tasks.generators import make_task
from softprior.tasks.registry import task_config


def gen(seed):
    return torch.Generator().manual_seed(seed)


ASSOC = [dict(layout=l, n_queries=q, placement=p, n_pairs=n)
         for l, q, p, n in itertools.product(["disjoint", "pool"], [1, 3], ["packed", "spread"], [6, 12])]


def _pairs(x, n, Q, placement):
    """Key and value positions of each sequence, from the layout spelled out in the docstring."""
    B, T = x.shape
    if placement == "packed":
        kp = torch.arange(T - Q - 2 * n, T - Q, 2).expand(B, n)
    else:
        n_slots = (T - Q) // 2
        base = (T - Q) - 2 * n_slots
        starts = torch.arange(base, T - Q, 2)
        occupied = x[:, starts] != 0
        assert bool((occupied.sum(1) == n).all())
        kp = torch.stack([starts[o] for o in occupied])
    return kp, kp + 1


@pytest.mark.parametrize("opts", ASSOC, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_assoc_options_layout_and_targets(opts):
    cfg = task_config("assoc_recall", **opts)
    t = make_task(cfg)
    T, Q, n = 32, cfg.n_queries, cfg.n_pairs
    b = t.sample(512, T, gen(3))
    x, y = b.inputs, b.targets.reshape(512, -1)
    assert y.shape[1] == Q
    kp, vp = _pairs(x, n, Q, cfg.placement)
    keys, vals = x.gather(1, kp), x.gather(1, vp)
    # every other position before the queries is PAD
    mask = torch.ones_like(x, dtype=torch.bool)
    mask.scatter_(1, kp, False)
    mask.scatter_(1, vp, False)
    mask[:, T - Q:] = False
    assert bool((x[mask] == 0).all())
    toks = torch.cat([keys, vals], 1)
    assert bool((toks > 0).all())
    assert all(len(set(r.tolist())) == 2 * n for r in toks)  # keys and values all distinct
    if cfg.layout == "disjoint":
        assert bool((keys <= cfg.n_keys).all()) and bool((vals > cfg.n_keys).all())
    queries = x[:, T - Q:]
    assert all(len(set(r.tolist())) == Q for r in queries)  # distinct queries
    for i in range(Q):  # the target of query i is the value after that key
        hit = keys == queries[:, i:i + 1]
        assert bool((hit.sum(1) == 1).all())
        assert torch.equal(vals[hit], y[:, i])
    # the loss positions are the queries (or the last one)
    pos = t.loss_positions(T).tolist()
    assert pos == ([T - 1] if cfg.loss_on == "last" else list(range(T - Q, T)))


@pytest.mark.parametrize("opts", [dict(layout="pool"), dict(placement="spread"), dict(n_queries=4),
                                  dict(layout="pool", placement="spread", n_queries=4, n_pairs=8)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_assoc_options_have_no_shortcut(opts):
    """Order-free heuristics on the final query score 1/n_pairs (within 0.03 on 8192 samples), and
    the queried pair is uniform over the pairs' positions."""
    cfg = task_config("assoc_recall", **opts)
    t = make_task(cfg)
    N, T, n, Q = 8192, 32, cfg.n_pairs, cfg.n_queries
    b = t.sample(N, T, gen(11))
    x, y = b.inputs, b.targets.reshape(N, -1)[:, -1]
    kp, vp = _pairs(x, n, Q, cfg.placement)
    vals = x.gather(1, vp)
    rng = gen(5)
    chance = 1.0 / n
    guesses = {"first value": vals[:, 0], "last value": vals[:, -1],
               "random value": vals.gather(1, torch.randint(0, n, (N, 1), generator=rng))[:, 0],
               "value after the last key-looking token": x[:, T - Q - 1]}
    for name, g in guesses.items():
        acc = float((g == y).float().mean())
        assert abs(acc - chance) < 0.03 or (name.startswith("value after") and acc <= chance + 0.03), (name, acc)
    idx = (vals == y[:, None]).float().argmax(1)
    freq = torch.bincount(idx, minlength=n).float() / N
    assert float((freq - chance).abs().max()) < 0.03


def test_assoc_options_validation_names_the_field():
    with pytest.raises(ValueError, match="n_queries"):
        task_config("assoc_recall", n_pairs=4, n_queries=5)
    with pytest.raises(ValueError, match="pool"):
        task_config("assoc_recall", n_pairs=16, layout="pool")
    with pytest.raises(ValueError, match="layout"):
        task_config("assoc_recall", layout="halves")
    with pytest.raises(ValueError, match="needs length"):
        make_task(task_config("assoc_recall", n_pairs=12, n_queries=8)).sample(2, 31, gen(0))


def test_one_query_loss_options_are_one_config():
    a = make_run_config("assoc_recall", "unforced", task_options={"loss_on": "queries"})
    b = make_run_config("assoc_recall", "unforced")
    assert a.run_id == b.run_id


# ------------------------------------------------------------------ Markov
def _determined_by_hand(seq, succ):
    T = len(seq)
    out = [-100] * T
    for t in range(T - 1):
        if seq[t + 1] != succ[seq[t]]:
            continue
        if any(seq[u] == seq[t] and seq[u + 1] == succ[seq[u]] for u in range(t)):
            out[t] = seq[t + 1]
    return out


def test_markov_determined_targets_match_a_loop():
    t = make_task(task_config("markov", p=0.6, vocab=6, loss_on="determined"))
    g = gen(4)
    # the successor map is drawn inside sample: reproduce it from the same generator state
    state = g.get_state()
    b = t.sample(16, 14, g)
    g2 = torch.Generator()
    g2.set_state(state)
    succ = torch.rand(16, 6, generator=g2).argsort(-1)
    for i in range(16):
        seq, s = b.inputs[i].tolist(), succ[i].tolist()
        want = _determined_by_hand(seq, s)
        want[-1] = s[seq[-1]]
        assert b.targets[i].tolist() == want, i
    assert torch.equal(t.loss_positions(14), torch.arange(14))


@pytest.mark.parametrize("query", ["distinct", "occurrence"])
def test_markov_query_options_target_and_no_order_free_shortcut(query):
    t = make_task(task_config("markov", p=0.5, query=query))
    N, T, V = 8192, 32, 32
    b = t.sample(N, T, gen(21))
    x, y = b.inputs, b.targets
    # the final token occurred earlier directly followed by the target
    prev, nxt = x[:, :-2], x[:, 1:-1]
    assert bool(((prev == x[:, -1:]) & (nxt == y[:, None])).any(1).all())
    counts = torch.nn.functional.one_hot(x[:, :-1], V).sum(1).float()
    rng = gen(8)
    most_freq = (counts + 0.5 * torch.rand(N, V, generator=rng)).argmax(1)
    seen = torch.where(counts > 0, torch.rand(N, V, generator=rng), -1.0).argmax(1)
    for name, g in [("most frequent", most_freq), ("uniform among seen", seen)]:
        acc = float((g == y).float().mean())
        assert acc <= t.chance + 0.03, (name, acc, t.chance)
    if query == "occurrence":  # drawing occurrences favours frequent tokens: the chance level says so
        assert t.chance > make_task(task_config("markov", p=0.5)).chance


# ------------------------------------------------------------------ linear ICL
def test_linear_icl_n_points():
    t = make_task(task_config("linear_icl", d=3, n_points=5))
    b = t.sample(4, 32, gen(0))
    n = 5
    start = 32 - (2 * n + 1)
    assert bool((b.inputs[:, :start] == 0).all())
    assert b.targets.shape == (4, n + 1)
    assert torch.equal(t.loss_positions(32), torch.arange(start, 32, 2))
    y = torch.einsum("bkd,bd->bk", b.inputs[:, start::2], torch.zeros(4, 3))  # shape check only
    assert y.shape == (4, n + 1)
    with pytest.raises(ValueError, match="n_points"):
        t.sample(2, 9, gen(0))


# ------------------------------------------------------------------ initialisation options
def test_initial_pos_bias_by_hand():
    cfg = ModelConfig(n_heads=2, d_model=4, n_ctx=5, prior_init="bounded", prior_cap=4.0)
    assert initial_pos_bias(cfg).tolist() == [[0, -1, -4, -4, -4], [-1, 0, -1, -4, -4]]
    cfg = ModelConfig(n_heads=2, d_model=4, n_ctx=5, prior_init="locality", prior_scale=0.5)
    assert initial_pos_bias(cfg).tolist() == [[0, -0.5, -2, -4.5, -8], [-0.5, 0, -0.5, -2, -4.5]]
    cfg = ModelConfig(n_heads=2, d_model=4, n_ctx=5, prior_init="alibi", prior_scale=2.0)
    # ALiBi slopes for H = 2: 2^-4 and 2^-8
    assert initial_pos_bias(cfg).tolist() == [[-2 * r / 16 for r in range(5)], [-2 * r / 256 for r in range(5)]]


def test_zero_prior_ignores_scale_and_layers():
    a = ModelConfig(prior_init="zero", prior_scale=4.0, prior_layers=(0, 1))
    assert a == ModelConfig(prior_init="zero")


@pytest.mark.parametrize("task,opts", [("assoc_recall", dict(n_pairs=6, n_queries=3, loss_on="queries",
                                                             placement="spread", layout="pool")),
                                       ("markov", dict(loss_on="determined", query="occurrence")),
                                       ("linear_icl", dict(d=3, n_points=6))])
def test_options_train_alone_and_grouped_alike(task, opts):
    """Every option goes through both training entry points with the same numbers."""
    from softprior.training.engine import train_group
    from softprior.training.loop import train
    cfg = make_run_config(task, "unforced", 0, steps=12, eval_every=6, n_val=64, task_options=opts)
    a = train(cfg).summary
    g = train_group([cfg])[0].summary
    m = a["metric"]
    for k in (f"normal_{m}", f"zero_{m}"):
        assert a[k] == pytest.approx(g[k], abs=1e-5), k
    assert a["normal_loss"] == pytest.approx(g["normal_loss"], rel=1e-4)
