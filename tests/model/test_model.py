"""The annealable soft-prior Transformer (SPEC section 2)."""

from __future__ import annotations

import math

import pytest
import torch

from softprior.model.config import ModelConfig, UnknownModelError, model_preset, size_label
from softprior.model.transformer import SoftPriorTransformer

B, T, V = 3, 32, 32


def make_model(seed=0, **kw) -> SoftPriorTransformer:
    torch.manual_seed(seed)
    return SoftPriorTransformer(model_preset(kw.pop("preset", "base"), **kw)).eval()


def tokens(b=B, t=T, seed=0, vocab=V):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def x():
    return tokens()


# ------------------------------------------------------------------ architecture
def test_param_counts():
    base = make_model()
    large = make_model(preset="large")
    assert 30_000 <= base.n_params() <= 40_000
    assert 240_000 <= large.n_params() <= 290_000
    assert base.n_params() == sum(p.numel() for p in base.parameters())
    assert (large.cfg.n_layers, large.cfg.d_model, large.cfg.n_heads) == (4, 128, 4)
    assert (base.cfg.n_layers, base.cfg.d_model, base.cfg.n_heads, base.cfg.n_ctx, base.cfg.vocab) == (2, 64, 4, 32, 32)


def test_unknown_preset():
    with pytest.raises(UnknownModelError) as ei:
        model_preset("huge")
    assert "huge" in str(ei.value) and "base" in str(ei.value) and "large" in str(ei.value)


def test_size_label_names_the_preset_by_depth_and_width():
    assert size_label(model_preset("base")) == "base"
    assert size_label(model_preset("large")) == "large"
    assert size_label(model_preset("base", n_heads=2)) == "base"  # heads do not change the label
    assert size_label(model_preset("base", n_layers=3)) == "L3d64"


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=63, n_heads=4)
    with pytest.raises(ValueError, match="prior_layers"):
        ModelConfig(n_layers=2, prior_layers=(2,))


def test_output_shape_and_tied_unembedding(model, x):
    logits, cache = model.run_with_cache(x)
    assert logits.shape == (B, T, V)
    # tied: logits = final-LN residual @ W_E^T
    torch.testing.assert_close(logits, cache["ln_final.hook_normalized"] @ model.embed.weight.T)
    assert not hasattr(model, "unembed") or model.unembed.weight is model.embed.weight


def test_embedding_init_std_is_one():
    m = make_model()
    assert 0.9 < float(m.embed.weight.detach().std()) < 1.1


def test_vector_io_model_for_linear_icl():
    torch.manual_seed(0)
    m = SoftPriorTransformer(model_preset("base", d_in=5, d_out=1))
    out = m(torch.randn(2, 31, 5))
    assert out.shape == (2, 31, 1)


def test_no_positional_information_at_zero_gate():
    """At g=0 a 1-layer model is NoPE: its last output ignores the order of the earlier tokens.
    With the prior on, the order matters."""
    m = make_model(n_layers=1)
    xx = tokens(2, 20)
    perm = torch.cat([torch.randperm(19, generator=torch.Generator().manual_seed(3)), torch.tensor([19])])
    xp = xx[:, perm]
    with torch.no_grad():
        torch.testing.assert_close(m(xx, 0.0, 0.0)[:, -1], m(xp, 0.0, 0.0)[:, -1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(m(xx, 1.0, 0.0)[:, -1], m(xp, 1.0, 0.0)[:, -1], atol=1e-3)


# ------------------------------------------------------------------ causality
@pytest.mark.parametrize("gates", [(None, None), (0.0, 0.0), (0.5, 0.5)])
def test_causal(model, x, gates):
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % V
    with torch.no_grad():
        a, b = model(x, *gates), model(x2, *gates)
    torch.testing.assert_close(a[:, :20], b[:, :20], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-4)


# ------------------------------------------------------------------ gates
def _perturbed(model, pos_bias=False, content=False):
    m = make_model()
    m.load_state_dict(model.state_dict())
    d, H, r = m.cfg.d_model, m.cfg.n_heads, m.cfg.content_rank
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for blk in m.blocks:
            if pos_bias:
                blk.attn.pos_bias.add_(3.0 * torch.randn(blk.attn.pos_bias.shape, generator=g))
            if content:  # the content-bias factors U, V are the last 2*H*r rows of the fused projection
                w = blk.attn.in_proj.weight
                assert w.shape[0] == 3 * d + 2 * H * r
                w[3 * d:].add_(torch.randn(w[3 * d:].shape, generator=g))
    return m


def test_zero_gates_ignore_prior_weights(model, x):
    mp, mc = _perturbed(model, pos_bias=True), _perturbed(model, content=True)
    with torch.no_grad():
        ref = model(x, 0.0, 0.0)
        torch.testing.assert_close(mp(x, 0.0, 0.0), ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(mc(x, 0.0, 0.0), ref, atol=1e-6, rtol=0)
        # the perturbations do matter when the gates are on (so the check above can fail)
        assert not torch.allclose(mp(x, 0.5, 0.5), model(x, 0.5, 0.5), atol=1e-3)
        assert not torch.allclose(mc(x, 0.5, 0.5), model(x, 0.5, 0.5), atol=1e-3)
        assert not torch.allclose(mp(x), model(x), atol=1e-3)  # learned gates start at 0.5


def test_gates_are_separate(model, x):
    mp, mc = _perturbed(model, pos_bias=True), _perturbed(model, content=True)
    with torch.no_grad():
        # content gate off: the content weights do not matter, the position bias does
        torch.testing.assert_close(mc(x, 0.5, 0.0), model(x, 0.5, 0.0), atol=1e-6, rtol=0)
        assert not torch.allclose(mp(x, 0.5, 0.0), model(x, 0.5, 0.0), atol=1e-3)
        # position gate off: the reverse
        torch.testing.assert_close(mp(x, 0.0, 0.5), model(x, 0.0, 0.5), atol=1e-6, rtol=0)
        assert not torch.allclose(mc(x, 0.0, 0.5), model(x, 0.0, 0.5), atol=1e-3)


def test_zero_gates_ignore_bias_hooks(model, x):
    """Layout-free version: replacing the bias tensors themselves changes nothing at gate 0, and
    each replacement does change the output once its own gate is on (so each check can fail: the
    content bias used to be observe-only, its replacement silently dropped)."""
    noise = lambda t, name: 5.0 * torch.randn_like(t)  # noqa: E731
    for kind, gates_on in (("hook_pos_bias", (0.5, 0.0)), ("hook_content_bias", (0.0, 0.5))):
        names = [n for n in model.hook_names() if n.endswith(kind)]
        assert len(names) == model.cfg.n_layers
        with torch.no_grad():
            ref, ref_on = model(x, 0.0, 0.0), model(x, *gates_on)
            with model.hooks([(n, noise) for n in names]):
                torch.testing.assert_close(model(x, 0.0, 0.0), ref, atol=1e-6, rtol=0)
                assert not torch.allclose(model(x, *gates_on), ref_on, atol=1e-3), kind


def test_replaced_content_bias_enters_the_logits_gated():
    """A hook that returns B^content unchanged (a copy) keeps the logits; one that returns 2 B^content
    equals doubling the content gate: the replacement sits exactly where B^content is in the equation."""
    m = _perturbed(make_model(), content=True)
    names = [n for n in m.hook_names() if n.endswith("hook_content_bias")]
    xx = tokens()
    with torch.no_grad():
        ref, doubled_gate = m(xx, 0.3, 0.2), m(xx, 0.3, 0.4)
        with m.hooks([(n, lambda t, name: t.clone()) for n in names]):  # unfused, same equation
            torch.testing.assert_close(m(xx, 0.3, 0.2), ref, atol=1e-4, rtol=1e-5)
        with m.hooks([(n, lambda t, name: 2.0 * t) for n in names]):
            torch.testing.assert_close(m(xx, 0.3, 0.2), doubled_gate, atol=1e-4, rtol=1e-5)
        assert not torch.allclose(ref, doubled_gate, atol=1e-2)


def test_replacing_an_observe_only_hook_is_an_error(model, x):
    """hook_result is computed for inspection; the forward uses hook_z. A replacement there used to
    be silently ignored."""
    from softprior.model.transformer import OBSERVE_ONLY_HOOKS, HookError
    assert OBSERVE_ONLY_HOOKS == ("hook_result",)
    name = "blocks.1.attn.hook_result"
    seen = []
    with torch.no_grad(), model.hooks([(name, lambda t, n: seen.append(t.shape))]):
        model(x)  # observing is fine
    assert seen == [(B, T, model.cfg.n_heads, model.cfg.d_model)]

    def zero_heads(t, n):
        return torch.zeros_like(t)
    with torch.no_grad(), model.hooks([(name, zero_heads)]):
        with pytest.raises(HookError, match=r"zero_heads.*blocks\.1\.attn\.hook_result.*observe-only.*hook_z"):
            model(x)


def test_learned_gates_start_at_half(model):
    gp, gc = model.gates()
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert gp.shape == gc.shape == (L, H)
    assert torch.allclose(gp, torch.full((L, H), 0.5)) and torch.allclose(gc, torch.full((L, H), 0.5))
    fp, fc = model.gates(0.25, 0.0)
    assert torch.equal(fp, torch.full((L, H), 0.25)) and torch.equal(fc, torch.zeros(L, H))


def test_forced_gate_equals_learned_gate_at_same_value(model, x):
    """sigmoid(0) = 0.5: the untrained learned gate and a forced 0.5 give the same logits."""
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, 0.5, 0.5))


@pytest.mark.parametrize("gran,shape", [("shared", (2, 1, 1)), ("layer", (2, 2, 1)), ("head", (2, 2, 4))])
def test_gate_granularity(gran, shape, x):
    m = make_model(gate_granularity=gran)
    assert m.gate_logits.shape == shape
    with torch.no_grad():
        m.gate_logits[0].fill_(-1e4)  # position gate -> 0
        m.gate_logits[1].fill_(-1e4)
        torch.testing.assert_close(m(x), m(x, 0.0, 0.0))


def test_per_layer_gate_tensor_is_per_layer_when_layers_equal_heads():
    """Large preset: L = H = 4. A forced [L] tensor must give layer l the value v[l] in every head
    (broadcasting it as [H] would give head h the value v[h] in every layer instead)."""
    m = make_model(preset="large")
    L, H = m.cfg.n_layers, m.cfg.n_heads
    assert L == H == 4
    v = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gp, gc = m.gates(v, 0.0)
    for l in range(L):
        for h in range(H):
            assert gp[l, h] == v[l], (l, h)
    assert torch.equal(gc, torch.zeros(L, H))
    # the spellings of "per layer" agree, "per head" is a different gate, [L, H] is taken as is
    assert torch.equal(m.gates(v[:, None])[0], gp)
    assert torch.equal(m.gates(v[None, :])[0], gp.T)
    full = torch.rand(L, H, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m.gates(full)[0], full)
    # and the forward uses it per layer: only layer 0's gate is on -> layers 1..3 see no prior
    xx = tokens()
    with torch.no_grad():
        only_l0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
        manual = torch.zeros(L, H)
        manual[0] = 1.0
        torch.testing.assert_close(m(xx, only_l0, 0.0), m(xx, manual, 0.0), atol=0, rtol=0)
        assert not torch.allclose(m(xx, only_l0, 0.0), m(xx, manual.T, 0.0), atol=1e-3)


@pytest.mark.parametrize("shape", [(3,), (2, 3), (4, 2), (1, 1, 4), (4,)])
def test_gate_tensor_of_a_wrong_shape_is_a_clear_error(model, shape):
    # base model: L = 2, H = 4. [4] (a per-head vector) is refused too: 1-D means per layer.
    with pytest.raises(ValueError, match=r"position gate tensor of shape .* L=2 layers and H=4 heads"):
        model.gates(torch.full(shape, 0.5), None)


def test_learned_gate_gets_gradient_forced_gate_does_not(x):
    m = make_model()
    m.train()
    y = tokens(B, 1, seed=9)[:, 0]
    loss = torch.nn.functional.cross_entropy(m(x)[:, -1], y)
    loss.backward()
    g = m.gate_logits.grad
    assert g is not None and g[0].abs().sum() > 0 and g[1].abs().sum() > 0

    m.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(m(x, 0.5, 0.5)[:, -1], y).backward()
    assert m.gate_logits.grad is None or torch.count_nonzero(m.gate_logits.grad) == 0
    # the bias tables are still learned under a forced (non-zero) gate
    assert m.blocks[0].attn.pos_bias.grad.abs().sum() > 0

    m.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(m(x, 0.5, None)[:, -1], y).backward()  # only pos forced
    g = m.gate_logits.grad
    assert g[0].abs().sum() == 0 and g[1].abs().sum() > 0


# ------------------------------------------------------------------ the positional prior
def test_locality_prior_on_layer_zero_only():
    m = make_model()
    H, n_ctx = m.cfg.n_heads, m.cfg.n_ctx
    b0 = m.blocks[0].attn.pos_bias.detach()
    assert b0.shape == (H, n_ctx)
    for h in range(H):
        for r in range(n_ctx):
            assert float(b0[h, r]) == -float((r - h) ** 2)
    assert float(b0[2, 2]) == 0.0 and float(b0[0, 31]) == -961.0
    for blk in m.blocks[1:]:
        assert torch.count_nonzero(blk.attn.pos_bias) == 0


def test_prior_init_options():
    m = make_model(prior_init="zero")
    assert all(torch.count_nonzero(b.attn.pos_bias) == 0 for b in m.blocks)
    m2 = make_model(prior_scale=2.0, prior_layers=(1,))
    assert torch.count_nonzero(m2.blocks[0].attn.pos_bias) == 0
    assert float(m2.blocks[1].attn.pos_bias.detach()[1, 4]) == -2.0 * 9


def test_offsets_beyond_context_clip_to_last_offset(model):
    L = 120
    xx = tokens(2, L, seed=1)
    with torch.no_grad():
        out, cache = model.run_with_cache(xx, 0.5, 0.5)
    assert out.shape == (2, L, V) and torch.isfinite(out).all()
    n_ctx = model.cfg.n_ctx
    for l in range(model.cfg.n_layers):
        table = model.blocks[l].attn.pos_bias.detach()
        pb = cache[f"blocks.{l}.attn.hook_pos_bias"]
        assert pb.shape == (model.cfg.n_heads, L, L)
        for i in (0, 5, 31, 32, 60, 119):
            for j in range(i + 1):
                want = table[:, min(i - j, n_ctx - 1)]
                assert torch.equal(pb[:, i, j], want), (l, i, j)


def test_runs_at_length_120_with_zero_gate(model):
    xx = tokens(2, 120, seed=2)
    with torch.no_grad():
        out = model(xx, 0.0, 0.0)
    assert out.shape == (2, 120, V) and torch.isfinite(out).all()


# ------------------------------------------------------------------ positions=
@pytest.mark.parametrize("length,pos", [(32, [31]), (32, [3, 17, 31]), (32, [0, 1, 2]), (120, [50, 119])])
@pytest.mark.parametrize("gates", [(None, None), (0.0, 0.0)])
def test_positions_match_full_forward(model, length, pos, gates):
    xx = tokens(4, length, seed=3)
    p = torch.tensor(pos)
    with torch.no_grad():
        full = model(xx, *gates)
        part = model(xx, *gates, positions=p)
    assert part.shape == (4, len(pos), V)
    torch.testing.assert_close(part, full[:, p], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ hooks and cache
def test_run_with_cache_returns_every_hook_with_documented_shapes(model, x):
    gp_val, gc_val = 0.3, 0.7
    with torch.no_grad():
        out, cache = model.run_with_cache(x, gp_val, gc_val)
    names = model.hook_names()
    assert set(cache) == set(names)
    assert any(n.endswith("hook_result") for n in names)
    H, dh, d = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    assert cache["hook_embed"].shape == (B, T, d)
    assert cache["ln_final.hook_normalized"].shape == (B, T, d)
    for l in range(model.cfg.n_layers):
        a = f"blocks.{l}.attn."
        assert cache[f"blocks.{l}.hook_resid_pre"].shape == (B, T, d)
        for n in ("hook_q", "hook_k", "hook_v", "hook_z"):
            assert cache[a + n].shape == (B, T, H, dh), n
        assert cache[a + "hook_pos_bias"].shape == (H, T, T)
        for n in ("hook_content_bias", "hook_attn_scores", "hook_pattern"):
            assert cache[a + n].shape == (B, H, T, T), n
        assert cache[a + "hook_result"].shape == (B, T, H, d)
        assert cache[f"blocks.{l}.hook_attn_out"].shape == (B, T, d)
        assert cache[f"blocks.{l}.hook_resid_post"].shape == (B, T, d)


def test_cached_intermediates_obey_the_papers_equation(model, x):
    """Recompute scores, pattern, z, per-head results and residuals from cached pieces."""
    gp_val, gc_val = 0.3, 0.7
    with torch.no_grad():
        _, c = model.run_with_cache(x, gp_val, gc_val)
    dh = model.cfg.d_head
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(model.cfg.n_layers):
        a = f"blocks.{l}.attn."
        q, k, v = c[a + "hook_q"], c[a + "hook_k"], c[a + "hook_v"]
        s = torch.einsum("bihe,bjhe->bhij", q, k) / math.sqrt(dh) \
            + gp_val * c[a + "hook_pos_bias"][None] + gc_val * c[a + "hook_content_bias"]
        scores = c[a + "hook_attn_scores"]
        torch.testing.assert_close(scores[..., causal], s[..., causal], atol=1e-4, rtol=1e-5)
        assert torch.isneginf(scores[..., ~causal]).all()
        pat = c[a + "hook_pattern"]
        torch.testing.assert_close(pat, torch.softmax(s.masked_fill(~causal, float("-inf")), -1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pat.sum(-1), torch.ones(B, model.cfg.n_heads, T))
        assert (pat[..., ~causal] == 0).all()
        z = torch.einsum("bhij,bjhe->bihe", pat, v)
        torch.testing.assert_close(c[a + "hook_z"], z, atol=1e-5, rtol=1e-4)
        # per-head results sum to the attention output
        torch.testing.assert_close(c[a + "hook_result"].sum(2), c[f"blocks.{l}.hook_attn_out"], atol=1e-5, rtol=1e-4)
        # residual stream bookkeeping
        torch.testing.assert_close(c[f"blocks.{l}.hook_resid_post"],
                                   c[f"blocks.{l}.hook_resid_pre"] + c[f"blocks.{l}.hook_attn_out"])
        # the content bias is a rank-r bilinear form
        sv = torch.linalg.svdvals(c[a + "hook_content_bias"].double())  # [B, H, T]
        r = model.cfg.content_rank
        assert (sv[..., r:] <= 1e-5 * sv[..., :1]).all() and (sv[..., r - 1] > 1e-3 * sv[..., 0]).all()
    torch.testing.assert_close(c["blocks.0.hook_resid_pre"], c["hook_embed"])
    torch.testing.assert_close(c["blocks.1.hook_resid_pre"], c["blocks.0.hook_resid_post"])


def test_run_with_cache_with_positions_and_filter(model, x):
    p = torch.tensor([31])
    with torch.no_grad():
        out, cache = model.run_with_cache(x, positions=p, names_filter="blocks.1.attn.hook_pattern")
    assert set(cache) == {"blocks.1.attn.hook_pattern"}
    assert cache["blocks.1.attn.hook_pattern"].shape == (B, model.cfg.n_heads, 1, T)
    with torch.no_grad():
        _, cache = model.run_with_cache(x, names_filter=["hook_embed", "blocks.0.attn.hook_result"])
    assert set(cache) == {"hook_embed", "blocks.0.attn.hook_result"}


def test_hook_replacing_z_changes_output_and_is_removed_after(model, x):
    with torch.no_grad():
        ref = model(x)
        with model.hooks([("blocks.1.attn.hook_z", lambda t, name: torch.zeros_like(t))]):
            ablated = model(x)
        after = model(x)
    assert not torch.allclose(ablated, ref, atol=1e-3)
    torch.testing.assert_close(after, ref, atol=0, rtol=0)


def test_zero_z_hook_equals_removing_attention_output(model, x):
    """Zeroing every head's z in the last layer leaves resid_post = resid_pre there."""
    with torch.no_grad():
        _, c = model.run_with_cache(x, names_filter=["blocks.1.hook_resid_pre"])
        with model.hooks([("blocks.1.attn.hook_z", lambda t, name: torch.zeros_like(t))]):
            out = model(x)
        want = model.ln_final(c["blocks.1.hook_resid_pre"]) @ model.embed.weight.T
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_observing_hook_returning_none_changes_nothing(model, x):
    seen = []
    with torch.no_grad():
        ref = model(x)
        with model.hooks([("blocks.0.attn.hook_pattern", lambda t, name: seen.append(name))]):
            out = model(x)
    assert seen == ["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_unknown_hook_name(model):
    with pytest.raises(KeyError, match="hook_nonsense"):
        with model.hooks([("blocks.0.attn.hook_nonsense", lambda t, n: t)]):
            pass


def test_pos_bias_past_the_training_length_is_clipped_or_zero():
    """offsets >= n_ctx (only at evaluation lengths > n_ctx): the last learned offset's value, or no bias"""
    import torch

    from softprior.model.transformer import SoftPriorTransformer
    from softprior.model.config import ModelConfig
    for beyond in ("clip", "zero"):
        cfg = ModelConfig(n_ctx=8, prior_init="bounded", prior_scale=1.0, prior_cap=3.0, pos_beyond=beyond)
        m = SoftPriorTransformer(cfg)
        _, cache = m.run_with_cache(torch.randint(0, 32, (1, 12)), names_filter="blocks.0.attn.hook_pos_bias")
        b = cache["blocks.0.attn.hook_pos_bias"]  # [H, 12, 12]
        table = m.blocks[0].attn.pos_bias.detach()
        assert torch.equal(b[:, 7, 0], table[:, 7])  # offset 7 < n_ctx: the table itself
        far = b[:, 11, 1]  # offset 10 >= n_ctx = 8
        assert torch.equal(far, table[:, 7] if beyond == "clip" else torch.zeros(cfg.n_heads))
        assert table[0, 7] == -3.0  # the bounded prior at head 0: -min((7 - 0)^2, 3)


def test_content_rank_zero_adds_no_parameters_for_the_content_bias():
    from softprior.model.transformer import SoftPriorTransformer
    from softprior.model.config import ModelConfig
    # QKVO attention (2 layers x 4 x 64 x 64) and one 32 x 64 embedding: 34,816, the paper's "about 35K";
    # then B^pos (2 x 4 x 32), three LayerNorms (3 x 128) and two gates: 35,460
    assert SoftPriorTransformer(ModelConfig(content_rank=0, gate_granularity="shared")).n_params() == 34816 + 256 + 384 + 2
    assert SoftPriorTransformer(ModelConfig(content_rank=2, gate_granularity="shared")).n_params() == 35458 + 2 * 2 * 4 * 2 * 64


def test_layernorm_placement_changes_where_the_stream_is_normalised():
    """pre: resid_post = resid_pre + attn(LN(resid_pre)); post: resid_post = LN(resid_pre + attn(resid_pre)),
    no final LayerNorm; none: no LayerNorm anywhere (the parameters of three LayerNorms, 3 x 2 x 64, gone)."""
    from softprior.model.transformer import SoftPriorTransformer
    from softprior.model.config import ModelConfig
    base = SoftPriorTransformer(ModelConfig(content_rank=0, gate_granularity="shared")).n_params()
    assert SoftPriorTransformer(ModelConfig(content_rank=0, gate_granularity="shared", norm="none")).n_params() == base - 384
    # post: two block LayerNorms, no final one
    assert SoftPriorTransformer(ModelConfig(content_rank=0, gate_granularity="shared", norm="post")).n_params() == base - 128
    x = torch.randint(0, 32, (3, 32), generator=torch.Generator().manual_seed(0))
    for norm in ("post", "none"):
        torch.manual_seed(0)
        m = SoftPriorTransformer(ModelConfig(norm=norm))
        with torch.no_grad():
            out, c = m.run_with_cache(x, 0.4, 0.6)
        for l in range(2):
            s = c[f"blocks.{l}.hook_resid_pre"] + c[f"blocks.{l}.hook_attn_out"]
            if norm == "post":  # LayerNorm by hand: zero mean, unit variance (eps 1e-5), then its affine
                ln = m.blocks[l].ln
                s = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + 1e-5)
                s = s * ln.weight + ln.bias
            torch.testing.assert_close(c[f"blocks.{l}.hook_resid_post"], s, atol=1e-5, rtol=1e-4)
        # no final LayerNorm: the unembedding reads the last block's output
        torch.testing.assert_close(out, c["blocks.1.hook_resid_post"] @ m.embed.weight.T)


@pytest.mark.parametrize("scale,factor", [("inverse_sqrt", 1 / 4), ("inverse", 1 / 16), ("one", 1.0)])
def test_attention_scale_multiplies_q_k(scale, factor):
    """d_head = 16: the logits are factor * q.k + g_pos B^pos + g_content B^content."""
    from softprior.model.transformer import SoftPriorTransformer
    from softprior.model.config import ModelConfig
    torch.manual_seed(0)
    m = SoftPriorTransformer(ModelConfig(attn_scale=scale))
    x = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, c = m.run_with_cache(x, 0.3, 0.7)
    causal = torch.tril(torch.ones(32, 32, dtype=torch.bool))
    a = "blocks.0.attn."
    s = factor * torch.einsum("bihe,bjhe->bhij", c[a + "hook_q"], c[a + "hook_k"]) \
        + 0.3 * c[a + "hook_pos_bias"][None] + 0.7 * c[a + "hook_content_bias"]
    torch.testing.assert_close(c[a + "hook_attn_scores"][..., causal], s[..., causal], atol=1e-4, rtol=1e-5)


def test_prior_gain_multiplies_a_familys_bias_and_is_refused_for_the_soft_table():
    """ALiBi on 4 heads: m_h = 2^(-2(h+1)), so head 0 puts -.25 |i - j| on each key; at prior_gain 4 the
    bias of query 2 on key 0 is 4 x -.25 x 2 = -2 (head 0) and 4 x -(1/16) x 2 = -.5 (head 1)."""
    x = tokens(1, 4)
    name = "blocks.0.attn.hook_pos_bias"
    b1 = make_model(prior_family="alibi").run_with_cache(x, names_filter=name)[1][name]
    b4 = make_model(prior_family="alibi", prior_gain=4.0).run_with_cache(x, names_filter=name)[1][name]
    assert b1[0, 2, 0].item() == pytest.approx(-0.5) and b4[0, 2, 0].item() == pytest.approx(-2.0)
    assert b4[1, 2, 0].item() == pytest.approx(-0.5)
    torch.testing.assert_close(b4, 4 * b1)
    with pytest.raises(ValueError, match="prior_gain"):
        ModelConfig(prior_gain=2.0)
