"""Tests of softprior.analysis on hand-built models whose circuits are known by construction."""

import math

import pandas as pd
import pytest
import torch

from softprior.analysis import mechanism as A
from softprior.config import make_run_config
from softprior.model.config import ModelConfig
from softprior.model.transformer import SoftPriorTransformer
from softprior.tasks.generators import Batch, make_task
from softprior.tasks.registry import AssocRecallConfig, MarkovConfig

LN_S = math.sqrt(1 + 1e-5)  # nn.LayerNorm's eps: LN(x) = x / LN_S for a zero-mean, unit-variance x
D, H, DH, V, T = 64, 4, 16, 32, 32
GATES = (1.0, 0.0)  # the hand-built previous-token head uses the position prior


def _zeroed(cfg: ModelConfig) -> SoftPriorTransformer:
    m = SoftPriorTransformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for blk in m.blocks:
            blk.ln.weight.fill_(1.0)
        m.ln_final.weight.fill_(1.0)
    return m


def recall_cfg() -> ModelConfig:
    return ModelConfig(n_layers=2, n_heads=H, d_model=D, n_ctx=T, vocab=V, content_rank=1, prior_init="zero")


def hand_recall_model() -> SoftPriorTransformer:
    """A hand-wired 2-layer associative-recall circuit (keys 1..15, values 16..31, one-hot embeddings
    in dims 0..31):

    - L0H0: previous-token head (B^pos[0, offset 1] = 20 at g_pos = 1) copying the previous token's
      key dims 0..15 into dims 32..47 ("previous key");
    - L1H0: query = own key dims, key = "previous key" dims, so the query key attends to the value
      that follows the same key; it copies that value's dims 16..31 with a large W_O -> the answer.
    - L0H1 (attends to itself), L0H2 and L1H1 (uniform) write small vectors into the unused dims
      48..63; L0H3 and L1H2-3 have W_O = 0.
    """
    m = _zeroed(recall_cfg())
    e = torch.arange(DH)
    with torch.no_grad():
        m.embed.weight[:, :V] = torch.eye(V)
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        a0.pos_bias[0, 1] = 20.0
        a0.in_proj.weight[2 * D + e, e] = 1.0
        a0.out_proj.weight[32 + e, 0 * DH + e] = 0.125
        a0.pos_bias[1, 0] = 20.0
        a0.in_proj.weight[2 * D + DH + e, e] = 1.0
        a0.out_proj.weight[48 + e, DH + e] = 0.1
        a0.in_proj.weight[2 * D + 2 * DH + e, 16 + e] = 1.0
        a0.out_proj.weight[48 + e, 2 * DH + e] = 0.1
        a1.in_proj.weight[e, e] = 2.0
        a1.in_proj.weight[D + e, 32 + e] = 2.0
        a1.in_proj.weight[2 * D + e, 16 + e] = 1.0
        a1.out_proj.weight[16 + e, e] = 10.0
        a1.in_proj.weight[2 * D + DH + e, e] = 1.0
        a1.out_proj.weight[48 + e, DH + e] = 0.1
    return m


@pytest.fixture(scope="module")
def recall():
    task = make_task(AssocRecallConfig(n_pairs=8, vocab=V, n_keys=15))
    batch = task.sample(128, T, torch.Generator().manual_seed(0))
    return hand_recall_model(), task, batch


@pytest.fixture(scope="module")
def importance(recall):
    m, task, b = recall
    return A.ablation_importance(m, task, b, gates=GATES)


# ------------------------------------------------------------------------ mean ablation (required)
def test_hand_built_circuit_solves_the_task(recall):
    m, task, b = recall
    with torch.no_grad():
        assert float(task.score(m(b.inputs, *GATES), b.targets)) == 1.0


def test_mean_ablation_only_the_circuit_heads_matter(importance):
    imp = importance
    assert imp.shape == (2, H)
    # without the previous-key writer or the value copier the model falls to about chance (1/8)
    assert imp[0, 0] > 0.6 and imp[1, 0] > 0.6
    others = [imp[l, h] for l in range(2) for h in range(H) if h != 0]
    assert all(abs(float(x)) < 1e-9 for x in others), imp


def test_mean_ablation_uses_the_batch_mean(recall):
    m, task, b = recall
    same = b.inputs[:1].repeat(8, 1)  # every example identical: the batch mean is the example itself
    with torch.no_grad():
        clean = m(same, *GATES)
    for layer in range(2):
        torch.testing.assert_close(A.mean_ablation(m, same, layer, 0, *GATES), clean, rtol=1e-6, atol=1e-5)
    # a real batch: ablating the copier changes the answer logits, but not the logits before layer 1
    abl = A.mean_ablation(m, b.inputs, 1, 0, *GATES)
    with torch.no_grad():
        assert (abl - m(b.inputs, *GATES)).abs().max() > 1.0
    with pytest.raises(IndexError):
        A.mean_ablation(m, b.inputs, 0, H, *GATES)


def test_mean_ablation_defaults_to_zero_gate(recall):
    m, _, b = recall
    same = b.inputs[:1].repeat(4, 1)
    with torch.no_grad():
        zero, gated = m(same, 0.0, 0.0), m(same, *GATES)
    assert (zero - gated).abs().max() > 1e-3  # L0H0 has no prior at zero gate: a different model
    torch.testing.assert_close(A.mean_ablation(m, same, 0, 1), zero, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------------ successor-value mass
def test_successor_mass_is_one_for_the_copying_head(recall):
    m, task, b = recall
    mass = A.successor_value_mass(m, b, task, *GATES)
    assert mass.shape == (2, H)
    assert mass[1, 0] > 0.999
    assert mass[0, 3] == 0 and mass[1, 2] == 0  # W_O = 0: no contribution at all
    # L0H0 reads the previous token of the query (the last value): the answer 1 time in 8
    assert 0.03 < mass[0, 0] < 0.25
    # L1H1 is uniform over 32 positions and its value reads key dims only: nothing from the answer
    assert mass[1, 1] < 0.01


def test_answer_mask_assoc_recall():
    task = make_task(AssocRecallConfig(n_pairs=2, vocab=8, n_keys=3))
    # [PAD, PAD, k1 v1 k2 v2, q]: keys 1..3, values 4..7
    x = torch.tensor([[0, 0, 1, 5, 3, 7, 3], [0, 0, 2, 4, 1, 6, 2]])
    mask = A.answer_mask(task, Batch(x, torch.tensor([7, 4])))
    assert mask.tolist() == [[False] * 5 + [True, False], [False, False, False, True, False, False, False]]
    # two queries [.. q1 q2]: targets [B, 2], the mask marks the final query's answer, read at the end
    two = make_task(AssocRecallConfig(n_pairs=2, vocab=8, n_keys=3, n_queries=2))
    x2 = torch.tensor([[0, 1, 5, 3, 7, 1, 3], [0, 2, 4, 1, 6, 1, 2]])
    mask2 = A.answer_mask(two, Batch(x2, torch.tensor([[5, 7], [6, 4]])))
    assert mask2.tolist() == [[False] * 4 + [True, False, False], [False, False, True] + [False] * 4]


def test_answer_mask_markov():
    task = make_task(MarkovConfig(p=0.5, vocab=10))
    x = torch.tensor([[3, 5, 7, 3, 9, 3],      # a = 3, s(a) = 5: only x_1 follows a 3 with a 5
                      [3, 5, 3, 5, 2, 3],      # two occurrences: positions 1 and 3
                      [4, 1, 4, 2, 4, 4]])     # a = 4, s(a) = 2: position 3 (position 5 is the query)
    mask = A.answer_mask(task, Batch(x, torch.tensor([5, 5, 2])))
    assert mask.int().tolist() == [[0, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]]
    with pytest.raises(ValueError):
        A.answer_mask(task, Batch(x, torch.tensor([8, 5, 2])))  # 8 never follows the query token


# ------------------------------------------------------------------------ value contributions
def tiny_model() -> SoftPriorTransformer:
    """1 layer, 2 heads of size 2, d_model 4, vocab 3. Embeddings have zero mean and unit variance, so
    LN(x) = x / LN_S. Head 0: value = dims (0, 1), W_O^0 = diag(1, 3) onto dims (0, 1), prior weights
    1:2:3 on offsets 0, 1, 2. Head 1: value = dims (2, 3), W_O^1 maps its first value dim to dim 0
    with weight 2, uniform attention."""
    m = _zeroed(ModelConfig(n_layers=1, n_heads=2, d_model=4, n_ctx=3, vocab=3, content_rank=1, prior_init="zero"))
    r2 = math.sqrt(2.0)
    with torch.no_grad():
        m.embed.weight.copy_(torch.tensor([[r2, 0, 0, -r2], [0, r2, -r2, 0], [1.0, 1, -1, -1]]))
        a = m.blocks[0].attn
        for i in range(4):  # V block rows 8..11: head 0 <- dims 0,1; head 1 <- dims 2,3
            a.in_proj.weight[8 + i, i] = 1.0
        a.out_proj.weight[0, 0] = 1.0  # head 0, value dim 0 -> residual dim 0
        a.out_proj.weight[1, 1] = 3.0  # head 0, value dim 1 -> residual dim 1
        a.out_proj.weight[0, 2] = 2.0  # head 1, value dim 0 -> residual dim 0
        a.pos_bias[0] = torch.tensor([0.0, math.log(2), math.log(3)])
    return m


def test_head_value_contributions_by_hand():
    m = tiny_model()
    x = torch.tensor([[0, 1, 2], [2, 2, 1]])
    c = A.head_value_contributions(m, x, 0, gate_pos=1.0, gate_content=0.0)
    assert c.shape == (2, 2, 3)
    # ||v W_O^0||: token 0 -> sqrt2, 1 -> 3 sqrt2, 2 -> sqrt10;  ||v W_O^1||: 0 -> 0, 1 -> 2 sqrt2, 2 -> 2
    n0 = [math.sqrt(2), 3 * math.sqrt(2), math.sqrt(10)]
    n1 = [0.0, 2 * math.sqrt(2), 2.0]
    w0 = [3 / 6, 2 / 6, 1 / 6]  # query 2 attends to offsets 2, 1, 0 with weights 3:2:1
    expected = torch.tensor([[[w0[j] * n0[t] for j, t in enumerate(row)], [n1[t] / 3 for t in row]]
                             for row in ([0, 1, 2], [2, 2, 1])]) / LN_S
    torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-6)
    # query position 1: weights 2:1 on positions 0, 1 and nothing from the future
    c1 = A.head_value_contributions(m, x, 0, query_pos=1, gate_pos=1.0, gate_content=0.0)
    torch.testing.assert_close(c1[0, 0], torch.tensor([2 / 3 * n0[0], 1 / 3 * n0[1], 0.0]) / LN_S, rtol=1e-5, atol=1e-6)
    # per-example query positions
    cq = A.head_value_contributions(m, x, 0, query_pos=torch.tensor([1, 2]), gate_pos=1.0, gate_content=0.0)
    torch.testing.assert_close(cq[0], c1[0])
    torch.testing.assert_close(cq[1], c[1])
    # at zero gate head 0 is uniform too
    cz = A.head_value_contributions(m, x, 0, gate_pos=0.0, gate_content=0.0)
    torch.testing.assert_close(cz[0, 0], torch.tensor(n0) / 3 / LN_S, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ pattern scores
def positional_model(offsets: dict[int, int], n_ctx: int = 16) -> SoftPriorTransformer:
    """1 layer, 4 heads; head h with offsets[h] = k attends (at g_pos = 1) to position i - k; the
    others are uniform (Q = K = 0, no prior)."""
    m = _zeroed(ModelConfig(n_layers=1, n_heads=4, d_model=16, n_ctx=n_ctx, vocab=20, content_rank=1,
                            prior_init="zero"))
    with torch.no_grad():
        m.embed.weight.normal_(generator=torch.Generator().manual_seed(0))
        for h, k in offsets.items():
            m.blocks[0].attn.pos_bias[h, k] = 30.0
    return m


def test_previous_token_score():
    m = positional_model({0: 1, 1: 0, 2: 3})
    x = torch.randint(0, 20, (4, 12), generator=torch.Generator().manual_seed(1))
    s = A.previous_token_score(m, x, 1.0, 0.0)
    assert s.shape == (1, 4)
    assert s[0, 0] > 0.999
    assert s[0, 1] < 1e-6
    # head 2 attends to i-3 where it can; for i = 1, 2 only positions 0..i exist and offsets != 3
    # all have bias 0, so it is uniform over i+1 keys there
    torch.testing.assert_close(s[0, 2], torch.tensor((1 / 2 + 1 / 3) / 11), rtol=1e-5, atol=1e-6)
    uniform = sum(1 / (i + 1) for i in range(1, 12)) / 11
    torch.testing.assert_close(s[0, 3], torch.tensor(uniform), rtol=1e-5, atol=1e-7)


def test_prior_profile_by_hand():
    """One layer, every head's table 2 ln 3 at offset 0 and 0 elsewhere, at g_pos = .5: g B = ln 3 on the
    query's own key. Over T = 3: query 1 puts 3/4 on itself and 1/4 on key 0, both within {i, i - 1}:
    locality 1; query 2 puts 3/5 on itself and 1/5 on each other key: 4/5 on {2, 1}. Mean (1 + .8) / 2 =
    .9 against no prior's (2/2 + 2/3) / 2 = 5/6; the range of g B over each query's keys: ln 3."""
    m = positional_model({})
    with torch.no_grad():
        m.blocks[0].attn.pos_bias[:, 0] = 2 * math.log(3)
    x = torch.zeros(2, 3, dtype=torch.long)
    prof = A.prior_profile(m, x, gate_pos=0.5)
    assert prof["locality"] == pytest.approx(0.9, abs=1e-6)
    assert prof["uniform"] == pytest.approx(5 / 6, abs=1e-6)
    assert prof["strength"] == pytest.approx(math.log(3), abs=1e-6)
    # at zero gate the prior gives nothing: no prior's locality, no range
    zero = A.prior_profile(m, x, gate_pos=0.0)
    assert zero["locality"] == pytest.approx(5 / 6, abs=1e-6) and zero["strength"] == 0.0


def test_prior_profile_reads_every_soft_layer_and_each_heads_gate():
    """Two layers of two heads, the soft table zero but on layer 1, head 0 (2 ln 3 at offset 0; zero
    init, so prior_layers is (0,): the table of layer 1 trains all the same). At g = .5 everywhere, that
    head gives the case above (.9, ln 3) and the other three give no prior's (5/6, 0): the means over the
    four are (3 x 5/6 + .9) / 4 and ln 3 / 4. That head's gate at 0 leaves no prior anywhere."""
    m = _zeroed(ModelConfig(n_layers=2, n_heads=2, d_model=8, n_ctx=8, vocab=5, content_rank=1, prior_init="zero",
                            gate_granularity="head"))
    with torch.no_grad():
        m.blocks[1].attn.pos_bias[0, 0] = 2 * math.log(3)
    x = torch.zeros(1, 3, dtype=torch.long)
    prof = A.prior_profile(m, x, gate_pos=torch.full((2, 2), 0.5))
    assert prof["locality"] == pytest.approx((3 * 5 / 6 + 0.9) / 4, abs=1e-6)
    assert prof["strength"] == pytest.approx(math.log(3) / 4, abs=1e-6)
    off = A.prior_profile(m, x, gate_pos=torch.tensor([[0.5, 0.5], [0.0, 0.5]]))
    assert off["locality"] == pytest.approx(5 / 6, abs=1e-6) and off["strength"] == 0.0


def test_induction_score():
    n = 6
    m = positional_model({0: n - 1, 1: 1})
    x = A.repeated_random_tokens(3, n, 20, torch.Generator().manual_seed(2))
    assert torch.equal(x[:, :n], x[:, n:]) and all(len(set(r[:n].tolist())) == n for r in x)
    s = A.induction_score(m, x, 1.0, 0.0)
    assert s.shape == (1, 4)
    assert s[0, 0] > 0.999
    assert s[0, 1] < 1e-6
    uniform = sum(1 / (i + 1) for i in range(n, 2 * n)) / n
    torch.testing.assert_close(s[0, 2], torch.tensor(uniform), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError):
        A.induction_score(m, torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(3)))
    # default inputs: n_ctx // 2 = 8 repeated distinct tokens; the head attending to offset n-1 = 7
    m8 = positional_model({0: 7})
    assert A.induction_score(m8, gate_pos=1.0, gate_content=0.0)[0, 0] > 0.999


def test_attention_patterns_shapes_and_gates(recall):
    m, _, b = recall
    pats = A.attention_patterns(m, b.inputs[:4], *GATES)
    assert sorted(pats) == [0, 1] and pats[0].shape == (4, H, T, T)
    torch.testing.assert_close(pats[0].sum(-1), torch.ones(4, H, T))
    assert pats[0][:, 0].diagonal(-1, dim1=-2, dim2=-1).min() > 0.999  # L0H0 is previous-token
    assert pats[0].triu(1).abs().max() == 0  # causal


# ------------------------------------------------------------------------ traces
def test_trace_and_summary(recall):
    _, task, _ = recall
    cfg = make_run_config(task="assoc_recall", path="unforced", model=recall_cfg(), calibrated=False,
                          task_options=dict(n_pairs=8, n_keys=15), n_val=128)
    hand = hand_recall_model().state_dict()
    rand = SoftPriorTransformer(recall_cfg()).state_dict()
    # a single run's checkpoint tensors too (loop.checkpoint: "model." keys, a run dimension of 1)
    snaps = [(0, rand), (300, {f"model.{k}": v[None] for k, v in hand.items()})]
    df = A.trace(snaps, cfg, gates=GATES)
    assert list(df.columns) == ["step", "layer", "head", "successor_mass", "ablation_importance", "base_score"]
    assert len(df) == 2 * 2 * H
    last = df[df.step == 300].set_index(["layer", "head"])
    assert last.loc[(1, 0), "successor_mass"] > 0.999
    assert last.loc[(1, 0), "ablation_importance"] > 0.6
    assert last["base_score"].eq(1.0).all()
    s = A.summarise_trace(df)
    assert s["top_successor_head"] == (1, 0) and s["successor_first_step"] == 300
    assert s["top_ablation_head"] in {(0, 0), (1, 0)} and s["ablation_first_step"] == 300
    mat = A.trace_matrix(df, "successor_mass")
    assert mat.shape == (2, 2 * H) and mat.loc[300, "L1H0"] > 0.999
    with pytest.raises(ValueError, match="group"):  # a group's stacked checkpoint: one run's slice, not a guess
        A.trace([(300, {f"model.{k}": torch.stack([v, v]) for k, v in hand.items()})], cfg, gates=GATES)


def test_summarise_trace_thresholds():
    rows = []
    # head (0, 1) crosses the mass threshold at step 600 and ends on top; (1, 0) peaks early at 0.9
    # then fades (so it is not the final top head, but it is the first to cross at all)
    mass = {(0, 1): [0.1, 0.2, 0.3, 0.5], (1, 0): [0.1, 0.9, 0.2, 0.1]}
    abl = {(0, 1): [0.0, 0.01, 0.02, 0.02], (1, 0): [0.0, 0.0, 0.05, 0.04]}
    for i, step in enumerate([0, 300, 600, 900]):
        for head in mass:
            rows.append({"step": step, "layer": head[0], "head": head[1], "successor_mass": mass[head][i],
                         "ablation_importance": abl[head][i], "base_score": 0.5})
    s = A.summarise_trace(pd.DataFrame(rows), mass_threshold=0.25, ablation_threshold=0.03)
    assert s["top_successor_head"] == (0, 1) and s["top_successor_mass"] == 0.5
    assert s["successor_first_step"] == 600 and s["successor_first_step_any"] == 300
    assert s["top_ablation_head"] == (1, 0) and s["ablation_first_step"] == 600
    s2 = A.summarise_trace(pd.DataFrame(rows), mass_threshold=0.95, ablation_threshold=0.5)
    assert s2["successor_first_step"] is None and s2["ablation_first_step_any"] is None


def test_trace_linear_icl_has_no_successor_mass():
    cfg = make_run_config(task="linear_icl", path="unforced", model="base", calibrated=False,
                          model_options=dict(n_ctx=11, d_model=16), n_val=16)
    sd = SoftPriorTransformer(cfg.model).state_dict()
    df = A.trace([(0, sd)], cfg)
    assert df["successor_mass"].isna().all() and df["ablation_importance"].notna().all()


def test_an_ablation_crossing_counts_only_above_noise():
    """At chance (p = .1) an accuracy on 512 examples has a standard error of .0133: a drop of .033 is 2.5
    of them and does not count against the threshold .03 plus two (.0565); .07 does. Without the
    number of examples, the threshold alone."""
    import pandas as pd

    from softprior.analysis.mechanism import summarise_trace
    rows = [{"step": s, "layer": 0, "head": 0, "successor_mass": 0.0, "ablation_importance": d, "base_score": 0.1}
            for s, d in ((600, 0.0), (1200, 0.033), (1800, 0.07))]
    df = pd.DataFrame(rows)
    assert summarise_trace(df, n_examples=512)["ablation_first_step"] == 1800
    assert summarise_trace(df, n_examples=512)["ablation_first_step_any"] == 1800
    assert summarise_trace(df)["ablation_first_step"] == 1200
    assert summarise_trace(df.assign(base_score=0.5), n_examples=512)["ablation_first_step"] is None  # bar .074
