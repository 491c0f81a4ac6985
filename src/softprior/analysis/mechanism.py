"""Mechanism analysis (docs/DESIGN.md, "Mechanism traces"): attention patterns, per-head value contributions,
successor-value mass, mean-ablation importance, previous-token and induction scores, and traces of
these over training checkpoints. The paper's Section 3.3 continuation quantities (recovery signal,
optimum tangent, tracking cosine) are in the subpackage ``softprior.analysis.continuation``.

Every function reads the model's cached intermediates through its hook names
(``SoftPriorTransformer.run_with_cache`` / ``hooks``); none re-implements the forward pass. The only
weights read directly are each head's output matrix W_O^h (to split a head's output by source
position), taken from ``blocks.{l}.attn.out_proj`` exactly as the model's ``hook_result`` does.

Notation: A^{l,h}_b[i, j] is the attention pattern of layer l, head h on example b (query i, key j);
v^{l,h}_b[j] the head's value vector at position j (``hook_v``); W_O^h in R^{d_head x d_model}.

Gates: ``gate_pos=None`` / ``gate_content=None`` mean the model's own (learned, sigmoid) gates, a float
forces the gate, as in ``SoftPriorTransformer.forward``. The pattern-reading functions default to the
model's own gates; the two mechanism-trace measures (``successor_value_mass``, ``ablation_importance``) and
``trace`` default to the zero gate (both gates 0), i.e. they measure the circuit of the plain NoPE model
that remains once the prior is removed.

Note: ``model.hooks`` does not nest (it replaces the installed hooks for its duration), so these
functions suspend any hooks a caller installed around them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..model.transformer import SoftPriorTransformer

__all__ = ["attention_patterns", "head_value_contributions", "answer_mask", "successor_value_mass",
           "mean_ablation", "ablation_importance", "previous_token_score", "induction_score",
           "repeated_random_tokens", "trace", "summarise_trace", "trace_matrix", "prior_profile"]


# ------------------------------------------------------------------------------------ helpers
def _run(model: SoftPriorTransformer, inputs, names: Iterable[str], gate_pos=None, gate_content=None,
         positions=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.no_grad():
        return model.run_with_cache(inputs, gate_pos, gate_content, positions=positions,
                                    names_filter=list(names))


def _pattern_name(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def _check_layer(model: SoftPriorTransformer, layer: int) -> int:
    L = model.cfg.n_layers
    if not -L <= layer < L:
        raise IndexError(f"layer {layer} out of range for a {L}-layer model")
    return layer % L


def _w_o(model: SoftPriorTransformer, layer: int) -> torch.Tensor:
    """W_O^h for every head: [H, d_head, d_model] (the same split as the model's ``hook_result``)."""
    cfg = model.cfg
    return model.blocks[layer].attn.out_proj.weight.detach().T.reshape(cfg.n_heads, cfg.d_head, cfg.d_model)


def _query_index(query_pos, B: int, T: int) -> torch.Tensor:
    q = torch.as_tensor(query_pos, dtype=torch.long)
    q = q.expand(B) if q.dim() == 0 else q
    if q.shape != (B,):
        raise ValueError(f"query_pos must be an int or a [B]={B} tensor, got shape {tuple(q.shape)}")
    q = torch.where(q < 0, q + T, q)
    if (q < 0).any() or (q >= T).any():
        raise IndexError(f"query_pos out of range for length {T}")
    return q


# ------------------------------------------------------------------------------------ patterns
def attention_patterns(model: SoftPriorTransformer, inputs: torch.Tensor, gate_pos=None,
                       gate_content=None) -> dict[int, torch.Tensor]:
    """{layer: A^l} with A^l of shape [B, H, T, T] (rows: queries, columns: keys; causal)."""
    names = [_pattern_name(l) for l in range(model.cfg.n_layers)]
    _, cache = _run(model, inputs, names, gate_pos, gate_content)
    return {l: cache[n] for l, n in enumerate(names)}


def head_value_contributions(model: SoftPriorTransformer, inputs: torch.Tensor, layer: int,
                             query_pos=-1, gate_pos=None, gate_content=None) -> torch.Tensor:
    """Per-head, per-source value contribution at one query position: a [B, H, T] tensor with

        C_b[h, j] = || A^{l,h}_b[q, j] * (v^{l,h}_b[j] @ W_O^h) ||_2

    (the Euclidean norm, over d_model, of what source position j writes into the residual stream
    at query q through head h). Summed as vectors over j these terms give the head's output
    (``hook_result``) at q. ``query_pos``: an int (negative counts from the end) or a [B] tensor of
    per-example positions. Positions after q get 0 (causal mask)."""
    layer = _check_layer(model, layer)
    pre = f"blocks.{layer}.attn."
    _, cache = _run(model, inputs, [pre + "hook_pattern", pre + "hook_v"], gate_pos, gate_content)
    return _contributions(model, cache, layer, query_pos)


def _contributions(model, cache, layer: int, query_pos) -> torch.Tensor:
    pre = f"blocks.{layer}.attn."
    pattern, v = cache[pre + "hook_pattern"], cache[pre + "hook_v"]  # [B,H,T,T], [B,T,H,dh]
    B, H, T, _ = pattern.shape
    q = _query_index(query_pos, B, T)
    a = pattern[torch.arange(B), :, q]  # [B, H, T]
    vo = torch.einsum("bjhe,hed->bhjd", v, _w_o(model, layer).to(v.dtype))  # [B, H, T, d]
    return a * vo.norm(dim=-1)  # the pattern is non-negative: ||a * x|| = a * ||x||


# ------------------------------------------------------------------------------------ successor mass
def answer_mask(task, batch) -> torch.Tensor:
    """[B, T] bool: the context positions that hold the correct answer token, as the task's generator
    states them (``Task.answer_mask``: associative recall's target value, Markov's successor after an
    earlier occurrence of the final token). ValueError for a task without an answer position (linear
    ICL, a plugin task that defines no ``answer_mask``)."""
    mask_of = getattr(task, "answer_mask", None)
    if mask_of is None:
        raise ValueError(f"successor-value mass needs a task whose generator defines answer_mask(batch); "
                         f"got {type(task).__name__}")
    return mask_of(batch).bool()


def successor_value_mass(model: SoftPriorTransformer, batch, task, gate_pos=0.0, gate_content=0.0,
                         query_pos=-1) -> torch.Tensor:
    """Successor-value mass per head, an [L, H] tensor (mechanism trace measure (i)):

        M[l, h] = mean_b  sum_{j in answer(b)} C^l_b[h, j] / sum_j C^l_b[h, j]

    where C^l is ``head_value_contributions`` at the query position (default: the final position,
    where the task reads its answer) and answer(b) is ``answer_mask(task, batch)``: the share of the
    head's value-contribution norm that comes from the position holding the correct answer token.
    A head whose contributions are all zero (e.g. W_O = 0) gets 0. Defaults to the zero gate."""
    mask = answer_mask(task, batch).to(torch.get_default_dtype())  # [B, T]
    L = model.cfg.n_layers
    names = [f"blocks.{l}.attn.{n}" for l in range(L) for n in ("hook_pattern", "hook_v")]
    _, cache = _run(model, batch.inputs, names, gate_pos, gate_content)
    out = []
    for l in range(L):
        c = _contributions(model, cache, l, query_pos)  # [B, H, T]
        total = c.sum(-1)
        hit = (c * mask[:, None, :].to(c.dtype)).sum(-1)
        share = torch.where(total > 0, hit / total.clamp_min(torch.finfo(c.dtype).tiny), torch.zeros_like(total))
        out.append(share.mean(0))
    return torch.stack(out)


# ------------------------------------------------------------------------------------ ablation
def mean_ablation(model: SoftPriorTransformer, inputs: torch.Tensor, layer: int, head: int | Sequence[int],
                  gate_pos=0.0, gate_content=0.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (as ``model(inputs, gate_pos, gate_content, positions=positions)``) with the output of
    ``head`` (an int or several) in ``layer`` replaced by its batch mean: a hook on
    ``blocks.{layer}.attn.hook_z`` sets z[b, i, h] to mean_b' z[b', i, h] at every position i. The
    mean is taken over this batch at these gates (layers below are untouched, so it is the clean
    mean). Defaults to the zero gate."""
    layer = _check_layer(model, layer)
    heads = [head] if isinstance(head, int) else list(head)
    bad = [h for h in heads if not 0 <= h < model.cfg.n_heads]
    if bad:
        raise IndexError(f"heads {bad} out of range for n_heads={model.cfg.n_heads}")

    def ablate(z, name):
        z = z.clone()
        z[:, :, heads] = z[:, :, heads].mean(0, keepdim=True)
        return z

    with torch.no_grad(), model.hooks([(f"blocks.{layer}.attn.hook_z", ablate)]):
        return model(inputs, gate_pos, gate_content, positions=positions)


def ablation_importance(model: SoftPriorTransformer, task, batch, gates=(0.0, 0.0)) -> torch.Tensor:
    """Mean-ablation importance per head, an [L, H] tensor (mechanism trace measure (ii)): the metric drop at
    ``gates`` (default: both 0) when the head's output is replaced by its batch mean,

        I[l, h] = acc(clean) - acc(head (l, h) mean-ablated)

    for accuracy tasks; for MSE tasks (lower is better) I = mse(ablated) - mse(clean), so that a
    positive value always means "the head matters". Scored at ``task.loss_positions`` with
    ``task.score``, like the trainer's evaluation."""
    g_pos, g_content = gates
    pos = task.loss_positions(batch.inputs.shape[1])
    sign = -1.0 if task.metric == "mse" else 1.0
    with torch.no_grad():
        base = float(task.score(model(batch.inputs, g_pos, g_content, positions=pos), batch.targets))
    L, H = model.cfg.n_layers, model.cfg.n_heads
    out = torch.zeros(L, H)
    for l in range(L):
        for h in range(H):
            logits = mean_ablation(model, batch.inputs, l, h, g_pos, g_content, positions=pos)
            out[l, h] = sign * (base - float(task.score(logits, batch.targets)))
    return out


# ------------------------------------------------------------------------------------ scores
def previous_token_score(model: SoftPriorTransformer, inputs: torch.Tensor, gate_pos=None,
                         gate_content=None) -> torch.Tensor:
    """Previous-token score per head, [L, H]:  P[l, h] = mean_{b, 1 <= i < T} A^{l,h}_b[i, i-1]
    (1 for a head that always attends to the previous token)."""
    pats = attention_patterns(model, inputs, gate_pos, gate_content)
    return torch.stack([p.diagonal(-1, dim1=-2, dim2=-1).mean((0, 2)) for p in pats.values()])


def repeated_random_tokens(batch_size: int, half_len: int, vocab: int, generator: torch.Generator | None = None,
                           distinct: bool = True) -> torch.Tensor:
    """[B, 2n] tokens [r, r] with r random of length n = half_len; ``distinct`` draws r without
    replacement (needs vocab >= n) so every token of the second copy has one earlier occurrence."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if distinct:
        if vocab < half_len:
            raise ValueError(f"distinct tokens need vocab >= half_len ({vocab} < {half_len})")
        r = torch.rand(batch_size, vocab, generator=g).argsort(-1)[:, :half_len]
    else:
        r = torch.randint(0, vocab, (batch_size, half_len), generator=g)
    return torch.cat([r, r], 1)


def induction_score(model: SoftPriorTransformer, inputs: torch.Tensor | None = None, gate_pos=None,
                    gate_content=None, batch_size: int = 64, seed: int = 0) -> torch.Tensor:
    """Induction score per head, [L, H], on a repeated sequence [r, r] of length T = 2n:

        S[l, h] = mean_{b, n <= i < 2n} A^{l,h}_b[i, i - n + 1]

    i.e. the attention from each position of the second copy to the token right after that token's
    first occurrence (the diagonal at offset n - 1 = T/2 - 1). ``inputs`` must have that form; None
    draws ``repeated_random_tokens`` with n = n_ctx // 2 distinct tokens (where the vocabulary allows)
    from ``seed``."""
    if model.cfg.d_in is not None:
        raise ValueError("induction_score needs a token model")
    if inputs is None:
        n = model.cfg.n_ctx // 2
        inputs = repeated_random_tokens(batch_size, n, model.cfg.vocab, torch.Generator().manual_seed(seed),
                                        distinct=model.cfg.vocab >= n)
    T = inputs.shape[1]
    n = T // 2
    if T % 2 or n < 1 or not torch.equal(inputs[:, :n], inputs[:, n:]):
        raise ValueError("induction_score needs inputs of the form [r, r] (even length, second half = first)")
    pats = attention_patterns(model, inputs, gate_pos, gate_content)
    # diagonal(-(n-1)) holds A[i, i-n+1] for i = n-1 .. 2n-1; drop i = n-1 (still in the first copy)
    return torch.stack([p.diagonal(-(n - 1), dim1=-2, dim2=-1)[..., 1:].mean((0, 2)) for p in pats.values()])


# ------------------------------------------------------------------------------------ traces
def prior_profile(model: SoftPriorTransformer, inputs: torch.Tensor, gate_pos=None) -> dict:
    """How local and how strong the positional prior is as the model applies it (docs/STUDY.md, "The
    atlas"): per layer that carries B^pos (the soft prior's table: every layer, trained from its
    initialisation, zero outside ``prior_layers``; another family: ``prior_layers``, the others have no
    bias) and head, the gated bias g_pos B^pos (``hook_pos_bias``,
    at the model's own gate unless ``gate_pos`` forces one) read over each query's causal keys j <= i:

    - locality: the attention the gated prior alone would give (softmax over j of g_pos B^pos_ij) on the
      query's own and the previous key, j in {i, i - 1}; no prior gives 2 / (i + 1);
    - strength: the range max_j - min_j of g_pos B^pos_ij, in logits;

    each the mean over queries i >= 1, heads and those layers. ``inputs``: one batch the model reads
    (only its length matters; B^pos is the same for every example). {"locality", "strength",
    "uniform"}: ``uniform``, the locality of no prior at this length."""
    layers = [l for l in range(model.cfg.n_layers) if model.cfg.prior and (
        model.blocks[l].attn.prior_module is None or l in model.cfg.prior_layers)]  # the soft table: every layer
    names = [f"blocks.{l}.attn.hook_pos_bias" for l in layers]
    _, cache = _run(model, inputs[:1], names, gate_pos=gate_pos)
    g, _ = model.gates(gate_pos)
    T = inputs.shape[1]
    i = torch.arange(1, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    loc, rng = [], []
    for l, name in zip(layers, names):
        gb = g[l].detach()[:, None, None] * cache[name].detach().float()  # [H, T, T]
        seen = gb.masked_fill(~causal, float("-inf"))  # each query's causal keys
        p = seen.softmax(-1)
        loc.append((p[:, i, i] + p[:, i, i - 1]).mean())
        rng.append((seen.amax(-1) - gb.masked_fill(~causal, float("inf")).amin(-1))[:, 1:].mean())
    uniform = float((2.0 / (i + 1.0)).mean())
    if not layers:
        return {"locality": uniform, "strength": 0.0, "uniform": uniform}
    return {"locality": float(torch.stack(loc).mean()), "strength": float(torch.stack(rng).mean()), "uniform": uniform}


def _strip_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept plain model state dicts and a single run's checkpoint tensors (``model.`` prefix, each
    stacked on a run dimension of 1 by ``loop.checkpoint``)."""
    if any(k.startswith("model.") for k in sd):
        w = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
        if any(v.dim() == 0 or v.shape[0] != 1 for v in w.values()):
            raise ValueError("checkpoint tensors of a group (run dimension > 1): take one run's slice first")
        return {k: v[0] for k, v in w.items()}
    return sd


def trace(snapshots: Sequence[tuple[int, dict[str, torch.Tensor]]], cfg, batch=None, n_examples: int | None = None,
          gates=(0.0, 0.0), task=None):
    """Mechanism trace over training checkpoints (DESIGN.md, "Mechanism traces") as a long pandas
    DataFrame with one row per (step, layer, head) and columns

        step, layer, head, successor_mass, ablation_importance, base_score

    ``successor_mass`` is ``successor_value_mass`` (NaN for tasks without an answer position, e.g.
    linear_icl), ``ablation_importance`` is ``ablation_importance``, both at ``gates`` (default the zero
    gate), and ``base_score`` is the un-ablated metric at those gates. ``snapshots``: (step, state dict)
    pairs; state dicts from the trainer's checkpoints (keys prefixed ``model.``) are accepted. ``cfg``:
    the run's RunConfig. The batch defaults to the run's validation set (``cfg.n_val`` examples, or
    ``n_examples``, from ``cfg.val_seed`` at length ``cfg.model.n_ctx``), the same for every step."""
    import pandas as pd

    from ..tasks.generators import make_task

    task = task if task is not None else make_task(cfg.task)
    if batch is None:
        n = n_examples or cfg.n_val
        batch = cfg.validation_batch(task, n=n)
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the caller's RNG alone
        model = SoftPriorTransformer(cfg.model)
    model.eval()
    pos = task.loss_positions(batch.inputs.shape[1])
    try:
        answer_mask(task, batch)
        has_answer = True
    except ValueError:  # e.g. linear_icl: no answer token
        has_answer = False
    rows = []
    for step, sd in snapshots:
        model.load_state_dict(_strip_state(sd))
        if has_answer:
            mass = successor_value_mass(model, batch, task, *gates)
        else:
            mass = torch.full((model.cfg.n_layers, model.cfg.n_heads), float("nan"))
        imp = ablation_importance(model, task, batch, gates)
        with torch.no_grad():
            base = float(task.score(model(batch.inputs, *gates, positions=pos), batch.targets))
        for l in range(model.cfg.n_layers):
            for h in range(model.cfg.n_heads):
                rows.append({"step": int(step), "layer": l, "head": h, "successor_mass": float(mass[l, h]),
                             "ablation_importance": float(imp[l, h]), "base_score": base})
    return pd.DataFrame(rows, columns=["step", "layer", "head", "successor_mass", "ablation_importance",
                                       "base_score"])


def trace_matrix(df, column: str = "successor_mass"):
    """A steps x heads table (columns "L{layer}H{head}") of one trace column, for heatmaps."""
    d = df.assign(unit=[f"L{l}H{h}" for l, h in zip(df["layer"], df["head"])])
    return d.pivot(index="step", columns="unit", values=column).sort_index()


def _summ(df, column: str, threshold: float, n_examples: int | None = None) -> dict:
    last = df[df["step"] == df["step"].max()]
    if last[column].isna().all():
        return {"top_head": None, "top_value": float("nan"), "first_step": None, "first_step_any": None}
    top = last.loc[last[column].idxmax()]
    head = (int(top["layer"]), int(top["head"]))
    # above noise: an accuracy measured on n examples has standard error sqrt(p (1 - p) / n), so a drop
    # counts where it clears the threshold by two of them (None: the threshold alone)
    p = df["base_score"].clip(0.0, 1.0)
    bar = threshold + (2.0 * (p * (1.0 - p) / n_examples) ** 0.5 if n_examples else 0.0)
    above = df[column] >= bar
    mine = df[above & (df["layer"] == head[0]) & (df["head"] == head[1])].sort_values("step")
    crossed = mine
    crossed_any = df[above]
    return {"top_head": head, "top_value": float(top[column]),
            "first_step": int(crossed["step"].iloc[0]) if len(crossed) else None,
            "first_step_any": int(crossed_any["step"].min()) if len(crossed_any) else None}


def summarise_trace(df, mass_threshold: float = 0.25, ablation_threshold: float = 0.03,
                    n_examples: int | None = None) -> dict:
    """Per-seed summary of a ``trace`` (DESIGN.md, "Mechanism traces"). The top head of a measure is
    the (layer, head) with the largest value at the final traced step; its first step is the first traced step at which
    that head's value is >= the threshold (None if never); ``*_first_step_any`` is the first step at
    which any head crosses. With ``n_examples`` (the traced batch), an ablation drop counts only above
    noise: at least the threshold plus two standard errors of the accuracy it is a drop of,
    sqrt(p (1 - p) / n) at that step's base score p (.027 at p = .1, n = 512). Keys:

        top_successor_head, top_successor_mass, successor_first_step, successor_first_step_any,
        top_ablation_head, top_ablation_importance, ablation_first_step, ablation_first_step_any,
        mass_threshold, ablation_threshold
    """
    m = _summ(df, "successor_mass", mass_threshold)
    a = _summ(df, "ablation_importance", ablation_threshold, n_examples)
    return {"top_successor_head": m["top_head"], "top_successor_mass": m["top_value"],
            "successor_first_step": m["first_step"], "successor_first_step_any": m["first_step_any"],
            "top_ablation_head": a["top_head"], "top_ablation_importance": a["top_value"],
            "ablation_first_step": a["first_step"], "ablation_first_step_any": a["first_step_any"],
            "mass_threshold": mass_threshold, "ablation_threshold": ablation_threshold}
