"""The fused CPU attention operator (``attention.cpp`` beside this file), built at first use.

``attention(q, k, v, bias)`` computes what ``fastpath._Attention`` computes, z = softmax(q k^T + bias) v
for a head-major batch (q [K*H*B, Tq, e], k [K*H*B, T, e], v [K*H*B, T, d_head], bias [K, H, Tq, T]
broadcast over the batch; the paper's logits Q K^T / sqrt(d_head) + g_content B^content folded into
q and k, and g_pos B^pos with the causal mask into bias: ``fastpath`` points 2 and 5), with the same
backward (dS = P * (dP - sum_j dP P), the softmax Jacobian applied row-wise; dbias summed over the
batch), one C++ loop per (run, head, batch) block with the block's scores in a thread-local buffer,
the blocks spread over torch's OpenMP threads (``torch.get_num_threads()``).

It is the custom operator ``torch.ops.softprior.attention_forward`` (returning z and the softmax P,
kept for the backward) with its autograd formula registered (``torch.library.register_autograd``)
through ``torch.ops.softprior.attention_backward``. The library is compiled at first use, once per
machine and ISA level (``build.py``: where it is built, for which ISA, and what happens when a build
fails or a killed build left its lock).

Where there is no compiler, the build fails, or ``SOFTPRIOR_KERNELS=0``, ``available()`` is False and
the fast path runs its pure-PyTorch ``_Attention`` (``attention_backend()`` says which: "fused-cpp" or
"torch"; "unused" in a process that has not asked).
"""

from __future__ import annotations

import os
import warnings

import torch

from .build import build_library, one_line, requested_isa

__all__ = ["attention", "available", "attention_backend", "build_error", "isa", "ENV"]

ENV = "SOFTPRIOR_KERNELS"  # "0": never build or use the fused operator (the pure-PyTorch path runs)
_state: dict = {"loaded": None, "error": None, "built_for": None}  # loaded: None (not tried), True or False


def _disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def _build() -> None:
    """Compile (or load the cached build of) the kernels' library (``build.py``) and register the
    attention operator's autograd."""
    _state["built_for"] = build_library()
    torch.library.register_autograd("softprior::attention_forward", _backward, setup_context=_setup_context)
    torch.library.register_fake("softprior::attention_forward", _forward_fake)


def available() -> bool:
    """Whether the fused operator runs: built (at the first call in this process) and not switched off
    by ``SOFTPRIOR_KERNELS=0``. A failed build warns once and leaves the pure-PyTorch path."""
    if _disabled():
        return False
    if _state["loaded"] is None:
        try:
            _build()
            _state["loaded"] = True
        except Exception as exc:  # no compiler, no ninja, a compile error: the pure-PyTorch path runs
            _state["loaded"], _state["error"] = False, one_line(exc)
            warnings.warn(f"softprior: the fused attention operator is unavailable ({_state['error']}); "
                          "the pure-PyTorch attention runs", RuntimeWarning, stacklevel=2)
    return bool(_state["loaded"])


def attention_backend(build: bool = True) -> str:
    """Which attention the fast path runs in this process: "fused-cpp" (this operator) or "torch"
    (``fastpath._Attention``). ``build=False`` does not try the build: "unused" where nothing has
    asked for it yet (a run summary records the backend its training used: ``provenance``)."""
    if not build and _state["loaded"] is None and not _disabled():
        return "unused"
    return "fused-cpp" if available() else "torch"


def isa() -> str:
    """The vector ISA of this process's numbers: the kernels' build (``build.py``: "avx512", "avx2",
    "neon" or "generic", with what a fallback build lacks) where they run, and ATen's own kernels
    ("aten AVX512", ...), which ``ATEN_CPU_CAPABILITY`` chooses. Recorded in every run summary
    (``provenance``): another ISA rounds otherwise in the last bits."""
    aten = torch.backends.cpu.get_cpu_capability()
    if _state["loaded"]:
        kernels = _state["built_for"]
    else:
        try:
            kernels = f"{requested_isa()} (not built)" if not _disabled() else "off"
        except ValueError:
            kernels = "invalid"
    return f"{kernels}; aten {aten}"


def build_error() -> str | None:
    """Why the build failed, if it did (one line)."""
    return _state["error"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """z = softmax(q k^T + bias) v through the fused operator (call only where ``available()``).
    q [N, Tq, e], k [N, T, e], v [N, T, dh], bias [K, H, Tq, T] with N = K*H*B in head-major order."""
    return torch.ops.softprior.attention_forward(q, k, v, bias)[0]


def _setup_context(ctx, inputs, output):
    q, k, v, bias = inputs
    ctx.save_for_backward(q, k, v, output[1], bias)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # P's gradient is never formed (zeros of [N, Tq, T] cost ~10% of a call)


def _backward(ctx, dz, _dp):
    """The gradients of q, k, v and bias (P is an auxiliary output: its own gradient is not taken)."""
    if dz is None:  # z's gradient undefined (grads are not materialised): nothing flows back
        return None, None, None, None
    q, k, v, p, bias = ctx.saved_tensors
    dq, dk, dv, db = torch.ops.softprior.attention_backward(dz, q, k, v, p, bias)
    need = ctx.needs_input_grad
    return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, db if need[3] else None


def _forward_fake(q, k, v, bias):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[0], q.shape[1], k.shape[1])
