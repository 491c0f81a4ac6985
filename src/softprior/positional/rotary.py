"""Rotary position embedding (RoPE, Su et al. 2021)."""

from __future__ import annotations

import torch
from .base import PositionalScheme


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    """The split-halves rotation of the first ``width`` columns of x: (x1, x2) = (x[k], x[k + width/2])
    -> (x1 cos - x2 sin, x1 sin + x2 cos); columns after ``width`` pass unchanged (the fast path's
    content-factor columns). With -sin it is the inverse rotation (and the rotation's backward)."""
    half = width // 2
    x1, x2 = x[..., :half], x[..., half:width]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., width:]], dim=-1)


class RoPE(PositionalScheme):
    """rope: rotary position embedding over the full head dimension.

    Formula: for k = 0..dh/2-1, inv_freq_k = 1 / base^(2k/dh) (base 10000); at position t the pair
    (x1, x2) = (x[k], x[k + dh/2]) becomes (x1 cos(t w_k) - x2 sin(t w_k), x1 sin(t w_k) + x2 cos(t w_k)).
    q is rotated at its query positions, k at its key positions, with the same pairing, so q_i.k_j
    depends on positions only through i - j. The pairing is the split-halves convention of GPT-NeoX
    and Hugging Face's ``rotate_half`` (dims k and k + dh/2). x-transformers' ``RotaryEmbedding``
    pairs adjacent dims (2k, 2k + 1) instead; the two are the same rotation up to one fixed
    permutation of the head dims applied to both q and k, which leaves q.k unchanged and which the
    learned Q/K projections absorb, so the function class is the same.
    Reference: Su et al. 2021 (RoFormer), eq. 34; GPT-NeoX for the pairing; x-transformers
    ``RotaryEmbedding`` for the base. Unlike x-transformers' default (which rotates only part of the
    head), all dh dims are rotated, the slowest pair included.
    No parameters (nothing to share). Beyond the training length: angles t w_k for t >= n_ctx were
    never seen; the fast pairs wrap around, the slow pairs (w_7 = 10^-3.5 at dh = 16) reach angles
    never trained. RoPE is known to extrapolate poorly; we keep it as the reference has it."""

    name = "rope"

    def __init__(self, *, base: float = 10000.0, **dims):
        super().__init__(**dims)
        if self.d_head % 2:
            raise ValueError(f"rope needs an even head dimension, got d_head={self.d_head}")
        self.base = base

    def angles(self, pos: torch.Tensor, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of t w_k at positions ``pos``, each (T, dh/2), computed in float32, or in float64 for a
        float64 model (the model's dtype; also read by the fast path)."""
        dt = torch.float64 if dtype == torch.float64 else torch.float32
        half = self.d_head // 2
        inv_freq = self.base ** (-torch.arange(half, device=device, dtype=dt) * 2 / self.d_head)
        angle = pos.to(device=device, dtype=dt)[:, None] * inv_freq  # (T, dh/2)
        return angle.cos(), angle.sin()

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.angles(pos, x.device, x.dtype)
        return rotate_pairs(x, cos.to(x.dtype), sin.to(x.dtype), self.d_head)

    def rotate(self, q, k, qpos, kpos):
        return self._rotate(q, qpos), self._rotate(k, kpos)
