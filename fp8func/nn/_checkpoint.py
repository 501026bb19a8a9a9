"""Activation checkpointing with delayed-scaling layers: ``checkpoint_context``.

A delayed-scaling ``Fp8Linear`` casts with its state's scale and moves the state on (records the
amax) at every training forward. Activation checkpointing runs a forward twice: once, then again
inside the backward to rebuild what it did not keep. The second run would cast with the state
that already moved on (other bytes than the forward's: the gradients of a forward that never ran)
and record the amax a second time. With ``context_fn=checkpoint_context`` the first run stashes
each layer's state before it moves on, and the recomputation casts with exactly that state and
records nothing: checkpointed training is bitwise the training without it. Without the context
a recomputation raises (``Fp8Linear.forward``), rather than train on mismatched gradients.

Example:
    >>> from torch.utils.checkpoint import checkpoint
    >>> y = checkpoint(block, x, use_reentrant=False, context_fn=fp8func.nn.checkpoint_context)
    >>> # HF: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
    >>> #     "use_reentrant": False, "context_fn": fp8func.nn.checkpoint_context})
"""

from __future__ import annotations

import threading

__all__ = ["checkpoint_context"]

# The phases entered on this thread, innermost last. Recomputation runs on the thread that runs
# the backward, which is where checkpoint enters the recompute context too.
_LOCAL = threading.local()


def _phases() -> list:
    if not hasattr(_LOCAL, "phases"):
        _LOCAL.phases = []
    return _LOCAL.phases


class _Phase:
    """``with``: the enclosed forwards run in ``mode`` ("record" or "replay") over ``stash``."""

    def __init__(self, mode: str, stash: dict):
        self.mode, self.stash = mode, stash

    def __enter__(self):
        _phases().append(self)
        return self

    def __exit__(self, *exc):
        _phases().pop()
        return False


def checkpoint_context() -> tuple[_Phase, _Phase]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around
    delayed-scaling layers: (the first forward's context, the recomputation's). See the module
    docstring. Other layers are unaffected; one call per checkpointed region (checkpoint calls it)."""
    stash: dict = {}
    return _Phase("record", stash), _Phase("replay", stash)


def current_phase() -> _Phase | None:
    """The innermost ``checkpoint_context`` phase entered on this thread, if any."""
    phases = _phases()
    return phases[-1] if phases else None
