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
through ``torch.ops.softprior.attention_backward``. The library is compiled by
``torch.utils.cpp_extension.load`` (g++ and ninja) into torch's extensions directory
(``$TORCH_EXTENSIONS_DIR``, default ~/.cache/torch_extensions), once per machine: a later process
loads the cached build. It is compiled for the CPU it runs on (``-march=native``), so its name
carries a digest of the CPU's flags.

Where there is no compiler, the build fails, or ``SOFTPRIOR_KERNELS=0``, ``available()`` is False and
the fast path runs its pure-PyTorch ``_Attention`` (``attention_backend()`` says which: "fused-cpp" or
"torch"; "unused" in a process that has not asked).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

__all__ = ["attention", "available", "attention_backend", "build_error", "ENV"]

ENV = "SOFTPRIOR_KERNELS"  # "0": never build or use the fused operator (the pure-PyTorch path runs)
_SOURCE = Path(__file__).with_name("attention.cpp")
_SOURCES = (_SOURCE, _SOURCE.with_name("step.cpp"))  # one library: the attention operator and the whole step
_HEADERS = (_SOURCE.with_name("blocks.h"),)
_state: dict = {"loaded": None, "error": None}  # loaded: None (not tried), True or False


def _disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def _cpu_tag() -> str:
    """A digest of this CPU's model and flags (the build is ``-march=native``)."""
    text = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text = "\n".join(sorted({ln for ln in lines if ln.startswith(("flags", "model name"))}))
    except OSError:
        import platform
        text = platform.processor() + platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _source_tag() -> str:
    """A digest of the sources and the header they share: ``cpp_extension`` rebuilds when a source
    changes, but not when only an included header does, so the header's edit names a new build."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))).hexdigest()[:10]


def _ensure_ninja() -> None:
    """``cpp_extension.load`` runs ``ninja`` from PATH: where it is not there, the ``ninja`` package's
    binary (a dependency of softprior) is put at PATH's end."""
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + ninja.BIN_DIR
        except ImportError:
            pass


def _build() -> None:
    """Compile (or load the cached build of) ``attention.cpp`` and ``step.cpp`` into one library and
    register the attention operator's autograd."""
    from torch.utils import cpp_extension
    _ensure_ninja()
    cpp_extension.load(name=f"softprior_kernels_{_cpu_tag()}_{_source_tag()}", sources=[str(p) for p in _SOURCES],
                       extra_cflags=["-O3", "-march=native", "-ffp-contract=fast",
                                     "-fno-tree-loop-distribute-patterns", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
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
            _state["loaded"], _state["error"] = False, _one_line(exc)
            warnings.warn(f"softprior: the fused attention operator is unavailable ({_state['error']}); "
                          "the pure-PyTorch attention runs", RuntimeWarning, stacklevel=2)
    return bool(_state["loaded"])


def _one_line(exc: Exception) -> str:
    """An exception as one line: a compiler's first ``error:`` line where the build printed one."""
    text = str(exc)
    errors = [ln.strip() for ln in text.splitlines() if "error:" in ln]
    return f"{type(exc).__name__}: " + (errors[0] if errors else (text.splitlines() or [""])[0])[:300]


def attention_backend(build: bool = True) -> str:
    """Which attention the fast path runs in this process: "fused-cpp" (this operator) or "torch"
    (``fastpath._Attention``). ``build=False`` does not try the build: "unused" where nothing has
    asked for it yet (a run summary records the backend its training used: ``provenance``)."""
    if not build and _state["loaded"] is None and not _disabled():
        return "unused"
    return "fused-cpp" if available() else "torch"


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
