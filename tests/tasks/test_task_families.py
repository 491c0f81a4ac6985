"""The task families that can reach the paper's difficulty rows (keys with replacement, the induction
rule for Markov, the paired linear-ICL format): each generator is checked against its docstring with
code written here, and each ceiling against an independent computation (brute-force enumeration or a
per-sequence loop), so a wrong closed form or a generator that drifts from it fails."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from softprior.config import make_run_config
from softprior.tasks.generators import make_task
from softprior.tasks.registry import task_config


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _packed_pairs(x, n, Q=1):
    T = x.shape[1]
    kp = torch.arange(T - Q - 2 * n, T - Q, 2)
    return x[:, kp], x[:, kp + 1]


def _brute_force_ceiling(K: int, n: int) -> Fraction:
    """Every key tuple in K^n and every queried pair, equally likely; the answer is uniform over the
    m occurrences of the queried key (distinct values), so the best guess scores 1/m."""
    total = Fraction(0)
    for keys in itertools.product(range(K), repeat=n):
        for q in range(n):
            total += Fraction(1, keys.count(keys[q]))
    return total / (K ** n * n)


@pytest.mark.parametrize("K,n", [(2, 2), (3, 4), (4, 3), (2, 5)])
def test_assoc_ceiling_matches_brute_force(K, n):
    cfg = task_config("assoc_recall", keys="replacement", n_keys=K, n_pairs=n, vocab=max(32, K + n + 1))
    acc, se = make_task(cfg).bayes_accuracy()
    assert se == 0.0
    assert acc == pytest.approx(float(_brute_force_ceiling(K, n)), abs=1e-12)


@pytest.mark.parametrize("layout", ["disjoint", "pool"])
def test_assoc_replacement_generator_has_its_ceiling(layout):
    """The sampled sequences' own 1/m (m: occurrences of the queried key) average to the closed form,
    the target is the queried pair's value, keys come from a key set of n_keys tokens per sequence."""
    K, n, N = 10, 6, 20000
    cfg = task_config("assoc_recall", keys="replacement", n_keys=K, n_pairs=n, layout=layout)
    b = make_task(cfg).sample(N, 32, gen(1))
    keys, vals = _packed_pairs(b.inputs, n)
    q = b.inputs[:, -1]
    m = (keys == q[:, None]).sum(1)
    assert bool((m >= 1).all())
    inv = 1.0 / m.double()
    assert float(inv.mean()) == pytest.approx(0.7804, abs=4 * float(inv.std()) / N ** 0.5 + 1e-4)
    hit = (keys == q[:, None]) & (vals == b.targets[:, None])
    assert bool(hit.any(1).all())  # the target is the value of an occurrence of the queried key
    assert all(len(set(r.tolist())) == n for r in vals)  # values distinct
    assert all(len(set(r.tolist())) <= K for r in keys)
    assert not set(keys.flatten().tolist()) & set(vals[0].tolist()) or layout == "pool"
    for kr, vr in zip(keys[:200], vals[:200]):  # keys and values never share a token
        assert not set(kr.tolist()) & set(vr.tolist())
    if layout == "disjoint":
        assert bool((keys >= 1).all() and (keys <= K).all())


@pytest.mark.parametrize("rule", ["first", "last"])
def test_assoc_repeat_target_rules(rule):
    n = 6
    cfg = task_config("assoc_recall", keys="replacement", n_keys=4, n_pairs=n, repeat_target=rule)
    t = make_task(cfg)
    assert t.bayes_accuracy() == (1.0, 0.0)
    b = t.sample(2000, 32, gen(2))
    keys, vals = _packed_pairs(b.inputs, n)
    for kr, vr, q, y in zip(keys.tolist(), vals.tolist(), b.inputs[:, -1].tolist(), b.targets.tolist()):
        idx = [i for i, k in enumerate(kr) if k == q]
        assert y == vr[idx[0] if rule == "first" else idx[-1]]


def test_assoc_replacement_has_no_order_free_shortcut():
    """Copying a random context value scores 1/n (the heuristic printed beside the ceiling)."""
    n, N = 6, 8192
    t = make_task(task_config("assoc_recall", keys="replacement", n_keys=10, n_pairs=n, layout="pool"))
    b = t.sample(N, 32, gen(4))
    _, vals = _packed_pairs(b.inputs, n)
    rnd = vals.gather(1, torch.randint(0, n, (N, 1), generator=gen(5)))[:, 0]
    assert float((rnd == b.targets).float().mean()) == pytest.approx(1 / n, abs=0.02)
    assert t.heuristic_accuracy() == pytest.approx(1 / n)
    assert float((vals[:, 0] == b.targets).float().mean()) == pytest.approx(1 / n, abs=0.02)


def test_assoc_family_validation_and_run_ids():
    with pytest.raises(ValueError, match="n_keys\\+n_pairs"):
        task_config("assoc_recall", keys="replacement", layout="pool", n_keys=20, n_pairs=12)
    with pytest.raises(ValueError, match="repeat_target"):
        task_config("assoc_recall", keys="replacement", repeat_target="middle")
    # distinct keys: the repeat rule is meaningless, every spelling is one config (one run id)
    a = make_run_config("assoc_recall", "unforced", task_options={"keys": "distinct", "repeat_target": "last"})
    assert a.run_id == make_run_config("assoc_recall", "unforced", task_options={"keys": "distinct"}).run_id
    r = make_run_config("assoc_recall", "unforced", task_options={"keys": "replacement"})
    assert r.run_id != a.run_id
    assert make_run_config("assoc_recall", "unforced", task_options={"keys": "replacement", "repeat_target": "last"}
                           ).run_id != r.run_id
    # replacement allows a key set smaller than the number of pairs
    task_config("assoc_recall", keys="replacement", n_keys=4, n_pairs=10)


# ------------------------------------------------------------------ Markov
def _follower_counts(seq):
    a = seq[-1]
    counts = {}
    for t in range(len(seq) - 2):
        if seq[t] == a:
            counts[seq[t + 1]] = counts.get(seq[t + 1], 0) + 1
    return counts


@pytest.mark.parametrize("p", [0.2, 0.8])
def test_markov_successor_ceiling_matches_a_per_sequence_loop(p):
    t = make_task(task_config("markov", p=p))
    acc, se = t.bayes_accuracy(n=600, seed=9)
    b = t.sample(600, 32, gen(9))
    score = 0.0
    for seq, y in zip(b.inputs.tolist(), b.targets.tolist()):
        c = _follower_counts(seq)
        top = [k for k, v in c.items() if v == max(c.values())]
        score += (y in top) / len(top)
    assert acc == pytest.approx(score / 600, abs=1e-9)
    assert 0 < se < 0.03 and acc < 1.0


@pytest.mark.parametrize("query", ["distinct", "occurrence"])
def test_markov_recent_rule(query):
    t = make_task(task_config("markov", p=0.5, answer="recent", query=query))
    assert t.bayes_accuracy() == (1.0, 0.0)
    b = t.sample(500, 32, gen(3))
    for seq, y in zip(b.inputs.tolist(), b.targets.tolist()):
        a = seq[-1]
        last = max(i for i in range(len(seq) - 2) if seq[i] == a)
        assert y == seq[last + 1]


def test_markov_recent_is_not_the_successor_rule():
    """At low p the most recent follower is often noise: the two rules disagree on many sequences."""
    b = make_task(task_config("markov", p=0.2, answer="recent")).sample(2000, 32, gen(4))
    counts = [_follower_counts(s) for s in b.inputs.tolist()]
    mismatch = sum(y != max(c, key=c.get) for c, y in zip(counts, b.targets.tolist()) if len(c) > 1)
    assert mismatch > 100


# ------------------------------------------------------------------ linear ICL
def test_linear_icl_paired_layout():
    d, n, T = 3, 10, 32
    t = make_task(task_config("linear_icl", d=d, n_points=n, format="paired"))
    b = t.sample(64, T, gen(0))
    x = b.inputs
    assert x.shape == (64, T, d + 1) and b.targets.shape == (64, 1)
    assert bool((x[:, : T - n - 1] == 0).all())  # left padding
    assert bool((x[:, -1, d] == 0).all())  # the query's y slot is empty
    X, y = x[:, T - n - 1:-1, :d], x[:, T - n - 1:-1, d]
    w = torch.linalg.lstsq(X.double(), y.double()[..., None]).solution  # recover w from the context
    pred = (x[:, -1, :d].double()[:, None] @ w)[:, 0, 0]
    assert torch.allclose(pred, b.targets[:, 0].double(), atol=1e-4)
    assert t.loss_positions(T).tolist() == [T - 1]
    assert t.n_points(T) == n and make_task(task_config("linear_icl", format="paired")).n_points(T) == T - 1


@pytest.mark.parametrize("opts", [dict(), dict(w_scale="inv_d", d=8), dict(noise=0.5, d=4), dict(format="paired", noise=1.0)])
def test_linear_icl_zero_predictor_scores_one(opts):
    t = make_task(task_config("linear_icl", **opts))
    b = t.sample(20000, 32, gen(1))
    zero = torch.zeros(20000, 1, 1)
    assert float(t.score(zero, b.targets)) == pytest.approx(1.0, abs=0.04)


def test_linear_icl_references():
    """Noise-free with n >= d: least squares (= Bayes) is exact; one GD step is in between. With
    noise, the Bayes ridge beats min-norm least squares near n = d."""
    t = make_task(task_config("linear_icl", d=4, n_points=12, format="paired"))
    r = t.reference_mse(t.sample(4000, 32, gen(2)))
    assert r["least_squares"] < 1e-10 and r["bayes"] == r["least_squares"] and 0.05 < r["gd_step"] < 1.0
    t = make_task(task_config("linear_icl", d=5, n_points=6, noise=1.0, w_scale="inv_d"))
    r = t.reference_mse(t.sample(4000, 32, gen(3)))
    assert r["bayes"] < r["least_squares"] and r["bayes"] < 1.0
    # with noise, least squares' expected error (d / (n - d - 1) above d, n / (d - n - 1) below, min-norm)
    # diverges at n = d - 1, d and d + 1 context points
    for n_ctx, infinite in ((3, False), (4, True), (5, True), (6, True), (7, False)):
        t = make_task(task_config("linear_icl", d=5, n_points=n_ctx, noise=0.5, format="paired"))
        r = t.reference_mse(t.sample(2000, 32, gen(4)))
        assert (r["least_squares"] == float("inf")) == infinite, (n_ctx, r)
    # a hand case: one context point x = (1, 0), y = 2; query (1, 0): GD direction a = x_q . x y = 2
    tt = make_task(task_config("linear_icl", d=2, n_points=1, format="paired"))
    seq = torch.zeros(1, 2, 3)
    seq[0, 0] = torch.tensor([1.0, 0.0, 2.0])
    seq[0, 1, :2] = torch.tensor([1.0, 0.0])
    from softprior.tasks.generators import Batch
    r = tt.reference_mse(Batch(seq, torch.tensor([[2.0]])))
    assert r["least_squares"] == pytest.approx(0.0, abs=1e-12) and r["gd_step"] == pytest.approx(0.0, abs=1e-12)


def test_linear_icl_paired_trains_through_the_model():
    """The run config sizes the model's input as d + 1 and a few steps train without error."""
    import softprior
    from softprior.store import RunStore
    cfg = make_run_config("linear_icl", "forced_zero", 0, steps=4, calibrated=False, eval_every=2, n_val=16,
                          task_options={"format": "paired", "d": 3, "n_points": 20})
    assert cfg.model.d_in == 4
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        s = softprior.run(cfg, RunStore(d))
    assert 0 < s["zero_mse"] < 10


def test_linear_icl_points_that_do_not_fit_are_refused_at_config_time():
    """31 points fit T = 32 only one per token: the interleaved format is refused when the run is
    configured (a calibration search then records the candidate as infeasible), not when it trains."""
    assert make_run_config("linear_icl", "unforced", task_options={"format": "paired", "n_points": 31}).task.n_points == 31
    with pytest.raises(ValueError, match="n_points=31 does not fit"):
        make_run_config("linear_icl", "unforced", task_options={"format": "interleaved", "n_points": 31})
    with pytest.raises(ValueError, match="n_points=16 does not fit"):
        make_run_config("linear_icl", "unforced", task_options={"format": "interleaved", "n_points": 16})


# ------------------------------------------------------------------ a plugin task with only what it must define
BARE = '''
from typing import Literal

import torch

from softprior.tasks.generators import Batch, Task
from softprior.tasks.registry import TaskConfigBase, register_task


class BareConfig(TaskConfigBase):
    name: Literal["bare_copy"] = "bare_copy"
    vocab: int = 8


class BareCopy(Task):
    """Copy the first token: a generator's required parts only (no answer_mask, chance_text,
    ceiling_text, ceiling_options, row_options, bayes_accuracy or reference_mse)."""
    metric, input_kind, chance = "acc", "tokens", 1 / 7

    def min_length(self):
        return 2

    def sample(self, batch_size, length, generator):
        x = torch.randint(1, self.cfg.vocab, (batch_size, length), generator=generator)
        return Batch(x, x[:, 0].clone())


register_task("bare_copy", config=BareConfig, generator=BareCopy, description="copy the first token (acc)")
'''

THROUGH = '''
import contextlib, io, json, math, sys
import torch
from softprior.plugins import load_plugin
load_plugin(sys.argv[1])
from softprior.analysis.mechanism import answer_mask, trace
from softprior.calibration.robustness import fade_row
from softprior.cells import Cell, length_view
from softprior.cli import main
from softprior.config import make_run_config
from softprior.model.transformer import build_model
from softprior.reports.experiment import chance_text
from softprior.tasks.generators import make_task
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["tasks", "--ceilings"])
cfg = make_run_config("bare_copy", "unforced", 0, model="base", calibrated=False, n_val=8)
task = make_task(cfg.task)
try:
    answer_mask(task, task.sample(2, 8, torch.Generator().manual_seed(0)))
    mask = None
except ValueError as e:
    mask = str(e)
model = build_model(cfg)
df = trace([(0, model.state_dict())], cfg, n_examples=8)
view, _ = length_view(cfg, model, "pairs fill", 64)
print(json.dumps({"rc": rc, "out": out.getvalue(), "mask": mask, "successor_mass_nan": bool(df["successor_mass"].isna().all()),
                  "chance": chance_text([Cell(cfg, row="unforced")]), "fade": fade_row("bare_copy").model_dump(),
                  "fill_same": view.task == cfg.task}))
'''


def test_a_plugin_task_without_the_optional_parts_goes_through_every_path_that_asks_for_them(tmp_path):
    """What the package asks of a task beyond its batches (``tasks.generators.Task``: the answer position,
    the chance line's words, the ceilings' listing, the fade point's options, the context filled with
    pairs) has a default: a plugin task that defines none of it goes through each caller (in a fresh
    interpreter: the registration stays there), and the paper's tasks say what they said."""
    import json
    import subprocess
    import sys
    plugin = tmp_path / "bare.py"
    plugin.write_text(BARE)
    p = subprocess.run([sys.executable, "-c", THROUGH, str(plugin)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0
    lines = [x.strip() for x in r["out"].splitlines()]
    assert "bare_copy: no Bayes ceiling (the task defines no bayes_accuracy)" in lines
    assert lines.count("assoc_recall: Bayes ceiling 0.781") == 1 and sum(x.startswith("markov p=") for x in lines) == 3
    assert any(x.startswith("linear_icl: query MSE / E[y^2]: least_squares ") for x in lines)
    assert r["mask"] and "answer_mask" in r["mask"] and r["successor_mass_nan"]
    assert r["chance"] is None and r["fade"] == {"path": "fade600", "task": {}} and r["fill_same"]


def test_the_paper_tasks_state_their_optional_parts():
    from softprior.calibration.robustness import fade_row
    from softprior.cells import Cell
    from softprior.reports.experiment import chance_text
    cells = [Cell(make_run_config("assoc_recall", "unforced", s), row="unforced") for s in (0, 1)]
    n = cells[0].cfg.task.n_pairs
    assert chance_text(cells) == f"chance: copy a random value\nof the context (1/{n})"
    assert chance_text([Cell(make_run_config("markov", "unforced", 0), row="unforced")]) == \
        "chance: the best guess that\nignores order (Markov.chance)"
    assert chance_text(cells + [Cell(make_run_config("markov", "unforced", 0), row="unforced")]) is None
    assert chance_text([Cell(make_run_config("linear_icl", "unforced", 0), row="unforced")]) is None
    assert fade_row("markov").task == {"p": 0.5} and fade_row("assoc_recall").task == {} == fade_row("linear_icl").task
