"""The training loop (SPEC sections 3 and 7): determinism, logging, gate trajectories, clipping."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

import softprior.executors.sweep as sweep_mod
from conftest import state_dicts_equal, tiny_config
from softprior.paths import GateConfig, PathConfig, get_path
from softprior.schedules import Fade, HardSwitch
from softprior.tasks.generators import make_task
from softprior.model.transformer import build_model
from softprior.training.loop import train

# `import softprior.training.loop as m` would give the function: the package re-exports train() under the
# submodule's name, so fetch the module itself
train_mod = importlib.import_module("softprior.training.loop")


@pytest.fixture
def forward_calls(monkeypatch):
    """Record every forward the training loop makes through the fast path (``fastpath.fast_forward``,
    one run: K = 1) as (batch size, gate_pos, gate_content, inputs, own gate_pos, own gate_content):
    the gates applied and the model's own sigmoid(logit) at that moment, each averaged over layers
    and heads (the tests' paths have one value per kind)."""
    import softprior.model.fastpath as fp
    calls = []
    orig = fp.fast_forward

    def spy(p, cfg, inputs, gate_pos, gate_content, positions):
        x = inputs[0] if inputs.dim() == 3 else inputs  # training [K, B, T]; evaluation [B, T]
        g = torch.sigmoid(p["gate_logits"][0].detach())  # as Runs.model_gates: [2, a, b] -> [L, H] per kind
        own = [float(g[i].expand(cfg.n_layers, cfg.n_heads).mean()) for i in (0, 1)]
        calls.append((x.shape[0], float(gate_pos.detach().mean()), float(gate_content.detach().mean()), x.clone(),
                      *own))
        return orig(p, cfg, inputs, gate_pos, gate_content, positions)

    monkeypatch.setattr(fp, "fast_forward", spy)
    return calls


def applied(call):
    """(gate_pos, gate_content) of a recorded forward, None where it is the model's own gate (to float32
    rounding: a mean over [L, H] rounds by layout). A forced gate equal to the model's own (0.5 at
    logit 0) reads as None too: tests of forced values read ``call[1:3]`` directly."""
    return tuple(None if math.isclose(v, own, rel_tol=1e-6) else v for v, own in ((call[1], call[4]), (call[2], call[5])))


def training_calls(calls, batch_size=16):
    """Training forwards use batch_size (16) rows; evaluation uses n_val (64)."""
    return [c for c in calls if c[0] == batch_size]


# ------------------------------------------------------------------ determinism
def test_same_config_and_seed_bit_identical():
    cfg = tiny_config()
    a, b = train(cfg), train(cfg)
    assert a.metrics == b.metrics
    assert state_dicts_equal(a.state_dict, b.state_dict)
    drop = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    assert drop(a.summary) == drop(b.summary)


def test_different_seeds_differ():
    a, b = train(tiny_config(seed=0)), train(tiny_config(seed=1))
    assert a.summary["run_id"] != b.summary["run_id"]
    assert not state_dicts_equal(a.state_dict, b.state_dict)
    assert [r["train_loss"] for r in a.metrics] != [r["train_loss"] for r in b.metrics]


def test_seed_fixes_init_and_data_across_paths(forward_calls):
    """All paths share data and initialisation for a given seed (SPEC 3/7)."""
    ca, cb = tiny_config(path="unforced"), tiny_config(path="forced_zero")
    assert state_dicts_equal(build_model(ca).state_dict(), build_model(cb).state_dict())
    assert not state_dicts_equal(build_model(ca).state_dict(), build_model(tiny_config(seed=3)).state_dict())
    train(ca)
    batches_a = [c[3] for c in training_calls(forward_calls)]
    forward_calls.clear()
    train(cb)
    batches_b = [c[3] for c in training_calls(forward_calls)]
    assert len(batches_a) == len(batches_b) == 20
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b))
    # fresh batches every step
    assert len({tuple(x.flatten().tolist()) for x in batches_a}) == 20


def test_build_model_does_not_disturb_global_rng():
    torch.manual_seed(42)
    want = torch.rand(3)
    torch.manual_seed(42)
    build_model(tiny_config(seed=5))
    assert torch.equal(torch.rand(3), want)


# ------------------------------------------------------------------ metrics rows and summary
def test_metrics_rows_and_summary():
    cfg = tiny_config(eval_every=7)
    r = train(cfg)
    assert [row["step"] for row in r.metrics] == [7, 14, 20]  # every 7 steps and the final step
    for row in r.metrics:
        for k in ("train_loss", "g_pos", "g_content", "normal_acc", "normal_loss", "zero_acc", "zero_loss"):
            assert k in row, k
        assert 0.0 <= row["normal_acc"] <= 1.0 and 0.0 <= row["zero_acc"] <= 1.0
        # accuracies on 64 validation examples are multiples of 1/64
        assert abs(row["normal_acc"] * 64 - round(row["normal_acc"] * 64)) < 1e-6
    s = r.summary
    assert s["run_id"] == cfg.run_id and s["steps"] == 20 and s["metric"] == "acc"
    assert s["normal_acc"] == r.metrics[-1]["normal_acc"] and s["zero_acc"] == r.metrics[-1]["zero_acc"]
    assert s["chance"] == pytest.approx(0.1)
    assert s["n_params"] == build_model(cfg).n_params()


def test_normal_and_zero_metrics_are_what_the_final_weights_score():
    """Recompute normal (model's own gates) and zero-gate accuracy on the fixed validation set."""
    for seed in (0, 1):
        cfg = tiny_config(seed=seed, path="unforced")
        r = train(cfg)
        model = build_model(cfg)
        model.load_state_dict(r.state_dict)
        task = make_task(cfg.task)
        val = task.sample(cfg.n_val, cfg.model.n_ctx, torch.Generator().manual_seed(cfg.val_seed))
        with torch.no_grad():
            normal = float((model(val.inputs)[:, -1].argmax(-1) == val.targets).float().mean())
            zero = float((model(val.inputs, 0.0, 0.0)[:, -1].argmax(-1) == val.targets).float().mean())
        assert r.summary["normal_acc"] == pytest.approx(normal, abs=1e-9)
        assert r.summary["zero_acc"] == pytest.approx(zero, abs=1e-9)


def test_linear_icl_and_markov_runs():
    r = train(tiny_config(task="linear_icl", path="fade600"))
    assert r.summary["metric"] == "mse"
    assert {"normal_mse", "zero_mse"} <= set(r.metrics[-1])
    assert r.summary["chance"] == 1.0
    m = train(tiny_config(task="markov", path="forced_zero", task_options={"p": 0.8}))
    assert m.summary["metric"] == "acc" and 0.0 <= m.summary["zero_acc"] <= 1.0


# ------------------------------------------------------------------ gates during training
def _fade_by_hand(i):  # Fade(start_step=4, width=8) from 0.5 to 0, linear
    u = min(max((i - 4) / 8, 0.0), 1.0)
    return 0.5 * (1.0 - u)


def test_scheduled_gates_follow_the_schedule(forward_calls):
    path = PathConfig(name="test_sched",
                      pos=GateConfig(mode="scheduled", schedule=Fade(start_step=4, width=8)),
                      content=GateConfig(mode="scheduled", schedule=HardSwitch(at=10, before=0.4, after=0.1)))
    cfg = tiny_config(path=path, eval_every=5)
    r = train(cfg)
    tc = training_calls(forward_calls)
    assert len(tc) == 20
    for i, (_, gp, gc, *_) in enumerate(tc):
        assert gp == pytest.approx(_fade_by_hand(i)), i
        assert gc == pytest.approx(0.4 if i < 10 else 0.1), i
    # logged at each evaluation: the gate of the last training step before it (step index = row step - 1)
    assert [row["step"] for row in r.metrics] == [5, 10, 15, 20]
    assert [row["g_pos"] for row in r.metrics] == pytest.approx([0.5, 0.1875, 0.0, 0.0])
    assert [row["g_content"] for row in r.metrics] == pytest.approx([0.4, 0.4, 0.1, 0.1])
    # evaluation: "normal" uses the model's own gates, "zero" forces both to 0
    evals = [c for c in forward_calls if c[0] == cfg.n_val]
    assert len(evals) == 2 * len(r.metrics)
    assert {applied(c) for c in evals} == {(None, None), (0.0, 0.0)}


def test_linear_path_reaches_zero_on_last_step(forward_calls):
    r = train(tiny_config(path="linear0.5->0"))
    tc = training_calls(forward_calls)
    got = [c[1] for c in tc]
    assert got == pytest.approx([0.5 * (1 - i / 19) for i in range(20)])
    assert r.metrics[-1]["g_pos"] == 0.0


def test_learned_gate_trains_forced_gate_does_not():
    init = build_model(tiny_config()).gate_logits.detach().clone()
    learned = train(tiny_config(path="unforced")).state_dict["gate_logits"]
    forced = train(tiny_config(path="forced_const0.5")).state_dict["gate_logits"]
    assert not torch.equal(learned, init)
    assert torch.equal(forced, init)


def test_unforced_logs_learned_gate_values():
    r = train(tiny_config(path="unforced"))
    g = torch.sigmoid(r.state_dict["gate_logits"])
    assert r.metrics[-1]["g_pos"] == pytest.approx(float(g[0].mean()))
    assert r.metrics[-1]["g_content"] == pytest.approx(float(g[1].mean()))


def test_prior_dropout_drops_some_steps(forward_calls):
    r = train(tiny_config(path="prior_dropout0.5", seed=0))
    gates = [applied(c) for c in training_calls(forward_calls)]
    assert len(gates) == 20
    assert set(gates) == {(None, None), (0.0, 0.0)}  # learned, or dropped to 0 (both gates together)
    assert r.summary["path"] == "prior_dropout0.5"
    # the dropout draws are seeded: the same run repeats them
    forward_calls.clear()
    train(tiny_config(path="prior_dropout0.5", seed=0))
    assert [applied(c) for c in training_calls(forward_calls)] == gates


def test_prior_dropout_on_scheduled_path(forward_calls):
    path = get_path("forced_const0.5").model_copy(update={"name": "fc_drop", "prior_dropout": 0.5})
    train(tiny_config(path=path))
    gates = {(c[1], c[2]) for c in training_calls(forward_calls)}
    assert gates == {(0.5, 0.5), (0.0, 0.0)}


def test_dual_loss_optimises_both_conditions(forward_calls):
    r = train(tiny_config(path="dual_loss"))
    tc = training_calls(forward_calls)
    assert len(tc) == 40  # two forwards per step
    for k in range(20):
        assert {applied(tc[2 * k]), applied(tc[2 * k + 1])} == {(None, None), (0.0, 0.0)}
        assert torch.equal(tc[2 * k][3], tc[2 * k + 1][3])  # on the same batch
    plain = train(tiny_config(path="unforced"))
    assert r.metrics[0]["train_loss"] > plain.metrics[0]["train_loss"]  # sum of two losses


# ------------------------------------------------------------------ gradient clipping
@pytest.fixture
def grad_norms(monkeypatch):
    """Record the global gradient norm the optimiser sees at every step."""
    norms = []
    orig = train_mod.make_optimizer

    def make(named_params, cfg, runs=1):
        opt = orig(named_params, cfg, runs)
        step = opt.step

        def recording_step(*a, **k):
            gs = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in gs]))))
            return step(*a, **k)

        opt.step = recording_step
        return opt

    monkeypatch.setattr(train_mod, "make_optimizer", make)
    return norms


def test_gradient_clipping_bounds_the_gradient_norm(grad_norms):
    train(tiny_config(grad_clip=None, steps=10))
    raw = list(grad_norms)
    assert len(raw) == 10
    clip = min(raw) / 4  # below every raw norm, so clipping must act on every step
    grad_norms.clear()
    train(tiny_config(grad_clip=clip, steps=10))
    assert len(grad_norms) == 10
    assert all(n <= clip * (1 + 1e-4) for n in grad_norms), (clip, grad_norms)
    assert all(n >= clip * 0.99 for n in grad_norms)  # clipped to the bound, not zeroed


def test_tiny_clip_bounds_the_update():
    """With AdamW the update per element is lr * m / (sqrt(v) + eps) <= lr * |g| / eps; with the
    global norm clipped to 1e-12 the weights can move by at most steps * lr * 1e-4."""
    steps = 3
    base = dict(steps=steps, weight_decay=0.0, eval_every=steps)
    init = build_model(tiny_config(**base)).state_dict()
    clipped = train(tiny_config(grad_clip=1e-12, **base)).state_dict
    free = train(tiny_config(grad_clip=None, **base)).state_dict
    move = lambda sd: max(float((sd[k] - init[k]).abs().max()) for k in init)  # noqa: E731
    assert move(clipped) < 1e-5
    assert move(free) > 1e-3


def test_grad_clip_validation():
    with pytest.raises(ValueError):
        tiny_config(grad_clip=0.0)
    with pytest.raises(ValueError):
        tiny_config(grad_clip=-1.0)


# ------------------------------------------------------------------ post hoc continuation
def _tiny_posthoc(steps=6):
    return get_path("posthoc").model_copy(update={"steps": steps})  # instead of 2,550 continuation steps


def test_posthoc_trains_parent_first_via_the_sweep_driver(store, train_calls):
    calls = train_calls
    cfg = tiny_config(path=_tiny_posthoc())
    parent_cfg = cfg.parent()
    assert parent_cfg.path.name == "unforced" and parent_cfg.total_steps == 20
    assert parent_cfg.path.pos.mode == parent_cfg.path.content.mode == "learned"

    summary = sweep_mod.run(cfg, store)
    assert [c[0].run_id for c in calls] == [parent_cfg.run_id, cfg.run_id]
    assert calls[0][1].get("init_state") is None
    parent_state = store.load_state(parent_cfg.run_id)
    assert state_dicts_equal(calls[1][1]["init_state"], parent_state)  # the child starts from the parent's final weights
    assert store.is_done(parent_cfg.run_id) and store.is_done(cfg.run_id)
    assert summary["steps"] == 6
    child_metrics = store.metrics(cfg.run_id)
    assert child_metrics[-1]["step"] == 6 and child_metrics[-1]["g_pos"] == 0.0
    assert not state_dicts_equal(store.load_state(cfg.run_id), parent_state)
    # the parent is an ordinary unforced run: its numbers are those of the unforced path
    plain = train(tiny_config(path="unforced"))
    assert state_dicts_equal(parent_state, plain.state_dict)

    sweep_mod.run(cfg, store)  # fully cached the second time
    assert len(calls) == 2


# Regression: the posthoc parent is PathConfig(name='unforced')
# with an empty description while the registered unforced path has a description, and the description
# is hashed into run_id, so posthoc retrains a duplicate unforced run instead of reusing it
def test_posthoc_reuses_the_unforced_run(store, train_calls):
    calls = train_calls
    sweep_mod.run(tiny_config(path="unforced"), store)
    cfg = tiny_config(path=_tiny_posthoc(4))
    assert cfg.parent().run_id == tiny_config(path="unforced").run_id
    sweep_mod.run(cfg, store)
    assert [c[0].path.name for c in calls] == ["unforced", "posthoc"]


# Regression: PathConfig.description (free text) is part of the run
# hash, so editing a path's help text changes every run id (NON_SEMANTIC_FIELDS only drops label and
# checkpoint_every)
def test_run_id_ignores_path_description():
    a = tiny_config(path=PathConfig(name="unforced"))
    b = tiny_config(path=PathConfig(name="unforced", description="reworded help text"))
    assert a.run_id == b.run_id


def test_clip_per_run_scales_each_run_by_its_own_global_norm():
    from softprior.training.loop import clip_per_run_
    # run 0: gradients (3, 4) and (12,) -> global norm sqrt(9 + 16 + 144) = 13 > 1: scaled by 1/13;
    # run 1: (0.3, 0.4) and (0,) -> norm 0.5 <= 1: unchanged; run 2 (max inf) never clipped
    a = torch.tensor([[3.0, 4.0], [0.3, 0.4], [30.0, 40.0]])
    b = torch.tensor([[12.0], [0.0], [1.0]])
    clip_per_run_([a, b], torch.tensor([1.0, 1.0, math.inf]))
    s = 1 / (13 + 1e-6)
    assert torch.allclose(a, torch.tensor([[3 * s, 4 * s], [0.3, 0.4], [30.0, 40.0]]))
    assert torch.allclose(b, torch.tensor([[12 * s], [0.0], [1.0]]))


def test_clip_per_run_leaves_runs_without_clipping_alone_even_at_overflow():
    from softprior.training.loop import clip_per_run_
    g = torch.tensor([[3e38, 3e38], [3.0, 4.0]])  # run 0's sum of squares overflows to inf
    clip_per_run_([g], torch.tensor([math.inf, 1.0]))
    assert torch.equal(g[0], torch.tensor([3e38, 3e38]))
    assert torch.allclose(g[1], torch.tensor([0.6, 0.8]))


def test_a_group_with_snapshots_refuses_checkpoints_it_could_not_resume():
    from softprior.training.engine import train_group
    cfgs = [tiny_config(seed=s, snapshot_every=5) for s in range(2)]
    with pytest.raises(ValueError, match="snapshots"):
        train_group(cfgs, on_checkpoint=lambda c: None)
    assert [st for st, _ in train_group(cfgs)[1].snapshots] == [0, 5, 10, 15, 20]  # without checkpoints: kept


def test_a_single_runs_checkpoint_feeds_the_analysis():
    from softprior.analysis import mechanism as A
    cfg = tiny_config(checkpoint_every=10)
    ckpts = []
    res = train(cfg, on_checkpoint=ckpts.append)
    df = A.trace([(10, ckpts[0]["tensors"]), (20, res.state_dict)], cfg, n_examples=16)
    assert sorted(df["step"].unique()) == [10, 20]


# a child that trains one run through the CLI and waits after its 4th step until Ctrl-C has been seen
_CHILD = """
import importlib, signal, sys, time
T = importlib.import_module("softprior.training.loop")
step = T.Runs.step
def waiting(self, i):
    out = step(self, i)
    if i == 3:
        print("STEP 4", flush=True)
        handler = signal.getsignal(signal.SIGINT)
        while not getattr(getattr(handler, "__self__", None), "pending", False):
            time.sleep(0.01)
    return out
T.Runs.step = waiting
from softprior.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_writes_a_checkpoint_says_where_and_the_run_resumes_from_it(tmp_path, capsys):
    """SIGINT during `softprior train`: the step in progress finishes, a checkpoint is written at it, the
    one-line message names the step the run resumes from, and the same command resumes there and ends
    bit-identical to an uninterrupted run."""
    import signal
    import subprocess
    import sys

    from softprior.cli import main
    from softprior.store import RunStore
    argv = ["train", "--path", "unforced", "--steps", "12", "--threads", "1", "--no-progress", "--json"]
    store = tmp_path / "s"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *argv, "--store", str(store)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "STEP 4"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130, err
    said = [line for line in err.splitlines()  # (the run's header above it, and the kernels' first-build notice)
            if line.startswith("softprior:") and "building the fused kernels" not in line]
    assert len(said) == 1 and "Traceback" not in err, err
    assert "softprior: interrupted: " in said[0] and "stopped after step 4 of 12" in said[0], said[0]
    assert "resumes it from step 4" in said[0], said[0]
    rid = said[0].split("run ")[1].split()[0]
    ck = RunStore(store).load_checkpoint(rid)
    assert ck is not None and ck["meta"]["step"] == 4 and ck["meta"]["interrupted"]
    assert not RunStore(store).is_done(rid)
    capsys.readouterr()
    assert main([*argv, "--store", str(store)]) == 0  # resumed
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["run_id"] == rid and resumed["resumed_at"] == 4
    assert main([*argv, "--store", str(tmp_path / "t")]) == 0  # uninterrupted
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "resumed_at" not in whole and whole["normal_acc"] == resumed["normal_acc"]
    (_, a), (_, b) = RunStore(store).load_model(rid), RunStore(tmp_path / "t").load_model(rid)
    assert state_dicts_equal(a.state_dict(), b.state_dict())


def test_a_float64_groups_forced_gates_stay_float64():
    """A forced gate value enters a float64 group as float64 (it was made float32 first, so 0.1 became
    0.100000001490116: a float64 run's gates differed from the value its path names)."""
    import importlib

    import torch

    from conftest import tiny_config
    T = importlib.import_module("softprior.training.loop")
    runs = T.Runs([tiny_config(path="unforced", seed=0), tiny_config(path="forced_zero", seed=1)])
    L, H = runs._LH
    own = torch.full((2, L, H), 0.3, dtype=torch.float64)
    g = runs._gate_tensor([(None, None), (0.1, 0.1)], 0, own)
    assert g.dtype == torch.float64
    assert torch.equal(g[0], own[0]) and torch.equal(g[1], torch.full((L, H), 0.1, dtype=torch.float64))
