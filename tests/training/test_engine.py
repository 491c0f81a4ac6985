"""The fast paths against the readable definitions: grouped training equals single runs, and our
model equals the plain reference model (softprior/reference.py) in logits and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from softprior.training.engine import group_key, train_group
from softprior.training.loop import train

from conftest import tiny_config


def _load_reference():
    from softprior import reference
    return reference


def test_runs_trained_in_a_group_match_runs_trained_alone():
    cfgs = [tiny_config(path="unforced", seed=0, grad_clip=0.05),  # clipping is per run: this one clips hard
            tiny_config(path="fade600", seed=1),
            tiny_config(path="hard_switch10", seed=2),
            tiny_config(path="prior_dropout", seed=3),
            tiny_config(path="dual_loss", seed=4),
            tiny_config(path="forced_zero", seed=5)]
    grouped = train_group(cfgs)
    for cfg, g in zip(cfgs, grouped):
        alone = train(cfg)
        assert len(alone.metrics) == len(g.metrics)
        for ra, rg in zip(alone.metrics, g.metrics):
            assert ra.keys() == rg.keys()
            for k in ra:
                # 1e-5 absolute, or relative for large values: a loss of ~75 has a float32 ulp of
                # 7.6e-6, and the grouped kernels may round differently from the single-run ones
                assert ra[k] == pytest.approx(rg[k], rel=1e-5, abs=1e-5), (cfg.path.name, k)
        for name, w in alone.state_dict.items():
            assert torch.allclose(w, g.state_dict[name], atol=1e-5), (cfg.path.name, name)


@pytest.mark.parametrize("task", ["assoc_recall", "markov"])
def test_a_group_killed_mid_run_resumes_bit_identically(task):
    # a learned gate, a fade (the gate moves across the checkpoint), prior dropout (a generator
    # per run besides the data) and the dual loss; eval every 4, checkpoint every 10: the checkpoint
    # falls inside an evaluation window, so the running loss sum must survive too
    cfgs = [tiny_config(task, path=p, seed=s, eval_every=4, checkpoint_every=10)
            for s, p in enumerate(["unforced", "fade600", "prior_dropout0.5", "dual_loss"])]
    ckpts = []
    full = train_group(cfgs, on_checkpoint=lambda c: ckpts.append(copy.deepcopy(c)))
    assert [c["meta"]["step"] for c in ckpts] == [10] and ckpts[0]["meta"]["run_ids"] == [c.run_id for c in cfgs]
    resumed = train_group(cfgs, resume=ckpts[0])
    for a, b in zip(full, resumed):
        assert a.metrics == b.metrics
        assert all(torch.equal(a.state_dict[n], b.state_dict[n]) for n in a.state_dict)
    # the checkpoint names its runs: another group (other order) refuses it
    with pytest.raises(ValueError, match="another group"):
        train_group(cfgs[::-1], resume=ckpts[0])


def test_a_group_checkpoints_by_wall_time():
    cfgs = [tiny_config(seed=s) for s in range(2)]
    steps = []
    train_group(cfgs, on_checkpoint=lambda c: steps.append(c["meta"]["step"]), checkpoint_seconds=0.0)
    assert steps == list(range(1, cfgs[0].total_steps))  # every step but the last (the result is saved then)


def test_group_rejects_configs_with_different_shapes():
    with pytest.raises(ValueError, match="differ only"):
        train_group([tiny_config(), tiny_config(batch_size=8)])
    assert group_key(tiny_config(seed=0, path="unforced")) == group_key(tiny_config(seed=3, path="fade600"))


def _copy_into_reference(ours, ref, d=64, H=4, r=2):
    W = ours.embed.weight.detach()
    with torch.no_grad():
        ref.embed.weight.copy_(W)
        for l, blk in enumerate(ours.blocks):
            a, ra = blk.attn, ref.attns[l]
            Win = a.in_proj.weight
            ra.q.weight.copy_(Win[:d]); ra.k.weight.copy_(Win[d:2 * d]); ra.v.weight.copy_(Win[2 * d:3 * d])
            ra.cu.weight.copy_(Win[3 * d:3 * d + H * r]); ra.cw.weight.copy_(Win[3 * d + H * r:])
            ra.o.weight.copy_(a.out_proj.weight)
            ra.pos_bias.copy_(a.pos_bias)
            ref.lns[l].weight.copy_(blk.ln.weight); ref.lns[l].bias.copy_(blk.ln.bias)
        ref.ln_f.weight.copy_(ours.ln_final.weight); ref.ln_f.bias.copy_(ours.ln_final.bias)
        ref.gate_logits.copy_(ours.gate_logits.view(2))


def test_model_matches_the_plain_reference_in_logits_and_gradients():
    from softprior.model.transformer import build_model
    cfg = tiny_config()
    ours = build_model(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random, non-trivial weights everywhere (prior tables, content factors, gates)
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    ref = _load_reference().RefModel()
    _copy_into_reference(ours, ref)
    tokens = torch.randint(0, 32, (8, 32), generator=g)
    lo, lr = ours(tokens), ref(tokens)
    assert torch.allclose(lo, lr, atol=1e-5, rtol=1e-5)
    # the last-layer-at-loss-positions path too
    assert torch.allclose(ours(tokens, positions=torch.tensor([31]))[:, 0], lr[:, -1], atol=1e-5, rtol=1e-5)
    targets = torch.randint(0, 32, (8,), generator=g)
    torch.nn.functional.cross_entropy(ours(tokens, positions=torch.tensor([31]))[:, 0], targets).backward()
    torch.nn.functional.cross_entropy(ref(tokens)[:, -1], targets).backward()
    d, H, r = 64, 4, 2
    for l, blk in enumerate(ours.blocks):
        gin, ra = blk.attn.in_proj.weight.grad, ref.attns[l]
        ref_in = torch.cat([ra.q.weight.grad, ra.k.weight.grad, ra.v.weight.grad, ra.cu.weight.grad, ra.cw.weight.grad])
        assert torch.allclose(gin, ref_in, atol=1e-5, rtol=1e-4)
        assert torch.allclose(blk.attn.pos_bias.grad, ra.pos_bias.grad, atol=1e-5, rtol=1e-4)
        assert torch.allclose(blk.attn.out_proj.weight.grad, ra.o.weight.grad, atol=1e-5, rtol=1e-4)
    assert torch.allclose(ours.embed.weight.grad, ref.embed.weight.grad, atol=1e-5, rtol=1e-4)
    assert torch.allclose(ours.gate_logits.grad.view(2), ref.gate_logits.grad, atol=1e-5, rtol=1e-4)


def test_a_model_without_prior_trains_at_zero_gates_in_a_group_as_alone():
    """``prior=False`` means gates 0 (``SoftPriorTransformer.gates``), whatever the path says. The
    grouped engine used to take sigmoid(logit) = 0.5 for learned gates instead: with
    ``positional="none"`` a grouped run then trained with the soft prior on while a single run did not."""
    cfgs = [tiny_config(path="unforced", seed=s, model_options={"prior": False, "positional": "none"})
            for s in (0, 1)]
    grouped = train_group(cfgs)
    for cfg, g in zip(cfgs, grouped):
        alone = train(cfg)
        for name, w in alone.state_dict.items():
            assert torch.allclose(w, g.state_dict[name], atol=1e-5), name
        for ra, rg in zip(alone.metrics, g.metrics):
            # prior off: normal evaluation is the zero-gate evaluation, in both engines
            assert rg["normal_acc"] == rg["zero_acc"] and ra["normal_acc"] == ra["zero_acc"]
            assert ra["train_loss"] == pytest.approx(rg["train_loss"], rel=1e-5, abs=1e-5)
    # and the prior table (which gates 0 never reach) gets no gradient: it keeps its initial value
    from softprior.model.transformer import build_model
    init = build_model(cfgs[0]).state_dict()
    assert torch.equal(grouped[0].state_dict["blocks.0.attn.pos_bias"], init["blocks.0.attn.pos_bias"])


@pytest.mark.parametrize("baseline", ["rope", "kerple", "soft_pos_only", "cope", "dape", "gpsa"])
def test_static_and_gated_baselines_in_a_group_match_runs_alone(baseline):
    """The fast path with a rotation (rope), a learned static bias (kerple), gates (soft_* baselines)
    and a contextual scheme (cope, dape, gpsa: the scheme vmapped over the group's runs, called once
    per run alone) takes its per-step gates from the same rules as loop.train (loop.step_gates),
    and a run trained in a group matches it trained alone.

    DAPE's MLP biases are compared to lr x steps only: the output bias adds a constant to every logit
    of a head's row, which the softmax cancels, so its gradient is zero but for rounding (and the
    first layer's bias nearly so: the softmax gradient sums to zero over a row); AdamW's normalised
    step turns those rounding-level gradients into steps of up to ~lr, different in a group and alone
    (the vmapped readable model did the same). The losses and every other weight agree to 1e-5."""
    cfgs = [tiny_config(seed=s, baseline=baseline, steps=10, eval_every=5) for s in (0, 1)]
    flat = (".scheme.f.0.bias", ".scheme.f.2.bias") if baseline == "dape" else ()
    for cfg, g in zip(cfgs, train_group(cfgs)):
        alone = train(cfg)
        for ra, rg in zip(alone.metrics, g.metrics):
            assert ra.keys() == rg.keys()
            for k in ra:
                assert ra[k] == pytest.approx(rg[k], rel=1e-5, abs=1e-5), (baseline, k)
        for name, w in alone.state_dict.items():
            atol = cfg.lr * cfg.total_steps if name.endswith(flat) else 1e-5
            assert torch.allclose(w, g.state_dict[name], atol=atol), (baseline, name)


def test_a_group_is_stacked_before_it_moves_to_its_device():
    # the models are built on the CPU and stacked there; only then do the weights move (here to the
    # "meta" device, which needs no accelerator): moving the first model before stacking mixed devices
    from softprior.training.loop import Runs
    runs = Runs([tiny_config(seed=s) for s in range(2)], device="meta")
    assert all(p.device.type == "meta" and p.shape[0] == 2 for p in runs.params.values())
    assert next(runs.base.parameters()).device.type == "meta"
