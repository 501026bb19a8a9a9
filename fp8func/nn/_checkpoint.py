"""Activation checkpointing with delayed-scaling layers: nothing to do, and ``checkpoint_context``.

Activation checkpointing runs a forward twice: once, then again inside the backward to rebuild
what it did not keep. A delayed-scaling ``Fp8Linear`` never changes its state in the forward
(the next state arrives as the state's gradient, after the layer's backward), so the
recomputation casts with exactly the forward's scales: checkpointed training is bitwise the
training without it, with the stock ``torch.utils.checkpoint.checkpoint`` or HF's
``gradient_checkpointing_enable()``.

``checkpoint_context`` is kept as a ``context_fn`` that changes nothing, so code that passes it
keeps working.

Example:
    >>> from torch.utils.checkpoint import checkpoint
    >>> y = checkpoint(block, x, use_reentrant=False)
"""

from __future__ import annotations

import contextlib

__all__ = ["checkpoint_context"]


def checkpoint_context() -> tuple[contextlib.nullcontext, contextlib.nullcontext]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: two
    contexts that change nothing (delayed-scaling layers need none; see the module docstring)."""
    return contextlib.nullcontext(), contextlib.nullcontext()
