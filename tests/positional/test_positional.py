"""Positional schemes: each formula against values worked out by hand, plus shape/causality/vmap checks."""

import math

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from softprior.model.baselines import BASELINES, GATED_BASELINES, list_baselines, resolve_baseline
from softprior.paths import GateConfig
from softprior.positional import SCHEMES, make_scheme
from softprior.positional.base import UnknownSchemeError
from softprior.positional.bias import alibi_slopes, t5_bucket

DIMS = dict(n_heads=4, d_head=16, d_model=64, n_ctx=32, layer=0, n_layers=2)


def scheme(name, **kw):
    return make_scheme(name, **{**DIMS, **kw})


def attend(s, q, k, qpos=None, kpos=None):
    """The attention layer's calling sequence (see the positional module docstring) -> pattern."""
    T = k.shape[-2]
    kpos = torch.arange(T) if kpos is None else kpos
    qpos = kpos if qpos is None else qpos
    q, k = s.rotate(q, k, qpos, kpos)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits = s.adjust_logits(logits, q, k, qpos, kpos)
    logits = logits.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s.mix_pattern(logits.softmax(-1), qpos, kpos)


# ---------------------------------------------------------------------------------------- registry
def test_registry_lists_every_baseline():
    """The baselines are defined once, in softprior.model.baselines: SPEC's thirteen names (kerple is one
    baseline, kerple_log, with the kerple_power variant), every static one backed by a scheme."""
    import softprior.positional as positional
    assert not hasattr(positional, "BASELINES") and not hasattr(positional, "GATED_BASELINES")
    names = [n for n, _ in list_baselines()]
    assert names == BASELINES
    assert len(names) == len(set(names)) == 13  # 10 static schemes + 3 gated priors
    assert set(GATED_BASELINES) == {"soft_bias", "soft_pos_only", "soft_content_only"} < set(names)
    for n, (cls, desc) in SCHEMES.items():
        assert cls.name == n and desc
    for n in BASELINES:
        opts, path = resolve_baseline(n)
        if n in GATED_BASELINES:
            assert opts == {}
        else:
            assert opts["positional"] in SCHEMES and opts["prior"] is False
    assert resolve_baseline("kerple")[0]["positional"] == "kerple_log"
    assert resolve_baseline("kerple_power")[0]["positional"] == "kerple_power"
    zero = GateConfig(mode="fixed", value=0.0)
    assert resolve_baseline("soft_pos_only")[1].content == zero and resolve_baseline("soft_pos_only")[1].pos.mode == "learned"
    assert resolve_baseline("soft_content_only")[1].pos == zero


def test_make_scheme_errors_name_the_fix():
    with pytest.raises(UnknownSchemeError, match="allowed: vanilla"):
        scheme("sinusoidal")
    with pytest.raises(UnknownSchemeError, match="gated soft prior.*resolve_baseline"):
        scheme("soft_bias")
    with pytest.raises(ValueError, match="bad options"):
        scheme("alibi", npos=3)
    with pytest.raises(ValueError, match="L_init"):
        scheme("fire", L_init=512)


# ---------------------------------------------------------------------------------------- vanilla
def test_vanilla_table_covers_length_120_and_lives_on_layer_0():
    s0, s1 = scheme("vanilla", layer=0), scheme("vanilla", layer=1)
    e = s0.embed_positions(120)
    assert e.shape == (120, 64)
    assert torch.equal(e, s0.table[:120] * 64 ** -0.5)
    assert s1.embed_positions(120) is None and not list(s1.parameters())
    assert scheme("nope").embed_positions(32) is None  # valid on every scheme
    with pytest.raises(ValueError, match="max_len"):
        s0.embed_positions(129)


# ---------------------------------------------------------------------------------------- alibi
def test_alibi_slopes_by_hand():
    assert alibi_slopes(4) == [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    # 6 heads: p = 4 gives 1/4..1/256; the 8-head schedule is 1/2, 1/4, ..., 1/256 and every other
    # slope of it (1/2, 1/8, 1/32, 1/128) fills the last 6 - 4 = 2 heads
    assert alibi_slopes(6) == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]


def test_alibi_bias_matrix_T3():
    b = scheme("alibi").bias(torch.arange(3), torch.arange(3))
    dist = torch.tensor([[0.0, 1, 2], [1, 0, 1], [2, 1, 0]])
    for h, m in enumerate([1 / 4, 1 / 16, 1 / 64, 1 / 256]):
        assert torch.allclose(b[h], -m * dist)
    assert b[0, 2, 0] == -0.5


# ---------------------------------------------------------------------------------------- rope
def test_rope_rotates_every_pair_at_position_1():
    s = scheme("rope")
    x = torch.cat([torch.ones(8), torch.zeros(8)]).view(1, 1, 1, 16)  # pairs (x[k], x[k+8]) = (1, 0)
    out, _ = s.rotate(x, x, torch.tensor([1]), torch.tensor([1]))
    theta = [1.0, 10 ** -0.5, 0.1, 10 ** -1.5, 0.01, 10 ** -2.5, 0.001, 10 ** -3.5]  # 10000^(-2k/16)
    want = torch.tensor([math.cos(t) for t in theta] + [math.sin(t) for t in theta])
    assert torch.allclose(out.flatten(), want, atol=1e-6, rtol=1e-5)
    assert out.flatten()[15] > 3e-4  # the slowest pair rotates too (sin 10^-3.5)
    out0, _ = s.rotate(x, x, torch.tensor([0]), torch.tensor([0]))
    assert torch.equal(out0, x)


def test_rope_dot_product_depends_only_on_offset():
    g = torch.Generator().manual_seed(0)
    s = scheme("rope")
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def dot(i, j):
        qr, kr = s.rotate(q, k, torch.tensor([i]), torch.tensor([j]))
        return (qr * kr).sum().item()

    assert dot(5, 2) == pytest.approx(dot(10, 7), abs=1e-5)
    assert dot(5, 2) == pytest.approx(dot(103, 100), abs=1e-4)
    # by hand, pair k = (x[k], x[k+8]) at offset d: (q1 k1 + q2 k2) cos(d w_k) + (q1 k2 - q2 k1) sin(d w_k)
    q1, q2, k1, k2 = q.flatten()[:8], q.flatten()[8:], k.flatten()[:8], k.flatten()[8:]
    w = 10000.0 ** (-torch.arange(8) / 8)
    for d in (0, 1, 3, 40):
        want = ((q1 * k1 + q2 * k2) * torch.cos(d * w) + (q1 * k2 - q2 * k1) * torch.sin(d * w)).sum()
        assert dot(d + 7, 7) == pytest.approx(want.item(), abs=1e-4)


# ---------------------------------------------------------------------------------------- kerple
def test_kerple_values_by_hand():
    pos = torch.arange(5)
    s = scheme("kerple_log")
    with torch.no_grad():
        s.r1.fill_(2.0), s.r2.fill_(0.5)
    b = s.bias(pos, pos)
    assert b[0, 3, 0].item() == pytest.approx(-2 * math.log(2.5))  # -r1 log(1 + r2 * 3)
    assert b[1, 4, 4].item() == 0.0
    p = scheme("kerple_power")
    with torch.no_grad():
        p.r1.fill_(2.0), p.r2.fill_(0.5)
    b = p.bias(pos, pos)
    assert b[0, 4, 0].item() == pytest.approx(-4.0)  # -2 * 4^0.5
    assert b[0, 3, 2].item() == pytest.approx(-2.0)  # -2 * 1^0.5
    assert b[0, 1, 1].item() == 0.0


def test_kerple_clamps_negative_params_and_keeps_gradients():
    pos = torch.arange(4)
    for name in ("kerple_log", "kerple_power"):
        s = scheme(name)
        with torch.no_grad():
            s.r1.fill_(-1.0), s.r2.fill_(-3.0)
        b = s.bias(pos, pos)
        assert (b <= 0).all()
        d = 3.0
        want = -0.01 * math.log1p(0.01 * d) if name == "kerple_log" else -0.01 * d ** 0.01
        assert b[0, 3, 0].item() == pytest.approx(want, rel=1e-5)
        b.sum().backward()  # straight-through: gradients reach the raw parameters, finite at i = j
        assert torch.isfinite(s.r1.grad).all() and torch.isfinite(s.r2.grad).all()
        assert (s.r1.grad != 0).all()
        assert (s.r1 == -1.0).all()  # the forward never mutates the weights
    p = scheme("kerple_power")
    with torch.no_grad():
        p.r1.fill_(1.0), p.r2.fill_(5.0)
    assert p.bias(pos, pos)[0, 3, 0].item() == pytest.approx(-9.0)  # r2 clamped to 2: -3^2


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_init_follows_the_reference(name):
    """chijames/KERPLE draws bias_p ~ U(0, 2) first, then bias_a ~ U(0, 1). Log kernel
    -p log(1 + a|i-j|): multiplier r1 = p, r2 = a. Power kernel -a|i-j|^p: multiplier r1 = a,
    exponent r2 = p (ours had them swapped: exponent U(0, 1), multiplier U(0, 2))."""
    H = 64  # many heads: the ranges show
    torch.manual_seed(3)
    s = make_scheme(name, n_heads=H, d_head=1, d_model=H, n_ctx=32, layer=0, n_layers=1)
    torch.manual_seed(3)
    p, a = torch.rand(H) * 2.0, torch.rand(H)  # the reference's draws, in its order
    multiplier, inner = (p, a) if name == "kerple_log" else (a, p)
    assert torch.equal(s.r1.detach(), multiplier) and torch.equal(s.r2.detach(), inner)
    if name == "kerple_power":
        assert float(s.r2.detach().max()) > 1.0 and float(s.r1.detach().max()) <= 1.0  # exponent over (0, 2), multiplier (0, 1)


# ---------------------------------------------------------------------------------------- fire
def test_fire_normaliser_uses_max_of_query_position_and_L():
    s = scheme("fire", n_ctx=4)  # L = |1 * 4| = 4, c = 0.1
    pos = torch.arange(8)
    nd = s.normalized_distance(pos, pos)
    psi = lambda x: math.log(0.1 * x + 1)  # noqa: E731
    assert nd[6, 2].item() == pytest.approx(psi(4) / psi(6), rel=1e-5)  # i = 6 > L: psi(i)
    assert nd[2, 0].item() == pytest.approx(psi(2) / psi(4), rel=1e-5)  # i = 2 < L: psi(L)
    assert nd[4, 0].item() == pytest.approx(1.0, rel=1e-5)
    assert nd[7, 0].item() == pytest.approx(1.0, rel=1e-5)  # beyond L: still in [0, 1]
    assert nd[1, 3].item() == 0.0  # future offsets clamped at 0
    with torch.no_grad():
        s.L_mult.fill_(-2.0)  # L = |-2 * 4| = 8
    nd = s.normalized_distance(pos, pos)
    assert nd[6, 2].item() == pytest.approx(psi(4) / psi(8), rel=1e-5)
    # the MLP is applied to the normalised distance: make it the identity on head 0
    with torch.no_grad():
        for lin in (s.mlp[0], s.mlp[2]):
            lin.weight.zero_(), lin.bias.zero_()
        s.mlp[0].weight[0, 0] = 1.0
        s.mlp[2].weight[0, 0] = 1.0
    b = s.bias(pos, pos)
    assert torch.allclose(b[0], nd.clamp(min=0)) and (b[1:] == 0).all()


# ---------------------------------------------------------------------------------------- cope
def test_cope_positions_count_gates_and_ignore_masked_ones():
    s = scheme("cope")
    pos = torch.arange(3)
    # huge logits everywhere (future keys included): gates ~ 1 on allowed keys, p_ij = i - j + 1
    p = s.positions(torch.full((1, 1, 3, 3), 50.0), pos, pos)[0, 0]
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0], [2, 1, 0], [3, 2, 1]]))
    # had the future gates been counted, row 0 would be [3, 2, 1]
    p = s.positions(torch.zeros(1, 1, 3, 3), pos, pos)[0, 0]  # gates 1/2
    assert torch.allclose(p, torch.tensor([[0.5, 0, 0], [1, 0.5, 0], [1.5, 1, 0.5]]))
    small = scheme("cope", npos=2)
    p = small.positions(torch.full((1, 1, 3, 3), 50.0), pos, pos)[0, 0]
    assert p.max().item() == 1.0  # clamped to npos - 1


def test_cope_logit_term_interpolates_position_embeddings():
    s = scheme("cope", d_head=4, d_model=16)  # 1/sqrt(dh) = 1/2
    pos = torch.arange(3)
    with torch.no_grad():
        s.pos_emb.zero_()
        s.pos_emb[0] = torch.arange(s.npos, dtype=torch.float32) ** 2  # z[n] = n^2 for q = e_0
    q = torch.tensor([1.0, 0, 0, 0]).expand(1, 1, 3, 4)
    logits = torch.zeros(1, 1, 3, 3)  # gates 1/2: p = [[.5], [1, .5], [1.5, 1, .5]]
    e = (s.adjust_logits(logits, q, q, pos, pos) - logits)[0, 0] * 2
    # e(p) = z[ceil p] frac + z[floor p] (1 - frac): e(.5) = .5, e(1) = 1, e(1.5) = .5 * 4 + .5 * 1
    want = torch.tensor([[0.5, 0, 0], [1, 0.5, 0], [2.5, 1, 0.5]])
    assert torch.allclose(e, want)
    assert scheme("cope").npos == 33  # n_ctx + 1, the reference default


# ---------------------------------------------------------------------------------------- t5
def test_t5_buckets_by_hand():
    n = torch.tensor([0, 1, 15, 16, 17, 20, 31, 32, 64, 100, 127, 128, 1000, -5])
    # n >= 16: 16 + floor(log(n/16) / log(8) * 16), capped at 31; negative offsets (future) -> 0
    want = torch.tensor([0, 1, 15, 16, 16, 17, 21, 21, 26, 30, 31, 31, 31, 0])
    assert torch.equal(t5_bucket(n), want)


def test_t5_bias_is_the_table_entry_unscaled_and_clipped():
    s = scheme("t5")
    with torch.no_grad():
        s.table.copy_(torch.arange(32 * 4, dtype=torch.float32).view(32, 4))
    qpos, kpos = torch.tensor([0, 20, 100]), torch.arange(101)
    b = s.bias(qpos, kpos)  # (H, 3, 101)
    assert b[2, 1, 0].item() == s.table[17, 2].item()  # offset 20 -> bucket 17, no sqrt(dh) factor
    assert b[1, 2, 100].item() == s.table[0, 1].item()
    assert b[0, 2, 50].item() == s.table[21, 0].item()  # offset 50 (bucket 24) clipped to 31 -> 21
    assert b[0, 2, 0].item() == s.table[21, 0].item()


# ---------------------------------------------------------------------------------------- gpsa
def test_gpsa_mix_is_causal_row_stochastic_and_positional_at_full_gate():
    s = scheme("gpsa")
    pos = torch.arange(3)
    content = torch.tensor([[1.0, 0, 0], [0.3, 0.7, 0], [0.2, 0.3, 0.5]]).expand(2, 4, 3, 3)
    a = s.mix_pattern(content, pos, pos)
    assert torch.allclose(a.sum(-1), torch.ones(2, 4, 3))
    assert (a.triu(1) == 0).all()
    # head 0 (centred on offset 0), row 2: scores -delta^2 over delta = 2, 1, 0 -> e^-4, e^-1, 1
    e1, e4 = math.exp(-1), math.exp(-4)
    pos0 = torch.tensor([e4, e1, 1.0]) / (1 + e1 + e4)
    g = torch.sigmoid(torch.tensor(1.0))  # init l_h = 1: 0.73 of the weight on position
    assert torch.allclose(a[0, 0, 2], (1 - g) * content[0, 0, 2] + g * pos0, atol=1e-6)
    with torch.no_grad():
        s.gating.fill_(50.0)  # sigmoid = 1: all weight on the positional softmax
    a = s.mix_pattern(content, pos, pos)
    assert torch.allclose(a[0, 0, 2], pos0, atol=1e-6)
    # head 1 is centred on offset 1: scores -(delta - 1)^2 over delta = 2, 1, 0 -> e^-1, 1, e^-1
    assert torch.allclose(a[0, 1, 2], torch.tensor([e1, 1.0, e1]) / (1 + 2 * e1), atol=1e-6)
    # row 1 (delta = 1, 0 -> 1, e^-1) and the masked future key gets nothing
    assert torch.allclose(a[0, 1, 1], torch.tensor([1.0, e1, 0.0]) / (1 + e1), atol=1e-6)
    assert torch.allclose(a[0, 1, 0], torch.tensor([1.0, 0, 0]))


# ---------------------------------------------------------------------------------------- dape
def test_dape_shape_and_reduces_to_x_plus_base_when_f_is_zero():
    s = scheme("dape")
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(5)
    x = torch.randn(2, 4, 5, 5, generator=g)
    out = s.adjust_logits(x, None, None, pos, pos)
    assert out.shape == x.shape
    with torch.no_grad():
        s.f[2].weight.zero_(), s.f[2].bias.zero_()
    assert torch.allclose(s.adjust_logits(x, None, None, pos, pos), x + s.base.bias(pos, pos))
    assert isinstance(s.base, SCHEMES["kerple_log"][0])


# ---------------------------------------------------------------------------------------- all schemes
@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_runs_at_32_and_120_causally(name):
    torch.manual_seed(0)
    s = scheme(name)
    B, H, dh = 2, 4, 16
    for T in (32, 120):
        emb = s.embed_positions(T)
        assert emb is None or (emb.shape == (T, 64) and torch.isfinite(emb).all())
        q, k = torch.randn(B, H, T, dh), torch.randn(B, H, T, dh)
        a = attend(s, q, k)
        assert a.shape == (B, H, T, T) and torch.isfinite(a).all()
        assert torch.allclose(a.sum(-1), torch.ones(B, H, T), atol=1e-5)
        assert (a.triu(1) == 0).all()
        # changing the future keys must not change the past rows (no leak through adjust/mix)
        t = T // 2
        k2 = k.clone()
        k2[:, :, t:] += torch.randn(B, H, T - t, dh)
        assert torch.allclose(attend(s, q, k2)[:, :, :t], a[:, :, :t], atol=1e-6)
        # queries at a subset of positions (the model's last layer) give the same rows
        sub = torch.tensor([3, T - 1])
        assert torch.allclose(attend(s, q[:, :, sub], k, qpos=sub), a[:, :, sub], atol=1e-5)
    # gradients reach every parameter and are finite
    a = attend(s, q.requires_grad_(), k)
    loss = (a * torch.randn_like(a)).sum() + (0 if emb is None else emb.square().sum())
    loss.backward()
    for n, p in s.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("name", [n for n in SCHEMES if list(scheme(n).parameters())])
def test_schemes_run_under_vmap_over_stacked_params(name):
    torch.manual_seed(0)
    models = [scheme(name), scheme(name)]
    params, _ = stack_module_state(models)
    pipe = _Pipeline(models[0])
    q, k = torch.randn(2, 1, 4, 8, 16), torch.randn(2, 1, 4, 8, 16)

    def run(p, q, k):
        return functional_call(pipe, {f"s.{n}": v for n, v in p.items()}, (q, k))

    out = vmap(run)(params, q, k)
    for i, m in enumerate(models):
        assert torch.allclose(out[i], _Pipeline(m)(q[i], k[i]), atol=1e-5)


class _Pipeline(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, q, k):
        emb = self.s.embed_positions(k.shape[-2])
        a = attend(self.s, q, k)
        return a if emb is None else a + emb.sum()


def test_kerple_computes_in_the_models_dtype():
    """In a float64 model both kernels are the formulas of Chi et al. 2022 in float64, worked out here
    per entry: -r1 log(1 + r2 |i-j|) and -r1 |i-j|^r2 (the power kernel took log |i-j| in float32:
    ~1e-3 off at T = 120). In float32 they stay float32."""
    r1 = [0.7123456789012345, 1.3141592653589793, 0.0123456789, 1.9876543210987654]
    r2 = [0.3333333333333333, 1.7182818284590452, 0.0501234567890123, 1.2345678901234567]
    kernels = {"kerple_log": lambda a, c, d: -a * math.log(1 + c * d),
               "kerple_power": lambda a, c, d: -a * d ** c if d else 0.0}
    pos = torch.arange(120)
    for name, kernel in kernels.items():
        s = scheme(name).double()
        with torch.no_grad():
            s.r1.copy_(torch.tensor(r1, dtype=torch.float64)), s.r2.copy_(torch.tensor(r2, dtype=torch.float64))
        b = s.bias(pos, pos)
        want = torch.tensor([[[kernel(r1[h], r2[h], abs(i - j)) for j in range(120)] for i in range(120)]
                             for h in range(4)], dtype=torch.float64)
        assert b.dtype == torch.float64
        assert torch.allclose(b, want, rtol=1e-13, atol=1e-13), (name, (b - want).abs().max().item())
        assert scheme(name).bias(pos, pos).dtype == torch.float32


def test_gpsa_computes_in_the_models_dtype():
    """GPSA's positional scores w_h1 (i-j) + w_h2 (i-j)^2 in a float64 model (float32 offsets met float64
    weights and raised)."""
    s = scheme("gpsa").double()
    w = s.pos_proj.weight.detach()
    pos = torch.arange(40)
    got = s.pos_scores(pos, pos)
    d = (pos[:, None] - pos[None, :]).to(torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, (w[:, 0, None, None] * d + w[:, 1, None, None] * d * d))


def test_rope_computes_in_the_models_dtype():
    """RoPE's angles in a float64 model: cos/sin of t / 10000^(2k/dh) in float64, worked out here (float32
    angles were 1.7e-6 off by t = 119). The fast path reads the same tables."""
    s = scheme("rope")
    pos = torch.arange(120)
    cos, sin = s.angles(pos, "cpu", torch.float64)
    want = torch.tensor([[math.cos(t / 10000 ** (2 * k / 16)) for k in range(8)] for t in range(120)],
                        dtype=torch.float64)
    assert cos.dtype == torch.float64 and torch.allclose(cos, want, rtol=0, atol=1e-13)
    assert torch.allclose(sin, torch.tensor([[math.sin(t / 10000 ** (2 * k / 16)) for k in range(8)]
                                             for t in range(120)], dtype=torch.float64), rtol=0, atol=1e-13)
    q = torch.randn(1, 4, 120, 16, dtype=torch.float64)
    rq, _ = s.rotate(q, q, pos, pos)
    x1, x2 = q[..., :8], q[..., 8:]
    assert torch.allclose(rq, torch.cat([x1 * want - x2 * sin, x1 * sin + x2 * want], -1), rtol=0, atol=1e-12)
    assert s.angles(pos, "cpu")[0].dtype == torch.float32
