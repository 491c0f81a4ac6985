"""TransformerLens export: the HookedTransformer must compute our model's logits at every gate."""

import json

import pytest
import torch

pytest.importorskip("transformer_lens")
from transformer_lens import HookedTransformer  # noqa: E402  (after the skip)

from softprior.interop import export_transformer_lens, load_transformer_lens, to_hooked_transformer  # noqa: E402
from softprior.model.config import ModelConfig  # noqa: E402
from softprior.model.transformer import SoftPriorTransformer  # noqa: E402

VOCAB, NCTX = 20, 16


def random_model(dtype=torch.float64, granularity="head", seed=0, **extra) -> SoftPriorTransformer:
    """Random weights with everything the conversion must carry: non-trivial B^pos on both layers,
    large content factors, non-unit LayerNorm weights and biases, per-head gate logits."""
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=32, n_ctx=NCTX, vocab=VOCAB, content_rank=2,
                      content_init_std=0.3, gate_granularity=granularity, prior_layers=(0, 1), prior_scale=0.3, **extra)
    m = SoftPriorTransformer(cfg)
    with torch.no_grad():
        m.gate_logits.normal_(0.0, 1.5)
        for blk in m.blocks:
            blk.attn.pos_bias.add_(torch.randn_like(blk.attn.pos_bias))
            blk.attn.in_proj.weight.mul_(2.0)  # sharper attention than the default init
            blk.ln.weight.normal_(1.0, 0.3)
            blk.ln.bias.normal_(0.0, 0.3)
        m.ln_final.weight.normal_(1.0, 0.3)
        m.ln_final.bias.normal_(0.0, 0.3)
    return m.to(dtype)


def tokens(B=6, T=NCTX, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def ours(m, x, gates):
    with torch.no_grad():
        return m(x, *(gates if gates is not None else (None, None)))


def theirs(tl, x):
    with torch.no_grad():
        return tl(x)


GATES = [(0.0, 0.0), None, (0.5, 0.3), (None, 0.0), (0.0, 1.0), (1.0, 0.0)]


@pytest.mark.parametrize("gates", GATES, ids=str)
def test_logits_match_float64(gates):
    m, x = random_model(), tokens()
    ref = ours(m, x, gates)
    tl = to_hooked_transformer(m, gates)
    assert isinstance(tl, HookedTransformer)
    torch.testing.assert_close(theirs(tl, x), ref, rtol=0, atol=1e-10)


def test_priors_matter_so_the_match_is_not_vacuous():
    m, x = random_model(), tokens()
    zero, pos, content = ours(m, x, (0.0, 0.0)), ours(m, x, (1.0, 0.0)), ours(m, x, (0.0, 1.0))
    assert (pos - zero).abs().max() > 0.1 and (content - zero).abs().max() > 0.1
    # the NoPE TransformerLens model is not our model with the prior on
    assert (theirs(to_hooked_transformer(m, (0.0, 0.0)), x) - pos).abs().max() > 0.1


@pytest.mark.parametrize("gates", [(0.0, 0.0), None, (0.5, 0.3)], ids=str)
def test_logits_match_float32(gates):
    m, x = random_model(torch.float32), tokens()
    ref = ours(m, x, gates)
    # float32 rounding through LayerNorm and sharp softmaxes: a few 1e-5 on logits of size ~40
    torch.testing.assert_close(theirs(to_hooked_transformer(m, gates), x), ref, rtol=1e-5, atol=1e-4)


def test_trained_like_gates_shared_logits():
    # a trained unforced model: position gate near 1, content gate low, one logit per kind
    m, x = random_model(granularity="shared"), tokens()
    with torch.no_grad():
        m.gate_logits.copy_(torch.tensor([4.0, -3.0]).view(2, 1, 1))
    torch.testing.assert_close(theirs(to_hooked_transformer(m), x), ours(m, x, None), rtol=0, atol=1e-10)
    torch.testing.assert_close(to_hooked_transformer(m).softprior_prior["gate_pos"],
                               torch.full((2, 4), torch.sigmoid(torch.tensor(4.0)).item(), dtype=torch.float64))


def test_zero_gate_is_plain_nope_transformer_lens():
    m = random_model()
    tl = to_hooked_transformer(m, (0.0, 0.0))
    assert tl.cfg.attn_only and tl.cfg.normalization_type == "LN"
    assert torch.count_nonzero(tl.pos_embed.W_pos) == 0 and not tl.pos_embed.W_pos.requires_grad
    for l in range(2):
        assert torch.count_nonzero(tl.blocks[l].attn.b_Q) == 0 and torch.count_nonzero(tl.blocks[l].attn.b_O) == 0
        assert not tl.hook_dict[f"blocks.{l}.attn.hook_attn_scores"].fwd_hooks  # no prior hook at all
    assert torch.equal(tl.unembed.W_U, tl.embed.W_E.T) and torch.count_nonzero(tl.unembed.b_U) == 0
    # LayerNorm was not folded: the weights are ours
    assert torch.equal(tl.blocks[1].ln1.w, m.blocks[1].ln.weight.detach())


def test_hook_names_agree_and_prior_hooks_are_permanent():
    m, x = random_model(), tokens()
    tl = to_hooked_transformer(m, (0.5, 0.3))
    _, cache = m.run_with_cache(x, 0.5, 0.3)
    with torch.no_grad():
        _, tl_cache = tl.run_with_cache(x)
    for l in range(2):
        for name in ("attn.hook_pattern", "attn.hook_z", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                     "hook_attn_out", "hook_resid_post"):
            key = f"blocks.{l}.{name}"
            torch.testing.assert_close(tl_cache[key], cache[key], rtol=0, atol=1e-10, msg=key)
        # unmasked scores (with the priors) agree too
        causal = torch.ones(NCTX, NCTX, dtype=torch.bool).tril()
        key = f"blocks.{l}.attn.hook_attn_scores"
        torch.testing.assert_close(tl_cache[key][..., causal], cache[key][..., causal], rtol=0, atol=1e-10)
    # a user hook on the same point sees the prior-added scores; reset_hooks keeps the prior
    seen = []
    tl.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda s, hook: seen.append(s.clone()))])
    torch.testing.assert_close(seen[0][..., causal], cache["blocks.0.attn.hook_attn_scores"][..., causal],
                               rtol=0, atol=1e-10)
    tl.reset_hooks()
    torch.testing.assert_close(theirs(tl, x), ours(m, x, (0.5, 0.3)), rtol=0, atol=1e-10)


def test_longer_inputs_clip_offsets_like_our_model():
    m, x = random_model(), tokens(B=3, T=40)
    tl = to_hooked_transformer(m, (1.0, 0.5), n_ctx=40)
    torch.testing.assert_close(theirs(tl, x), ours(m, x, (1.0, 0.5)), rtol=0, atol=1e-10)


def test_vector_models_are_refused(tmp_path):
    m = SoftPriorTransformer(ModelConfig(d_in=5, d_out=1, n_ctx=11))
    with pytest.raises(ValueError, match="token models"):
        to_hooked_transformer(m)
    with pytest.raises(ValueError, match="token models"):
        export_transformer_lens(m, tmp_path / "x.safetensors")


def test_prior_free_model_exports_as_nope():
    # fails (not skips) if the switch disappears: model_copy(update=...) would not notice a missing field
    assert "prior" in ModelConfig.model_fields, "ModelConfig lost its 'prior' switch: update this test"
    m, x = random_model(), tokens()
    m0 = SoftPriorTransformer(ModelConfig.model_validate({**m.cfg.model_dump(), "prior": False})).to(torch.float64)
    assert m0.cfg.prior is False
    m0.load_state_dict(m.state_dict())
    tl = to_hooked_transformer(m0)  # its own gates are 0: no hooks, same logits as m at zero gate
    assert not tl.hook_dict["blocks.0.attn.hook_attn_scores"].fwd_hooks
    torch.testing.assert_close(theirs(tl, x), ours(m, x, (0.0, 0.0)), rtol=0, atol=1e-10)


@pytest.mark.parametrize("gates", [(0.0, 0.0), None], ids=str)
def test_export_round_trip(tmp_path, gates):
    from safetensors import safe_open

    m, x = random_model(torch.float32), tokens()
    path = export_transformer_lens(m, tmp_path / "sub" / "model.safetensors", gates=gates)
    with safe_open(str(path), framework="pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    cfg = json.loads(meta["tl_config"])
    assert cfg["n_layers"] == 2 and cfg["d_head"] == 8 and cfg["attn_only"] is True
    assert {"embed.W_E", "blocks.1.attn.W_O", "softprior.pos_bias", "softprior.gate_content"} <= keys
    assert json.loads(meta["softprior_model_config"])["content_rank"] == 2
    loaded = load_transformer_lens(path)
    assert isinstance(loaded, HookedTransformer)
    out = theirs(loaded, x)
    assert torch.equal(out, theirs(to_hooked_transformer(m, gates), x))
    torch.testing.assert_close(out, ours(m, x, gates), rtol=1e-5, atol=1e-4)


def test_load_refuses_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a softprior"):
        load_transformer_lens(tmp_path / "other.safetensors")


@pytest.mark.parametrize("attn_scale", ["inverse", "one"])
def test_another_attention_scale_exports_as_transformer_lens_attn_scale(attn_scale):
    m, x = random_model(attn_scale=attn_scale), tokens()
    torch.testing.assert_close(theirs(to_hooked_transformer(m, (0.5, 0.3)), x), ours(m, x, (0.5, 0.3)),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("norm", ["post", "none"])
def test_models_not_pre_layernorm_are_refused(norm):
    m = SoftPriorTransformer(ModelConfig(n_ctx=NCTX, vocab=VOCAB, norm=norm))
    with pytest.raises(ValueError, match=f"norm='{norm}'"):
        to_hooked_transformer(m)


def test_static_positional_baselines_are_refused():
    assert "positional" in ModelConfig.model_fields, "ModelConfig lost its 'positional' field: update this test"
    m = SoftPriorTransformer(ModelConfig(n_ctx=NCTX, vocab=VOCAB, positional="rope"))
    with pytest.raises(ValueError, match="rope"):
        to_hooked_transformer(m)


def test_models_of_another_prior_family_are_refused():
    """The export carries the soft prior's table; a family's B^pos is its own code, so it is refused."""
    m = SoftPriorTransformer(ModelConfig(n_ctx=NCTX, vocab=VOCAB, prior_family="alibi"))
    with pytest.raises(ValueError, match="prior family 'alibi'"):
        to_hooked_transformer(m)


def test_cli_export_of_a_stored_run(tmp_path, capsys):
    from softprior.cli import main
    from softprior.store import RunStore
    store = str(tmp_path / "s")
    assert main(["train", "--steps", "20", "--store", store, "--json", "--no-progress"]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    out = tmp_path / "tl.safetensors"
    assert main(["export", rid, "--format", "transformer-lens", "--out", str(out), "--store", store]) == 0
    _, ours = RunStore(store).load_model(rid)
    tl = load_transformer_lens(out)
    tokens = torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(tl(tokens), ours(tokens), atol=1e-4, rtol=1e-5)
    assert main(["export", rid, "--format", "onnx", "--out", str(out), "--store", store]) == 2
    assert "allowed: transformer-lens" in capsys.readouterr().err


def test_cli_export_with_n_ctx_runs_at_length_40(tmp_path, capsys):
    """``softprior export --n-ctx 120``: the exported model accepts T=40 (beyond the training context
    of 32, where the default export raises) and computes our model's logits there."""
    from softprior.cli import main
    from softprior.config import make_run_config
    from softprior.store import RunStore

    store = str(tmp_path / "store")
    assert main(["train", "--path", "unforced", "--steps", "5", "--store", store, "--json", "--no-progress"]) == 0
    rid = make_run_config("assoc_recall", "unforced", 0, steps=5).run_id
    out = tmp_path / "m.safetensors"
    capsys.readouterr()
    assert main(["export", rid, "--out", str(out), "--n-ctx", "120", "--store", store]) == 0
    assert "120" in capsys.readouterr().out
    tl = load_transformer_lens(out)
    assert tl.cfg.n_ctx == 120
    _, model = RunStore(store).load_model(rid)
    x = torch.randint(0, 32, (4, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(theirs(tl, x), ours(model, x, None), rtol=1e-4, atol=1e-4)

    default = tmp_path / "d.safetensors"
    assert main(["export", rid, "--out", str(default), "--store", store]) == 0
    assert load_transformer_lens(default).cfg.n_ctx == 32  # the training context, as before

    capsys.readouterr()
    assert main(["export", rid, "--out", str(tmp_path / "bad.safetensors"), "--n-ctx", "0", "--store", store]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("softprior: error: --n-ctx") and "0" in err[0]
    assert not (tmp_path / "bad.safetensors").exists()


def test_cli_export_names_its_format_and_prints_how_to_load_it(tmp_path, capsys, monkeypatch):
    """``export`` wrote safetensors whatever --out said (a .pt file that torch.load cannot read) and
    did not say how to load it: --out is optional (RUN_ID.hooked.safetensors), a directory gets that
    name inside it, another extension is refused, and the two printed lines load the file."""
    from softprior.cli import main
    from softprior.store import RunStore
    store = str(tmp_path / "s")
    assert main(["train", "--path", "unforced", "--steps", "5", "--store", store, "--json", "--no-progress"]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    monkeypatch.chdir(tmp_path)

    assert main(["export", rid[:8], "--store", store]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"wrote {rid}.hooked.safetensors ") and (tmp_path / f"{rid}.hooked.safetensors").is_file()
    assert out[1:] == ["from softprior.interop import load_transformer_lens",
                       f"model = load_transformer_lens('{rid}.hooked.safetensors')"]
    scope = {}
    exec("\n".join(out[1:]), scope)  # the two lines, as printed
    assert isinstance(scope["model"], HookedTransformer)
    _, model = RunStore(store).load_model(rid)
    x = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(theirs(scope["model"], x), ours(model, x, None), rtol=1e-4, atol=1e-4)

    (tmp_path / "exports").mkdir()
    assert main(["export", rid, "--out", "exports", "--store", store]) == 0
    assert (tmp_path / "exports" / f"{rid}.hooked.safetensors").is_file()
    capsys.readouterr()
    for lying in ("model.pt", "model.bin", "model"):
        assert main(["export", rid, "--out", lying, "--store", store]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "ends in .safetensors" in err[0] and "'model.hooked.safetensors'" in err[0], err
        assert not (tmp_path / lying).exists()
