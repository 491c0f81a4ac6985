"""Absolute positions: learned absolute embeddings (vanilla Transformer) and NoPE."""

from __future__ import annotations

import torch
import torch.nn as nn
from .base import DEFAULT_MAX_LEN, PositionalScheme


class LearnedAbsolute(PositionalScheme):
    """vanilla: a learned absolute position table added to the token embeddings.

    Formula: x_t = E[token_t] + P[t] * d_model^-1/2, P a [max_len, d_model] table.
    Reference: x-transformers ``AbsolutePositionalEmbedding`` (x_transformers/x_transformers.py).
    Init: P ~ N(0, 1) (nn.Embedding's default) and the d_model^-1/2 output scale, as the reference.
    Sharing: one table per model, as the reference. Only the instance with ``layer == 0`` owns the
    table; instances of other layers have no parameters and their ``embed_positions`` returns None
    (every call is valid on every instance; the model calls it on layer 0's).
    Beyond the training length: the table has max(n_ctx, max_len) rows, max_len = 128 by default,
    so T = 120 runs. Rows n_ctx..max_len-1 (32..127 at n_ctx = 32) never receive a gradient: at
    T > n_ctx those positions get their random initial vectors (shrunk only by weight decay, if the
    optimiser decays this 2-D parameter). That is the honest behaviour of a learned absolute
    table, not a bug. A length above max_len raises (pass ``max_len=`` to make_scheme)."""

    name = "vanilla"

    def __init__(self, *, max_len: int = DEFAULT_MAX_LEN, **dims):
        super().__init__(**dims)
        self.max_len = max(self.n_ctx, max_len)
        self.scale = self.d_model ** -0.5
        if self.layer == 0:
            self.table = nn.Parameter(torch.randn(self.max_len, self.d_model))
        else:
            self.table = None

    def embed_positions(self, T: int) -> torch.Tensor | None:
        if self.table is None:
            return None
        if T > self.max_len:
            raise ValueError(f"vanilla position table has {self.max_len} rows but T={T}; "
                             f"build the scheme with max_len >= {T}")
        return self.table[:T] * self.scale


class NoPE(PositionalScheme):
    """nope: no positional term; only the causal mask orders the tokens.

    Reference: Kazemnejad et al. 2023 (a causal Transformer with no positional encoding).
    No parameters. Beyond the training length: nothing position-dependent to extrapolate; the
    model's behaviour at T = 120 depends only on how its content circuits handle longer contexts."""

    name = "nope"
