"""AdamW on PyTorch's fused kernel, without ``torch.optim``'s start-up cost.

The update is ``torch.optim.AdamW(..., fused=True)``'s, computed by the same kernel
(``torch._fused_adamw_``; Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
Algorithm 2, with PyTorch's bias correction): per parameter with gradient g at step t,

    p <- p (1 - lr * wd)
    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
    p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Why not ``torch.optim.AdamW`` itself: its constructor (``add_param_group``) and ``zero_grad`` are
wrapped in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` -- 2.3-2.8 s on
this machine, 10% of a whole 3,600-step base run, once in every process (each sweep worker, each
``softprior train``). Nothing here is compiled, so that import buys nothing. ``tests/test_optim.py``
holds this optimiser bit-equal to ``torch.optim.AdamW(fused=True)`` and its ``state_dict`` in the
same layout (so checkpoints load in either).

Fallback. ``torch._fused_adamw_`` is private, and its CPU kernel arrived after the ``torch>=2.2``
floor this package declares (torch 2.2/2.3 have the op for CUDA only). ``fused_available(device)``
probes the kernel once per device type (one call on a 1-element tensor); where it is missing or
raises, ``step`` hands the same parameter groups and the same state tensors to a
``torch.optim.AdamW`` (its non-fused implementation, the same Algorithm 2), so training works on
every supported torch. The non-fused kernels may round differently from the fused one (last bits);
runs are bit-identical only between machines that take the same branch.
"""

from __future__ import annotations

import torch

__all__ = ["AdamW", "fused_available"]

_FUSED_OK: dict[str, bool] = {}  # device type -> whether torch._fused_adamw_ ran there


def fused_available(device: torch.device | str = "cpu") -> bool:
    """Whether ``torch._fused_adamw_`` exists and runs on ``device``'s type (probed once per type)."""
    fn = getattr(torch, "_fused_adamw_", None)
    if fn is None:
        return False
    kind = torch.device(device).type
    if kind not in _FUSED_OK:
        p = torch.zeros(1, device=device)
        try:
            fn([p], [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)], [],
               [torch.ones((), device=device)], amsgrad=False, lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0,
               eps=1e-8, maximize=False, grad_scale=None, found_inf=None)
            _FUSED_OK[kind] = True
        except (RuntimeError, NotImplementedError, TypeError):  # no kernel for this backend / other signature
            _FUSED_OK[kind] = False
    return _FUSED_OK[kind]

# the flags torch.optim.AdamW(fused=True) keeps in each param group; saved so that torch's optimiser
# reads our state_dict as the same algorithm (a missing flag falls back to its default, e.g. Adam's L2)
_TORCH_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                "fused": True, "decoupled_weight_decay": True}


class AdamW:
    """``torch.optim.AdamW(param_groups, lr, betas, eps, fused=True)``: the same update, state and
    ``state_dict`` layout. ``param_groups``: an iterable of parameters, or of dicts with ``params``
    and optionally ``weight_decay`` / ``lr``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"AdamW needs lr, eps, weight_decay >= 0 (got lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay})")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW needs 0 <= betas < 1, got {betas}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._torch_opt = None  # torch.optim.AdamW, built only where the fused kernel is missing

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        grads = [p.grad for p in self._params() if p.grad is not None]
        if set_to_none:
            for p in self._params():
                p.grad = None
        elif grads:
            torch._foreach_zero_(grads)

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.state.get(p)
        if st is None:  # as torch.optim.Adam._init_group with fused=True: a float32 step on p's device
            st = self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return st

    @torch.no_grad()
    def step(self) -> None:
        params = self._params()
        if params and not fused_available(params[0].device):
            return self._step_torch()
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            if not ps:
                continue
            if any(p.grad.is_sparse for p in ps):
                raise RuntimeError("AdamW does not support sparse gradients")
            st = [self._state(p) for p in ps]
            steps = [s["step"] for s in st]
            torch._foreach_add_(steps, 1)
            b1, b2 = g["betas"]
            torch._fused_adamw_(ps, [p.grad for p in ps], [s["exp_avg"] for s in st],
                                [s["exp_avg_sq"] for s in st], [], steps, amsgrad=False, lr=float(g["lr"]),
                                beta1=b1, beta2=b2, weight_decay=g["weight_decay"], eps=g["eps"],
                                maximize=False, grad_scale=None, found_inf=None)

    def _step_torch(self) -> None:
        """The same update by ``torch.optim.AdamW`` (non-fused), on our groups and state tensors."""
        if self._torch_opt is None:
            self._torch_opt = torch.optim.AdamW([{"params": g["params"]} for g in self.param_groups], fused=False)
        for ours, theirs in zip(self.param_groups, self._torch_opt.param_groups):
            theirs.update(lr=float(ours["lr"]), betas=tuple(ours["betas"]), eps=ours["eps"],
                          weight_decay=ours["weight_decay"])
            for p in ours["params"]:
                if p.grad is not None:  # shared state: torch's 'step' counts, ours is the same tensor
                    if p.grad.is_sparse:
                        raise RuntimeError("AdamW does not support sparse gradients")
                    self._torch_opt.state[p] = self._state(p)
        self._torch_opt.step()

    # ----------------------------------------------------------------------- torch.optim's layout
    def state_dict(self) -> dict:
        index = {p: i for i, p in enumerate(self._params())}
        groups, n = [], 0
        for g in self.param_groups:
            groups.append({**_TORCH_FLAGS, **{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(n, n + len(g["params"])))})
            n += len(g["params"])
        return {"state": {index[p]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        params = self._params()
        if len(sd["param_groups"]) != len(self.param_groups) or \
                sum(len(g["params"]) for g in sd["param_groups"]) != len(params):
            raise ValueError("optimizer state_dict does not match this optimizer's parameter groups")
        for g, saved in zip(self.param_groups, sd["param_groups"]):
            wrong = {k: saved[k] for k in _TORCH_FLAGS if k in saved and k not in ("foreach", "fused")
                     and saved[k] != _TORCH_FLAGS[k]}
            if wrong:
                raise ValueError(f"optimizer state_dict is not AdamW's: {wrong}")
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()
                      if k in ("lr", "betas", "eps", "weight_decay")})
        self.state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            self.state[p] = {"step": torch.as_tensor(s["step"], dtype=torch.float32).to(p.device).reshape(()).clone(),
                             "exp_avg": s["exp_avg"].to(p).clone(), "exp_avg_sq": s["exp_avg_sq"].to(p).clone()}
