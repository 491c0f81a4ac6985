"""The fused, run-stacked forward (model/fastpath.py) against the readable model (model/transformer.py): same
logits and same gradients, to 1e-5, on random weights, for several runs stacked at once.

Computed in float64 so that 1e-5 tests the algebra, not float32 rounding (the re-associations
change the order of sums; in float32 the two agree to ~1e-5 relative)."""

from __future__ import annotations

import pytest
import torch
from torch.func import stack_module_state

from softprior.config import make_run_config
from softprior.model.fastpath import fast_forward, model_forward, supports
from softprior.tasks.generators import make_task
from softprior.model.transformer import build_model

# markov-determined: loss on most positions, where the last layer runs the plain way (not re-associated)
CASES = [("assoc_recall", "shared", 2), ("assoc_recall", "head", 1), ("markov", "head", 3),
         ("linear_icl", "layer", 2), ("markov-determined", "layer", 2)]


def _random_models(task, granularity, n_layers, n_runs=3, **model_options):
    task, _, variant = task.partition("-")
    task_options = dict(loss_on=variant) if variant else None
    # the plain defaults (not the pre-registered ones, whose prior layers need n_layers >= 2)
    cfgs = [make_run_config(task, "unforced", s, task_options=task_options, calibrated=False,
                            model_options=dict(gate_granularity=granularity, n_layers=n_layers, **model_options))
            for s in range(n_runs)]
    return cfgs, _perturbed([build_model(c).double() for c in cfgs], seed=7)


def _perturbed(models, seed: int):
    """``models`` with noise added to every parameter, so that nothing is trivial: LayerNorm affine,
    prior tables, content factors, gates."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return models


def _batch_and_params(cfgs, models):
    """A batch of 8 (float64 inputs for vector tasks), the loss positions, and the models' parameters
    stacked on a run dimension with gradients on."""
    t = make_task(cfgs[0].task)
    T = cfgs[0].model.n_ctx
    batch = t.sample(8, T, torch.Generator().manual_seed(1))
    inputs = batch.inputs.double() if batch.inputs.is_floating_point() else batch.inputs
    params, _ = stack_module_state(models)
    return inputs, t.loss_positions(T), {k: v.detach().requires_grad_(True) for k, v in params.items()}


def _assert_same_logits_and_gradients(fast, ref, params, models, missing_is_zero=False):
    """Logits equal to 1e-5, then every stacked parameter's gradient of a random projection equal to
    the readable models' (``missing_is_zero``: a gradient absent on either side counts as zeros)."""
    assert fast.shape == ref.shape
    assert torch.allclose(fast, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=ref.dtype)
    (fast * w).sum().backward()
    (ref * w).sum().backward()
    for name, p in params.items():
        grads = [dict(m.named_parameters())[name] for m in models]
        if missing_is_zero:
            want = torch.stack([q.grad if q.grad is not None else torch.zeros_like(q) for q in grads])
            got = p.grad if p.grad is not None else torch.zeros_like(p)
        else:
            want, got = torch.stack([q.grad for q in grads]), p.grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), name


def _assert_learned_gates_match(cfgs, models, missing_is_zero=False):
    """With learned gates (the gate values carry gradient back to the gate logits in both computations),
    the fast forward's logits and gradients are the readable models'; returns the stacked parameters."""
    inputs, pos, params = _batch_and_params(cfgs, models)
    g_all = torch.sigmoid(params["gate_logits"])
    K, L, H = len(cfgs), cfgs[0].model.n_layers, cfgs[0].model.n_heads
    gp, gc = g_all[:, 0].expand(K, L, H), g_all[:, 1].expand(K, L, H)
    fast = fast_forward(params, cfgs[0].model, inputs, gp, gc, pos)
    ref = torch.stack([m(inputs, positions=pos) for m in models])
    _assert_same_logits_and_gradients(fast, ref, params, models, missing_is_zero)
    return params


@pytest.mark.parametrize("task,granularity,n_layers", CASES)
def test_fast_forward_matches_the_readable_model_in_logits_and_gradients(task, granularity, n_layers):
    _assert_learned_gates_match(*_random_models(task, granularity, n_layers))


@pytest.mark.parametrize("task", ["assoc_recall", "linear_icl", "markov-determined"])
@pytest.mark.parametrize("norm,attn_scale", [("none", "inverse_sqrt"), ("pre", "one"), ("none", "inverse")])
def test_fast_forward_without_layernorm_or_with_another_attention_scale_matches(task, norm, attn_scale):
    """The identification search's architecture axes on the fast path: no LayerNorm (ones and zeros
    folded in), and 1/d_head or 1 on Q K^T, against the readable model."""
    cfgs, models = _random_models(task, "shared", 2, n_runs=2, norm=norm, attn_scale=attn_scale)
    assert supports(cfgs[0].model)
    _assert_learned_gates_match(cfgs, models)


def test_post_layernorm_runs_in_the_readable_model():
    cfg = make_run_config("assoc_recall", "unforced", 0, model_options=dict(norm="post"))
    assert not supports(cfg.model)
    assert supports(cfg.model.model_copy(update=dict(norm="pre")))


def test_model_forward_uses_the_readable_model_for_hooks():
    # an additive bias, nothing, an absolute table, a rotation, a contextual logit or pattern
    for name in FAST_SCHEMES + CONTEXTUAL_SCHEMES:
        assert supports(make_run_config("assoc_recall", baseline=name).model), name
    assert supports(make_run_config("assoc_recall").model)
    m = build_model(make_run_config("assoc_recall"))
    tokens = torch.randint(0, m.cfg.vocab, (4, 32))
    pos = torch.tensor([31])
    seen = []
    with m.hooks([("blocks.0.attn.hook_pattern", lambda x, name: seen.append(name))]):
        out = model_forward(m, tokens, 0.3, None, pos)
    assert seen == ["blocks.0.attn.hook_pattern"]  # the hook fired: the readable model ran
    assert torch.allclose(out, model_forward(m, tokens, 0.3, None, pos), atol=1e-5)


def test_fast_forward_with_a_forced_gate_differs_from_zero_gate():
    """A check that the gates reach the computation at all (a fast path that ignored them would pass
    a test run only at the model's own gates if those happened to be irrelevant)."""
    cfgs, models = _random_models("assoc_recall", "shared", 2, n_runs=1)
    m = models[0]
    tokens = torch.randint(0, m.cfg.vocab, (4, 32))
    pos = torch.tensor([31])
    for gates in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)]:
        assert torch.allclose(model_forward(m, tokens, *gates, pos), m(tokens, *gates, positions=pos), atol=1e-8)
    assert not torch.allclose(model_forward(m, tokens, 1.0, 0.0, pos), model_forward(m, tokens, 0.0, 0.0, pos))


def test_fast_forward_beyond_the_training_length_matches_the_readable_model():
    """Length generalisation evaluates at T > n_ctx: both paths clip the relative offsets the same way."""
    cfgs, models = _random_models("assoc_recall", "shared", 2, n_runs=1)
    m = models[0]
    tokens = torch.randint(0, m.cfg.vocab, (4, 3 * m.cfg.n_ctx), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([tokens.shape[1] - 1])
    assert torch.allclose(model_forward(m, tokens, 0.7, 0.4, pos), m(tokens, 0.7, 0.4, positions=pos),
                          rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ static schemes on the fast path
FAST_SCHEMES = ["nope", "alibi", "t5", "kerple", "kerple_power", "fire", "vanilla", "rope"]
CONTEXTUAL_SCHEMES = ["cope", "dape", "gpsa"]  # tested below: they read the content


def _scheme_models(task, baseline, n_runs=2, n_layers=2):
    task, _, variant = task.partition("-")
    cfgs = [make_run_config(task, seed=s, baseline=baseline, calibrated=False,
                            task_options=dict(loss_on=variant) if variant else None,
                            model_options=dict(n_layers=n_layers)) for s in range(n_runs)]
    return cfgs, _perturbed([build_model(c).double() for c in cfgs], seed=11)  # the scheme's parameters too


@pytest.mark.parametrize("baseline", FAST_SCHEMES)
@pytest.mark.parametrize("task", ["assoc_recall", "markov-determined", "linear_icl"])
def test_static_schemes_on_the_fast_path_match_the_readable_model(baseline, task):
    """Logits and every gradient, the scheme's parameters included, to 1e-5 in float64 (the
    re-associated last layer on assoc / linear ICL, the plain one on Markov-determined and under RoPE;
    layer 0 on the vocabulary except under vanilla's absolute positions)."""
    cfgs, models = _scheme_models(task, baseline)
    inputs, pos, params = _batch_and_params(cfgs, models)
    L, H = cfgs[0].model.n_layers, cfgs[0].model.n_heads
    zeros = torch.zeros(2, L, H, dtype=torch.float64)  # prior off: gates 0, as the readable model's
    fast = fast_forward(params, cfgs[0].model, inputs, zeros, zeros, pos)
    ref = torch.stack([m(inputs, positions=pos) for m in models])
    _assert_same_logits_and_gradients(fast, ref, params, models, missing_is_zero=True)
    scheme = [n for n in params if ".scheme." in n]
    if baseline in ("t5", "kerple", "kerple_power", "fire", "vanilla"):  # learned: the gradient reached it
        used = [n for n in scheme if not (baseline == "vanilla" and not n.startswith("blocks.0."))]
        assert used and all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in used)
    else:
        assert not scheme



@pytest.mark.parametrize("baseline", FAST_SCHEMES + CONTEXTUAL_SCHEMES)
def test_static_schemes_beyond_the_training_length_match_the_readable_model(baseline):
    """The length test evaluates at T = 120 > n_ctx through ``model_forward``: each scheme's own rule
    beyond the training length (T5's clipped buckets, vanilla's extra rows, RoPE's new angles, CoPE's
    clamped counts, DAPE's Kerple base, GPSA's quadratic) holds."""
    cfgs, models = _scheme_models("assoc_recall", baseline, n_runs=1)
    m = models[0]
    tokens = torch.randint(0, m.cfg.vocab, (4, 120), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([119])
    with torch.no_grad():
        assert torch.allclose(model_forward(m, tokens, None, None, pos), m(tokens, positions=pos), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ contextual schemes on the fast path

@pytest.mark.parametrize("baseline", CONTEXTUAL_SCHEMES)
@pytest.mark.parametrize("task", ["assoc_recall", "markov-determined", "linear_icl"])
def test_contextual_schemes_on_the_fast_path_match_the_readable_model(baseline, task):
    """Logits and every gradient, the scheme's parameters included, to 1e-5 in float64, with K = 2
    (vmapped over the runs) and K = 1 (each run alone, no vmap): the re-associated last layer on assoc
    (one loss position) and linear ICL (16 of 32), the plain one on Markov-determined (every position),
    layer 0 on the vocabulary on the token tasks."""
    from softprior.model.fastpath import _scheme_kind
    for K in (2, 1):
        cfgs, models = _scheme_models(task, baseline, n_runs=K)
        inputs, pos, params = _batch_and_params(cfgs, models)
        L, H = cfgs[0].model.n_layers, cfgs[0].model.n_heads
        zeros = torch.zeros(K, L, H, dtype=torch.float64)  # prior off: gates 0, as the readable model's
        fast = fast_forward(params, cfgs[0].model, inputs, zeros, zeros, pos)
        ref = torch.stack([m(inputs, positions=pos) for m in models])
        _assert_same_logits_and_gradients(fast, ref, params, models, missing_is_zero=True)
        scheme = [n for n in params if ".scheme." in n]
        assert {n.split(".")[1] for n in scheme} == {str(l) for l in range(L)}  # every layer has its scheme
        # DAPE's last bias adds one constant to a whole softmax row: its true gradient is 0 (rounding only)
        flat = [n for n in scheme if n.endswith(".scheme.f.2.bias")]
        assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in scheme if n not in flat), scheme
        assert all(params[n].grad.abs().max() < 1e-10 for n in flat), flat
    assert _scheme_kind(cfgs[0].model.positional) in ("logits", "pattern")


@pytest.mark.parametrize("baseline", CONTEXTUAL_SCHEMES)
def test_contextual_schemes_with_the_content_prior_on_match_the_readable_model(baseline):
    """The scheme receives the logits with the content factors folded in (the readable model's
    ``scores``) and the prior's gated bias comes after ``adjust_logits``: with both gates forced on
    (not a baseline's setting, but the same function) the two computations still agree."""
    cfgs = [make_run_config("assoc_recall", "unforced", s, calibrated=False, model_options=dict(positional=baseline))
            for s in range(2)]
    assert cfgs[0].model.prior
    models = _perturbed([build_model(c).double() for c in cfgs], seed=11)
    inputs, pos, params = _batch_and_params(cfgs, models)
    L, H = cfgs[0].model.n_layers, cfgs[0].model.n_heads
    gp = torch.full((2, L, H), 0.7, dtype=torch.float64)
    gc = torch.full((2, L, H), 0.4, dtype=torch.float64)
    fast = fast_forward(params, cfgs[0].model, inputs, gp, gc, pos)
    ref = torch.stack([m(inputs, 0.7, 0.4, positions=pos) for m in models])
    _assert_same_logits_and_gradients(fast, ref, params, models, missing_is_zero=True)


FAMILIES = ["alibi", "t5", "kerple_log", "kerple_power", "fire"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", ["assoc_recall", "markov-determined"])
def test_every_registered_prior_family_on_the_fast_path_matches_the_readable_model(family, task):
    """A family's B^pos, evaluated once per layer per run and given to the attention as data under the
    gate, gives the readable model's logits and every gradient, the family's own parameters included,
    to 1e-5 in float64 (the re-associated last layer on assoc, the plain one on Markov-determined)."""
    cfgs, models = _random_models(task, "head", 2, prior_family=family, prior_layers=[0, 1])
    assert supports(cfgs[0].model)
    params = _assert_learned_gates_match(cfgs, models, missing_is_zero=True)  # (the unused soft table: no gradient)
    own = [n for n in params if ".prior_module." in n]
    assert (len(own) > 0) == (family != "alibi")
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in own)


@pytest.mark.parametrize("family", ["alibi", "t5"])
def test_a_family_at_another_strength_on_the_fast_path_matches_the_readable_model(family):
    """prior_gain (the family's B^pos times 4 here) as the fast path applies it (``_family_bias``) and the
    readable model does: the same logits and gradients, on the plain last layer and the re-associated one."""
    for task in ("assoc_recall", "markov-determined"):
        cfgs, models = _random_models(task, "head", 2, prior_family=family, prior_layers=[0, 1], prior_gain=4.0)
        assert cfgs[0].model.prior_gain == 4.0 and supports(cfgs[0].model)
        _assert_learned_gates_match(cfgs, models, missing_is_zero=True)


def test_a_plugin_family_on_the_fast_path_matches_and_one_that_replaces_b_content_does_not_run_there():
    import torch.nn as nn
    from softprior.model.fastpath import engine
    from softprior.model.priors import PositionalPrior, PRIORS, register_prior

    class Window(PositionalPrior):  # a learned Gaussian window over the offset, per head
        def __init__(self, cfg, layer):
            super().__init__(cfg, layer)
            self.width = nn.Parameter(torch.linspace(1.0, 3.0, cfg.n_heads))

        def bias(self, qpos, kpos):
            off = (qpos[:, None] - kpos[None, :]).clamp(min=0).to(self.width.dtype)
            return -(off[None] / self.width[:, None, None]) ** 2

    class Content(Window):
        def content_bias(self, xq, xk):
            return None

    try:
        register_prior("test_window", Window, "a test family", overwrite=True)
        register_prior("test_content", Content, "a test family with its own B^content", overwrite=True)
        cfgs, models = _random_models("assoc_recall", "shared", 2, prior_family="test_window", prior_layers=[0, 1])
        assert supports(cfgs[0].model)
        params = _assert_learned_gates_match(cfgs, models, missing_is_zero=True)
        assert all(params[n].grad.abs().sum() > 0 for n in params if n.endswith("prior_module.width"))
        cfg, _ = _random_models("assoc_recall", "shared", 2, n_runs=1, prior_family="test_content")
        kind, why = engine(cfg[0].model, True, 32, 1)
        assert not supports(cfg[0].model) and kind == "readable" and "content_bias" in why
    finally:
        for name in ("test_window", "test_content"):
            PRIORS._entries.pop(name, None)

