"""The scheme interface (``PositionalScheme``, ``AdditiveBias``) and the helpers every family shares."""

from __future__ import annotations

import torch
import torch.nn as nn


DEFAULT_MAX_LEN = 128  # rows of the vanilla table: covers the T=120 length test


class UnknownSchemeError(ValueError):
    pass


def _offsets(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """i - j as a (Tq, T) long tensor."""
    return qpos[:, None] - kpos[None, :]


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Causal mask as booleans (Tq, T): key j visible from query i iff j <= i."""
    return kpos[None, :] <= qpos[:, None]


def _floor_clamp(p: torch.Tensor, lo: float, hi: float | None = None) -> torch.Tensor:
    """clamp(p, lo, hi) in the forward pass, identity in the backward pass (straight-through).

    The reference (KERPLE) rewrites ``param.data`` in place on every forward; a plain clamp would
    freeze a parameter pushed below the floor (zero gradient there). The straight-through clamp
    gives the same forward values without mutating weights, so it works under vmap and in eval."""
    return p + (p.clamp(min=lo, max=hi) - p).detach()


# ============================================================================ interface
class PositionalScheme(nn.Module):
    """Base class: the identity scheme. Subclasses override only what they change.

    Constructor keywords (all schemes): n_heads, d_head, d_model, n_ctx (training length), layer
    (this instance's layer index), n_layers."""

    name: str = "base"

    def __init__(self, *, n_heads: int, d_head: int, d_model: int, n_ctx: int, layer: int = 0,
                 n_layers: int = 1):
        super().__init__()
        self.n_heads, self.d_head, self.d_model = n_heads, d_head, d_model
        self.n_ctx, self.layer, self.n_layers = n_ctx, layer, n_layers

    def embed_positions(self, T: int) -> torch.Tensor | None:
        """[T, d_model] added to the token embeddings once per model, or None."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor):
        """q (B, H, Tq, dh), k (B, H, T, dh) -> rotated (q, k)."""
        return q, k

    def adjust_logits(self, logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """logits (B, H, Tq, T) = q.k/sqrt(dh), before the causal mask -> new (unmasked) logits."""
        return logits

    def mix_pattern(self, pattern: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """pattern (B, H, Tq, T) = softmax of the masked logits -> a row-stochastic causal pattern."""
        return pattern

    def extra_repr(self) -> str:
        return f"name={self.name!r}, layer={self.layer}, n_heads={self.n_heads}, n_ctx={self.n_ctx}"


class AdditiveBias(PositionalScheme):
    """A scheme that adds a bias b_h(i, j) to the scaled logits: s_ij = q.k/sqrt(dh) + b_h(i, j).

    Subclasses implement ``bias(qpos, kpos) -> (H, Tq, T)``; it is also handy for plots."""

    def bias(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def adjust_logits(self, logits, q, k, qpos, kpos):
        return logits + self.bias(qpos, kpos).to(logits.dtype)
