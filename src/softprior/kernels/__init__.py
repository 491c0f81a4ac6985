"""Compiled CPU kernels for the fast path (``fastpath.py``), each with a pure-PyTorch fallback.

``attention``: the fused attention operator (``kernels/attention.py``, ``kernels/attention.cpp``).
``attention_backend()`` says which attention runs ("fused-cpp" or "torch"); ``SOFTPRIOR_KERNELS=0``
forces the pure-PyTorch path.
"""

from .attention import ENV, attention, attention_backend, available, build_error

__all__ = ["attention", "available", "attention_backend", "build_error", "ENV"]
