"""Activation checkpointing with FP8 layers: ``selective_checkpoint_policy`` and ``checkpoint_context``.

Activation checkpointing runs a forward twice: once, then again inside the backward to rebuild
what it did not keep. An op-level selective policy (``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``, torchtitan's ``--activation_checkpoint.mode selective``)
keeps the outputs of the ops it lists (the matmuls, attention) and recomputes the rest: for an FP8
layer that means casting every linear's input a second time (its amax and its cast, which the
backward needs for the weight gradient: ``x.T`` in FP8). ``selective_checkpoint_policy`` adds
those casts to what is kept: the FP8 payloads the backward reads (one byte per element of each
linear input, where the recomputation would have read the two-byte input again to make them).
The numbers do not change: the kept payloads are the ones the recomputation would make.

A delayed-scaling ``Fp8Linear`` never changes its state in the forward (the next state arrives as
the state's gradient, after the layer's backward), so the recomputation casts with exactly the
forward's scales: checkpointed training is bitwise the training without it, with the stock
``torch.utils.checkpoint.checkpoint`` or HF's ``gradient_checkpointing_enable()``.
``checkpoint_context`` is kept as a ``context_fn`` that changes nothing, so code that passes it
keeps working.

Example:
    >>> from torch.utils.checkpoint import checkpoint
    >>> y = checkpoint(block, x, use_reentrant=False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from torch.utils.checkpoint import CheckpointPolicy

from ..kernels._dispatch import QUANTIZE_FUSE_AMAX_ARG, QUANTIZE_OP

__all__ = ["checkpoint_context", "selective_checkpoint_policy"]

def _activation_cast(op, args: tuple, kwargs: dict) -> bool:
    name = getattr(op, "name", None)
    # fuse_amax: an input made inside the region; a weight's cast (False) would pin an unsharded copy
    if not callable(name) or name() != QUANTIZE_OP:
        return False
    arg = QUANTIZE_FUSE_AMAX_ARG
    return bool(args[arg] if len(args) > arg else kwargs.get("fuse_amax", False))


def selective_checkpoint_policy(save: Iterable | Callable = ()) -> Callable:
    """A ``policy_fn`` for ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` that keeps
    fp8func's casts of the layers' inputs (the FP8 payloads the backward reads) besides what ``save``
    keeps, instead of casting those inputs again in the backward.

    ``save``: the ops whose outputs are kept (a list or set of ``OpOverload``, e.g. torchtitan's
    ``_op_sac_save_list``), everything else recomputed; or a policy function of your own
    (``(ctx, op, *args, **kwargs) -> CheckpointPolicy``), asked about every op but those casts.
    The casts it keeps are those of tensors computed inside the checkpointed region by the fused
    kernels (``fp8func.kernels``: CUDA); a weight's cast is recomputed (keeping it would hold an
    unsharded FP8 copy of every FSDP2 weight until the backward), and so is a cast made by graph
    ops (the reference path: CPU, DTensor under ``torch.compile``). The numbers do not change: a
    kept payload is the one the recomputation makes. Memory: one byte per element of each FP8
    linear's input, per checkpointed layer.

    Example:
        >>> import torch, fp8func as f8
        >>> from torch.utils.checkpoint import create_selective_checkpoint_contexts
        >>> policy = f8.nn.selective_checkpoint_policy([torch.ops.aten.mm.default])
        >>> context_fn = lambda: create_selective_checkpoint_contexts(policy)
        >>> policy(None, torch.ops.aten.mm.default), policy(None, torch.ops.aten.add.Tensor)
        (<CheckpointPolicy.MUST_SAVE: 0>, <CheckpointPolicy.PREFER_RECOMPUTE: 3>)
    """
    if callable(save):
        base = save
    elif isinstance(save, Iterable) and not isinstance(save, (str, bytes)):
        kept = frozenset(save)

        def base(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE
    else:
        raise TypeError(f"selective_checkpoint_policy: save={save!r}; expected a list or set of ops "
                        "(torch.ops.aten.mm.default, ...) or a policy function (ctx, op, *args, **kwargs).")

    def policy(ctx, op, *args, **kwargs):
        if _activation_cast(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return base(ctx, op, *args, **kwargs)

    return policy


def checkpoint_context() -> tuple[contextlib.nullcontext, contextlib.nullcontext]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: two
    contexts that change nothing (delayed-scaling layers need none; see the module docstring)."""
    return contextlib.nullcontext(), contextlib.nullcontext()
