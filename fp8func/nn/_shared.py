"""One input cast for the FP8 layers that read one tensor: an attention block's q, k and v, an
MLP's gate and up.

``convert`` gives the ``Fp8Linear`` children of a module that share an input size and a dynamic
recipe one ``SharedInputCasts``; the module's forward hooks empty it before and after each call.
Inside the call the first of those layers to see a tensor casts it (``fp8func.input_casts``) and
the others that get the very same tensor, unchanged since, reuse the casts: the same bits as
casting it each time (the casts are a function of the tensor), one amax and one cast pass
instead of one per layer.

Eager code only. Under ``torch.compile`` every layer casts its own input, as without sharing:
there the casts are Triton ops traced into the graph, whose output buffers the graph never
merges, and a tensor's version counter, read after an opaque op, is a symbol that compiled code
cannot compare, so an in-place change between two layers could not be seen. (Casts made through
an opaque op, which the graph's common-subexpression pass merges, cost more host time than they
save: docs/design.md, What we tried and did not keep.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch._C._functorch import is_batchedtensor

from .._casts import activation_casts, input_casts
from .._plan import LinearPlan
from .._scaling import Recipe

__all__ = ["SharedInputCasts", "share_input_casts", "shareable", "unshare_input_casts"]

_ATTR = "_fp8_shared_input_casts"


class SharedInputCasts:
    """The input casts of the last tensor one group of sibling ``Fp8Linear`` layers read.

    Identified by the tensor object and its version counter: an in-place change to the tensor
    between two layers makes the second cast it again. Empty between calls of the parent module,
    so it holds no tensor (and no compiled graph returns one) outside them."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._x, self._version, self._key, self._casts = None, None, None, None

    def get(self, x: torch.Tensor, recipe: Recipe | LinearPlan, weight_requires_grad: bool) -> dict | None:
        """The casts of ``x`` for ``recipe`` (made now unless this group made them already), or None
        where the layer casts by itself (see ``shareable``). Eager code only."""
        if not shareable(x):
            return None
        version = x._version
        key = (recipe, weight_requires_grad, torch.is_grad_enabled())
        if self._x is x and self._version == version and self._key == key:
            return self._casts
        casts = input_casts(x, recipe, weight_requires_grad=weight_requires_grad)
        self._x, self._version, self._key, self._casts = x, version, key, casts
        return casts

    def __getstate__(self):
        return {}  # nothing held between calls is worth keeping

    def __setstate__(self, state):
        self.clear()

    def __deepcopy__(self, memo):
        return memo.setdefault(id(self), SharedInputCasts())


def shareable(x: torch.Tensor) -> bool:
    """Whether a layer's input may take shared casts: not a tensor subclass (a DTensor under
    tensor parallelism, FP8 casts gathered elsewhere) nor a tensor batched by ``vmap`` (whose
    per-example casts belong inside the layer)."""
    return type(x) is torch.Tensor and not is_batchedtensor(x)


def _clear(module: nn.Module, *args) -> None:
    # A forward pre-hook and forward hook of the parent (module-level, so copies and pickles of
    # the model keep working hooks that reach their own group). Compiled code keeps nothing.
    if torch.compiler.is_compiling():
        return
    group = getattr(module, _ATTR, None)
    if group is not None:
        group.clear()


def share_input_casts(model: nn.Module) -> None:
    """Gives each group of sibling ``Fp8Linear`` layers with one input size and one dynamic recipe
    a ``SharedInputCasts``, and their parent the hooks that empty it. Layers with delayed scaling
    (their own scales) or a high-precision grad_weight GEMM (no input cast) are left out.
    Idempotent."""
    from ._linear import Fp8Linear

    for parent in model.modules():
        by_input: dict = {}
        for m in parent.children():
            if isinstance(m, Fp8Linear):
                m.use_input_casts(None)
                if m.plan.delayed is None and activation_casts(m.plan):
                    by_input.setdefault((m.in_features, m.plan), []).append(m)
        groups = [g for g in by_input.values() if len(g) > 1]
        if not groups:
            _unhook(parent)
            continue
        if getattr(parent, _ATTR, None) is None:
            setattr(parent, _ATTR, SharedInputCasts())
            # Not always_call: compiled code guards on such a hook's id, a new one per module
            # (one recompilation per layer). A call that raises leaves the group to the next
            # call's pre-hook, which empties it first.
            parent.register_forward_pre_hook(_clear)
            parent.register_forward_hook(_clear)
        for g in groups:
            for m in g:
                m.use_input_casts(getattr(parent, _ATTR))


def unshare_input_casts(model: nn.Module) -> None:
    """Undoes ``share_input_casts``: every layer casts its own input again."""
    from ._linear import Fp8Linear

    for m in model.modules():
        if isinstance(m, Fp8Linear) and m._input_casts is not None:
            m.use_input_casts(None)
        _unhook(m)


def _unhook(parent: nn.Module) -> None:
    if parent.__dict__.pop(_ATTR, None) is None:
        return
    for hooks in (parent._forward_pre_hooks, parent._forward_hooks):
        for key in [k for k, fn in hooks.items() if fn is _clear]:
            del hooks[key]
