"""A prior that is not in the paper: a Gaussian window over offsets with a learned width per head.

    B^pos_h(i, j) = -(i - j)^2 / (2 sigma_h^2),   sigma_h = softplus(w_h)

Head h starts with width sigma_h = prior_scale * (h + 1) (so the four heads of the base model look
1, 2, 3 and 4 tokens back at scale 1) and learns it. Like the paper's locality prior (Sec. 3), it
is a bias on the attention logits under the position gate g_pos, so every training path of the
paper (forced_zero, fades, hard switches, post hoc) can take it away; unlike the paper's table it
has one parameter per head, not one per offset.

    softprior study --plugin examples/gaussian_window.py --prior gaussian_window --task assoc_recall --quick

The file registers the family and the axis a study searches for it (the initial width's scale).
"""

import math

import torch
import torch.nn.functional as F

from softprior.model.priors import PositionalPrior, register_prior


def _inverse_softplus(y: float) -> float:
    """w with softplus(w) = y: log(exp(y) - 1), written stably for large y."""
    return y + math.log(-math.expm1(-y))


class GaussianWindow(PositionalPrior):
    def __init__(self, cfg, layer):
        super().__init__(cfg, layer)
        widths = [cfg.prior_scale * (h + 1) for h in range(cfg.n_heads)]
        self.width_param = torch.nn.Parameter(torch.tensor([_inverse_softplus(w) for w in widths]))

    def bias(self, qpos, kpos):
        offset = (qpos[:, None] - kpos[None, :]).clamp(min=0).to(self.width_param.dtype)  # i - j, (Tq, T)
        sigma = F.softplus(self.width_param)[:, None, None]  # (H, 1, 1)
        return -offset[None] ** 2 / (2 * sigma ** 2)


register_prior("gaussian_window", GaussianWindow,
               "Gaussian window over offsets, -(i-j)^2 / (2 sigma_h^2), learned width sigma_h per head",
               axes={"model.prior_scale": [1.0, 2.0, 0.5]})
