"""Compiled CPU kernels for the fast path (``fastpath.py``), each with a pure-PyTorch fallback.

``attention``: the fused attention operator (``kernels/attention.py``, ``kernels/attention.cpp``).
``step``: the whole training forward and backward of the commonest model in one operator
(``kernels/step.py``, ``kernels/step.cpp``); both are built into one library, sharing ``blocks.h``.
``build.py`` compiles both at first use, for one ISA level (``SOFTPRIOR_ISA``); ``isa()`` names it.
``attention_backend()`` says which attention runs ("fused-cpp" or "torch"), a run's summary records
which engine trained it (``fastpath.engine``); ``SOFTPRIOR_KERNELS=0`` forces the pure-PyTorch path,
``SOFTPRIOR_KERNELS=attention`` the attention operator without the whole-step one.
"""

from .attention import ENV, attention, attention_backend, available, build_error, isa

__all__ = ["attention", "available", "attention_backend", "build_error", "isa", "ENV"]
