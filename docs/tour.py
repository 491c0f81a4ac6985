# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of softprior
#
# Train a soft-prior Transformer, remove the prior, look at its attention, export it to
# TransformerLens, trace its mechanism over training, and read the run store as a DataFrame.
# `TOUR_STEPS` sets the training budget (CI runs this notebook with a tiny one; the paper's is 3,600).
# This file is the jupytext twin of `tour.ipynb`: edit either and run `jupytext --sync docs/tour.py`.

# %%
import os
import tempfile

import matplotlib.pyplot as plt
import torch

import softprior
from softprior import RunStore, load_results, make_run_config, run

STEPS = int(os.environ.get("TOUR_STEPS", "1200"))
store = RunStore(os.environ.get("TOUR_STORE", tempfile.mkdtemp(prefix="softprior-tour-")))

# %% [markdown]
# ## 1. Train a run
# `fade600` holds the prior's gates at 0.5, fades them to 0 over 450 steps from step 600, and trains on at
# g = 0. With a short budget the schedule is scaled so its shape survives (`paths.scale_path`).

# %%
from softprior.paths import get_path, scale_path

path = scale_path(get_path("fade600"), STEPS / 3600)
cfg = make_run_config("assoc_recall", path, seed=0, steps=STEPS, eval_every=max(STEPS // 12, 1), snapshot_every=max(STEPS // 6, 1))
summary = run(cfg, store, require_calibration=False)  # a scaled path is exploratory: no calibration record covers it
print({k: summary[k] for k in ("normal_acc", "zero_acc", "chance", "seconds")})

# %% [markdown]
# ## 2. Evaluate with the prior removed
# "zero" forces every gate to 0: the plain NoPE attention-only model. Any gate can be overridden.

# %%
from softprior.tasks import make_task
from softprior.train import evaluate

cfg, model = store.load_model(cfg.run_id)
task = make_task(cfg.task)
val = task.sample(256, cfg.model.n_ctx, torch.Generator().manual_seed(cfg.val_seed))
for name, gates in {"normal": (None, None), "zero": (0.0, 0.0), "pos only off": (0.0, None)}.items():
    print(name, evaluate(model, task, val.inputs, val.targets, *gates))

# %% [markdown]
# ## 3. Attention patterns at zero gate
# With circuitsvis installed the patterns are interactive; otherwise matplotlib draws them.

# %%
from softprior.analysis import attention_patterns

pats = attention_patterns(model, val.inputs[:1], 0.0, 0.0)  # {layer: [B, H, T, T]}
try:
    import circuitsvis as cv
    display(cv.attention.attention_patterns(tokens=[str(t) for t in val.inputs[0].tolist()], attention=pats[1][0]))  # noqa: F821
except ImportError:
    fig, axes = plt.subplots(len(pats), cfg.model.n_heads, figsize=(2.2 * cfg.model.n_heads, 2.2 * len(pats)))
    for l, p in pats.items():
        for h in range(cfg.model.n_heads):
            axes[l][h].imshow(p[0, h].numpy(), cmap="viridis")
            axes[l][h].set_title(f"L{l}H{h}", fontsize=8)
            axes[l][h].axis("off")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## 4. TransformerLens
# The export is a `HookedTransformer` with the prior baked in at the chosen gates, so every TransformerLens
# tool works on it; here `run_with_cache`.

# %%
try:
    from softprior.interop import to_hooked_transformer
    tl = to_hooked_transformer(model, gates=(0.0, 0.0))
    logits, cache = tl.run_with_cache(val.inputs[:8])
    ours = model(val.inputs[:8], 0.0, 0.0)
    print("max |TL - softprior| logits:", float((logits - ours).abs().max()))
    print("cached:", [k for k in cache.keys()][:6], "...")
except ImportError as e:
    print("TransformerLens is not installed:", e)

# %% [markdown]
# ## 5. A small mechanism trace
# Per head, over the stored snapshots: successor-value mass and zero-gate mean-ablation importance.

# %%
from softprior.analysis import trace, trace_matrix

df = trace(store.load_snapshots(cfg.run_id), cfg, n_examples=128)
mass = trace_matrix(df, "ablation_importance")
plt.figure(figsize=(5, 2.5))
plt.imshow(mass.T.values, aspect="auto", cmap="magma")
plt.yticks(range(len(mass.columns)), list(mass.columns))
plt.xticks(range(len(mass.index)), mass.index, rotation=90, fontsize=7)
plt.title("zero-gate ablation importance")
plt.colorbar()
plt.show()

# %% [markdown]
# ## 6. The run store as a DataFrame
# Every finished run with its config, results and provenance (code, torch, CPU, calibration record).

# %%
unforced = make_run_config("assoc_recall", "unforced", seed=0, steps=STEPS, eval_every=max(STEPS // 12, 1))
run(unforced, store)
res = load_results(store)
print(res[["path.name", "normal_acc", "zero_acc", "softprior_version", "torch_version", "calibration"]])
res.plot.bar(x="path.name", y=["normal_acc", "zero_acc"], figsize=(4, 3))
plt.show()
