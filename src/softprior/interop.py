"""TransformerLens interoperability: convert a token ``SoftPriorTransformer`` into a TransformerLens
``HookedTransformer``, and export / load it as a file.

TransformerLens is an optional extra (``pip install softprior[tl]``); it is imported only inside these
functions. ``HookedTransformer`` exists in TransformerLens 2.x and 3.x; 4.0 removed it (in favour of
``TransformerBridge``, which wraps Hugging Face models and cannot hold this architecture), so these
functions need ``transformer-lens>=2,<4``.

The conversion (weights copied, nothing folded or centred; loaded with a plain ``load_state_dict``):

- ``HookedTransformerConfig(attn_only=True, normalization_type="LN",
  positional_embedding_type="standard")`` with ``pos_embed.W_pos`` zeroed and frozen (TransformerLens
  has no "none" positional type), so at zero gate the result is exactly our NoPE model.
- W_Q/W_K/W_V[h] = rows h*d_head:(h+1)*d_head of the Q/K/V blocks of our fused ``in_proj``,
  transposed; W_O[h] = the matching columns of ``out_proj``; all biases zero; LayerNorm weights and
  biases copied; W_U = W_E^T, b_U = 0 (the tied unembedding).
- The priors (when a gate is non-zero) are added by permanent hooks:
  ``blocks.{l}.attn.hook_attn_scores`` (which sees the scaled, causally masked scores before the
  softmax) gets ``+ g_pos[l, h] * B^pos_h[clip(i - j, 0, n_ctx - 1)] + g_content[l, h] *
  B^content_h(x_i, x_j)``. B^content needs the layer's LayerNorm-ed residual: a permanent hook on
  ``blocks.{l}.ln1.hook_normalized`` captures it. In TransformerLens that hook point is *before* the
  LayerNorm's weight and bias (``hook_normalized(x / scale) * w + b``; checked in the installed
  source), so the hook applies ``ln1.w`` and ``ln1.b`` itself before the U/V factors. Permanent hooks
  survive ``reset_hooks()`` and ``run_with_hooks``; a user hook added later on ``hook_attn_scores``
  sees the scores with the prior, as our model's ``hook_attn_scores`` does.
- The gates are baked in at conversion: ``gates=None`` uses the model's own gates (sigmoid of its
  logits), ``(g_pos, g_content)`` forces them (each a float, a tensor read as ``model.gates`` reads it ([L] per layer, [1, H] per head, [L, H]), or None for
  that kind's own gate). Convert again for other gates.

Limits: token models only (not the linear-ICL vector-input models), and not the static positional
baselines (``ModelConfig.positional != "none"``: rotary etc. are not mapped); KV-cache generation works with the
position prior but not with a non-zero content gate (the cached keys' residuals are not captured).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .model.config import ModelConfig
from .model.transformer import SoftPriorTransformer

__all__ = ["to_hooked_transformer", "export_transformer_lens", "load_transformer_lens", "tl_config_dict",
           "FORMAT", "ExportError", "MissingExtraError"]

FORMAT = "softprior-transformer-lens/1"


class ExportError(ValueError):
    """A model or file this module cannot convert (the command line shows it in one line)."""


class MissingExtraError(ImportError):
    """TransformerLens (with HookedTransformer) is not installed."""


def _import_tl():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError as e:  # not installed, or TransformerLens >= 4 (HookedTransformer removed)
        raise MissingExtraError("softprior.interop needs TransformerLens with HookedTransformer "
                                "(pip install 'softprior[tl]' or 'transformer-lens>=2,<4'): " + str(e)) from e
    return HookedTransformer, HookedTransformerConfig


def _check_token_model(cfg: ModelConfig):
    if cfg.d_in is not None or cfg.d_out is not None:
        raise ExportError("TransformerLens export supports token models only; this model reads vectors "
                         f"(d_in={cfg.d_in}, d_out={cfg.d_out}, e.g. linear_icl)")
    scheme = getattr(cfg, "positional", "none")
    if scheme != "none":
        raise ExportError(f"TransformerLens export supports the soft-prior model only, not the static "
                         f"positional baseline {scheme!r}")
    if cfg.norm != "pre":
        raise ExportError(f"TransformerLens export supports pre-LayerNorm models only, not norm={cfg.norm!r} "
                          "(the content prior reads each block's ln1)")
    if getattr(cfg, "prior_family", "soft") != "soft":
        raise ExportError(f"TransformerLens export carries the soft prior's table only, not prior family "
                          f"{cfg.prior_family!r} (its B^pos is the family's code, which the export does not hold)")


def tl_config_dict(cfg: ModelConfig, n_ctx: int | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """The JSON-able ``HookedTransformerConfig`` arguments for a model config. ``n_ctx`` (default
    the model's) only sets the longest input TransformerLens accepts (the W_pos table is zero)."""
    _check_token_model(cfg)
    return dict(n_layers=cfg.n_layers, d_model=cfg.d_model, d_head=cfg.d_head, n_heads=cfg.n_heads,
                n_ctx=int(n_ctx or cfg.n_ctx), d_vocab=cfg.vocab, attn_only=True,
                normalization_type="LN", attn_scale=cfg.qk_unscale,
                positional_embedding_type="standard", eps=1e-5, default_prepend_bos=False,
                dtype=str(dtype).replace("torch.", ""), model_name="softprior")


def _tl_weights(model: SoftPriorTransformer, n_ctx: int) -> dict[str, torch.Tensor]:
    """The HookedTransformer parameters (TransformerLens names and layouts) of ``model``."""
    cfg = model.cfg
    d, H, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    W_E = model.embed.weight.detach()
    sd = {"embed.W_E": W_E.clone(), "pos_embed.W_pos": W_E.new_zeros(n_ctx, d)}
    for l, blk in enumerate(model.blocks):
        W = blk.attn.in_proj.weight.detach()
        p = f"blocks.{l}."
        sd[p + "ln1.w"] = blk.ln.weight.detach().clone()
        sd[p + "ln1.b"] = blk.ln.bias.detach().clone()
        for i, name in enumerate("QKV"):
            # our q[..., h*dh + e] = x @ W[i*d + h*dh + e]  ->  W_Q[h, :, e]
            sd[p + f"attn.W_{name}"] = W[i * d:(i + 1) * d].reshape(H, dh, d).transpose(1, 2).clone()
            sd[p + f"attn.b_{name}"] = W.new_zeros(H, dh)
        # out = z_flat @ out_proj.weight.T with z_flat[h*dh + e]  ->  W_O[h, e, :]
        sd[p + "attn.W_O"] = blk.attn.out_proj.weight.detach().T.reshape(H, dh, d).clone()
        sd[p + "attn.b_O"] = W.new_zeros(d)
    sd["ln_final.w"] = model.ln_final.weight.detach().clone()
    sd["ln_final.b"] = model.ln_final.bias.detach().clone()
    sd["unembed.W_U"] = W_E.T.clone()
    sd["unembed.b_U"] = W_E.new_zeros(cfg.vocab)
    return sd


def _prior_tensors(model: SoftPriorTransformer, gates) -> dict[str, torch.Tensor]:
    """The priors and the baked gate values, [L, ...] stacked over layers."""
    cfg = model.cfg
    d, H, r = cfg.d_model, cfg.n_heads, cfg.content_rank
    g_pos, g_content = model.gates(*(gates if gates is not None else (None, None)))
    dtype = model.embed.weight.dtype
    us, vs = [], []
    for blk in model.blocks:
        W = blk.attn.in_proj.weight.detach()
        us.append(W[3 * d:3 * d + H * r].reshape(H, r, d))  # u[..., h, :] = x @ U_h, U_h = this[h].T
        vs.append(W[3 * d + H * r:3 * d + 2 * H * r].reshape(H, r, d))
    return {"pos_bias": torch.stack([blk.attn.pos_bias.detach() for blk in model.blocks]).clone(),
            "content_u": torch.stack(us).clone(), "content_v": torch.stack(vs).clone(),
            "gate_pos": g_pos.detach().to(dtype).clone(), "gate_content": g_content.detach().to(dtype).clone()}


def _install_prior(tl_model, prior: dict[str, torch.Tensor]) -> None:
    """Permanent hooks adding g_pos * B^pos + g_content * B^content to ``hook_attn_scores``."""
    g_pos, g_content = prior["gate_pos"], prior["gate_content"]
    n_off = prior["pos_bias"].shape[-1]
    tl_model.softprior_prior = prior  # kept for inspection
    for l in range(g_pos.shape[0]):
        use_pos, use_content = bool((g_pos[l] != 0).any()), bool((g_content[l] != 0).any())
        if not (use_pos or use_content):
            continue
        captured: dict[str, torch.Tensor] = {}
        ln = tl_model.blocks[l].ln1

        def capture(x, hook, captured=captured):
            captured["x"] = x  # ln1 runs once per q/k/v input, all the same residual
            return None

        def add_prior(scores, hook, l=l, use_pos=use_pos, use_content=use_content, captured=captured, ln=ln):
            B, H, Tq, Tk = scores.shape
            dev, dt = scores.device, scores.dtype
            out = scores
            if use_pos:
                qpos = torch.arange(Tk - Tq, Tk, device=dev)  # queries are the last Tq keys (KV cache)
                off = (qpos[:, None] - torch.arange(Tk, device=dev)[None, :]).clamp(0, n_off - 1)
                b_pos = prior["pos_bias"][l].to(dev, dt)[:, off]  # [H, Tq, Tk]
                out = out + prior["gate_pos"][l].to(dev, dt).view(H, 1, 1) * b_pos
            if use_content:
                x = captured.get("x")
                if x is None or x.shape[1] != Tk or Tq != Tk:
                    raise NotImplementedError("the content prior needs the full residual of every key "
                                              "(no KV cache)")
                x = x.to(dt) * ln.w.to(dt) + ln.b.to(dt)  # hook_normalized is before LN's affine
                u = torch.einsum("btd,hrd->bhtr", x, prior["content_u"][l].to(dev, dt))
                w = torch.einsum("btd,hrd->bhtr", x, prior["content_v"][l].to(dev, dt))
                out = out + prior["gate_content"][l].to(dev, dt).view(H, 1, 1) * (u @ w.transpose(-1, -2))
            return out

        if use_content:
            tl_model.add_hook(f"blocks.{l}.ln1.hook_normalized", capture, is_permanent=True)
        tl_model.add_hook(f"blocks.{l}.attn.hook_attn_scores", add_prior, is_permanent=True)


def _build(tl_cfg: dict, weights: dict[str, torch.Tensor], prior: dict[str, torch.Tensor], device=None):
    HookedTransformer, HookedTransformerConfig = _import_tl()
    kw = dict(tl_cfg)
    kw["dtype"] = getattr(torch, kw["dtype"])
    device = torch.device(device if device is not None else "cpu")
    kw["device"] = str(device)  # TransformerLens would otherwise pick CUDA when it is available
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3.x: "HookedTransformer is deprecated ..."
        tl_model = HookedTransformer(HookedTransformerConfig(**kw), move_to_device=False)
    own = tl_model.state_dict()
    missing = [k for k in own if k not in weights and not k.endswith((".mask", ".IGNORE"))]
    extra = [k for k in weights if k not in own]
    if missing or extra:
        raise RuntimeError(f"TransformerLens layout mismatch: missing {missing}, unexpected {extra}")
    own.update({k: v.to(own[k].dtype) for k, v in weights.items()})
    tl_model.load_state_dict(own)  # plain load: no LayerNorm folding, no centring
    tl_model.pos_embed.W_pos.requires_grad_(False)
    tl_model.to(device, print_details=False)
    _install_prior(tl_model, prior)
    return tl_model


def to_hooked_transformer(model: SoftPriorTransformer, gates=None, n_ctx: int | None = None, device=None):
    """A TransformerLens ``HookedTransformer`` computing the same logits as ``model`` at ``gates``.

    gates: None = the model's own gates (sigmoid of its gate logits); ``(g_pos, g_content)`` forces
    them (floats, tensors as ``model.gates`` reads them, or None per kind for that kind's own gate). At zero
    gates no hook is installed: the result is the plain NoPE attention-only model. ``n_ctx``: the
    longest input the TransformerLens model accepts (default the training context; the prior clips
    offsets beyond it, like our model). The prior and gates are kept as ``.softprior_prior``."""
    _check_token_model(model.cfg)
    dtype = model.embed.weight.dtype
    tl_cfg = tl_config_dict(model.cfg, n_ctx, dtype)
    device = device if device is not None else model.embed.weight.device
    return _build(tl_cfg, _tl_weights(model, tl_cfg["n_ctx"]), _prior_tensors(model, gates), device)


def export_transformer_lens(model: SoftPriorTransformer, out_file, gates=None, n_ctx: int | None = None) -> Path:
    """Write ``model`` (at ``gates``, as ``to_hooked_transformer``) as one safetensors file:

    - tensors: the HookedTransformer state dict under TransformerLens names (``embed.W_E``,
      ``blocks.{l}.attn.W_Q``, ...; the ``mask``/``IGNORE`` buffers are left out) and the prior under
      ``softprior.pos_bias`` [L, H, n_ctx], ``softprior.content_u`` / ``softprior.content_v``
      [L, H, r, d_model], ``softprior.gate_pos`` / ``softprior.gate_content`` [L, H];
    - metadata (JSON strings): ``format``, ``tl_config`` (the ``HookedTransformerConfig`` arguments,
      dtype as a string), ``softprior_model_config`` and ``prior_hooks`` (how the prior is applied).

    ``load_transformer_lens`` rebuilds the HookedTransformer with its prior hooks; without softprior,
    build ``HookedTransformerConfig(**tl_config)`` and ``load_state_dict`` the non-``softprior.``
    tensors (strict=False for the buffers): that is the zero-gate model. Returns the path."""
    from safetensors.torch import save_file

    _check_token_model(model.cfg)
    dtype = model.embed.weight.dtype
    tl_cfg = tl_config_dict(model.cfg, n_ctx, dtype)
    tensors = {k: v.contiguous() for k, v in _tl_weights(model, tl_cfg["n_ctx"]).items()}
    tensors.update({f"softprior.{k}": v.contiguous() for k, v in _prior_tensors(model, gates).items()})
    meta = {"format": FORMAT, "tl_config": json.dumps(tl_cfg, sort_keys=True),
            "softprior_model_config": model.cfg.model_dump_json(),
            "prior_hooks": ("blocks.{l}.attn.hook_attn_scores += gate_pos[l,h] * pos_bias[l,h,clip(i-j,0,n-1)] "
                            "+ gate_content[l,h] * (x_i U_h).(x_j V_h), x = ln1(resid) incl. w,b; "
                            "U_h = content_u[l,h].T, V_h = content_v[l,h].T")}
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out


def load_transformer_lens(path, device=None):
    """Load a file written by ``export_transformer_lens`` as a HookedTransformer with its prior hooks
    (on ``device``, default CPU)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ExportError(f"{path} is not a softprior TransformerLens export (format={meta.get('format')!r})")
    tensors = load_file(str(path))
    weights = {k: v for k, v in tensors.items() if not k.startswith("softprior.")}
    prior = {k[len("softprior."):]: v for k, v in tensors.items() if k.startswith("softprior.")}
    return _build(json.loads(meta["tl_config"]), weights, prior, device)
