"""A plain, straightforward nn.Module version of the base soft-prior model and its training step.

This is the yardstick for ``softprior bench``: what one would write first, with separate Q/K/V
projections, the relative-position bias materialised as a [B, H, T, T] tensor, logits at every
position, the default (per-parameter loop) AdamW and default gradient clipping. It computes the
same function as ``softprior.model.transformer`` (same equation), but none of the engineering.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RefAttention(nn.Module):
    def __init__(self, d, H, n_ctx, r=2):
        super().__init__()
        self.H, self.dh, self.r = H, d // H, r
        self.q, self.k, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.cu, self.cw = nn.Linear(d, H * r, bias=False), nn.Linear(d, H * r, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(H, n_ctx))

    def forward(self, x, g_pos, g_content):
        B, T, d = x.shape
        H, dh, r = self.H, self.dh, self.r
        q = self.q(x).view(B, T, H, dh).transpose(1, 2)
        k = self.k(x).view(B, T, H, dh).transpose(1, 2)
        v = self.v(x).view(B, T, H, dh).transpose(1, 2)
        u = self.cu(x).view(B, T, H, r).transpose(1, 2)
        w = self.cw(x).view(B, T, H, r).transpose(1, 2)
        i = torch.arange(T)
        offsets = (i[:, None] - i[None, :]).clamp(0, self.pos_bias.shape[1] - 1)
        b_pos = self.pos_bias[:, offsets].unsqueeze(0).expand(B, H, T, T).contiguous()
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh) + g_pos * b_pos + g_content * (u @ w.transpose(-1, -2))
        scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        z = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(B, T, d)
        return self.o(z)


class RefModel(nn.Module):
    def __init__(self, vocab=32, d=64, H=4, L=2, n_ctx=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(L))
        self.attns = nn.ModuleList(RefAttention(d, H, n_ctx) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.gate_logits = nn.Parameter(torch.zeros(2))

    def forward(self, tokens):
        g = torch.sigmoid(self.gate_logits)
        x = self.embed(tokens)
        for ln, attn in zip(self.lns, self.attns):
            x = x + attn(ln(x), g[0], g[1])
        return self.ln_f(x) @ self.embed.weight.T


def make_reference_step(d=64, H=4, L=2, batch=64, T=32, vocab=32, seed=0):
    """A closure that performs one training step of the plain reference model on assoc-recall-like data."""
    torch.manual_seed(seed)
    model = RefModel(vocab, d, H, L, T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)

    def step():
        tokens = torch.randint(0, vocab, (batch, T), generator=gen)
        targets = torch.randint(0, vocab, (batch,), generator=gen)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, -1], targets)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return step, model
