"""``apply``: a model as a pure function of its parameters and delayed-scaling states.

``apply(model, params, states, *args)`` runs ``model`` with the given tensors in place of its
own (``torch.func.functional_call``) and returns ``(out, states)``, the states passed on for a
later call in the same step. Nothing is written to the model. With delayed scaling, the next
step's states are the gradients of ``states`` (flax's "overwrite with gradient"), so a whole FP8
train step is one ``torch.func.grad`` over a pure function:

    def loss_fn(params, states, batch):
        out, _ = fp8func.nn.apply(model, params, states, batch["input_ids"])
        return loss(out, batch)

    grads, state_grads = torch.func.grad(loss_fn, argnums=(0, 1))(params, states, batch)
    states = fp8func.nn.next_states(states, state_grads)

It composes with ``torch.compile`` and ``torch.func.vmap`` (an ensemble of models, each with
its own parameters and states).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.func import functional_call

from .._delayed import LinearScalingState, ScalingState
from ._linear import Fp8Linear
from ._scaling_buffers import ROLES, STATE_NAMES

__all__ = ["apply", "next_states", "scaling_states"]


def scaling_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """The delayed-scaling states of ``model``'s layers, by buffer name (detached views):
    the ``states`` that ``apply`` takes. Empty for a model without delayed scaling."""
    return {name: t.detach() for name, t in model.named_buffers() if name.rpartition(".")[2] in STATE_NAMES}


def apply(model: nn.Module, params: dict[str, torch.Tensor], states: dict[str, torch.Tensor], *args,
          **kwargs) -> tuple[object, dict[str, torch.Tensor]]:
    """Runs ``model(*args, **kwargs)`` with ``params`` and ``states``; returns ``(out, states)``.

    Args:
        params: tensors by parameter name (``dict(model.named_parameters())`` or a subset).
        states: the delayed-scaling states by buffer name (``scaling_states(model)``); ``{}`` for
            dynamic recipes. Each layer casts with its state and passes it on; the returned
            states are those passed on (the same values), to give a later call in the same step.

    Example:
        >>> params, states = dict(model.named_parameters()), fp8func.nn.scaling_states(model)
        >>> out, _ = fp8func.nn.apply(model, params, states, x)
    """
    unknown = sorted(set(states) - set(scaling_states(model)))
    if unknown:
        raise ValueError(f"fp8func.nn.apply: states {unknown[:3]} are not delayed-scaling states of this model; "
                         "pass fp8func.nn.scaling_states(model) (or tensors under those names).")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)
              and m.scaling_buffers is not None]
    with contextlib.ExitStack() as stack:
        for _, m in layers:
            stack.enter_context(m.scaling_buffers.explicit())
        out = functional_call(model, {**params, **states}, args, kwargs, tie_weights=True, strict=False)
        passed = dict(states)
        for name, m in layers:
            prefix = f"{name}." if name else ""
            read = lambda attr: states.get(prefix + attr, getattr(m, attr))  # noqa: E731  (the state this call read)
            given = LinearScalingState(*(ScalingState(read(f"fp8_{r}_history"), read(f"fp8_{r}_scale"))
                                         for r in ROLES))
            new = m.scaling_buffers.passed_on(given)
            if new is None:
                continue
            for role, st in zip(ROLES, new):
                passed[f"{prefix}fp8_{role}_history"], passed[f"{prefix}fp8_{role}_scale"] = st
    return out, passed


def next_states(states: dict[str, torch.Tensor], state_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next step's states: each state's gradient where the step used it, else the state.

    A state no layer read (a layer skipped this step, a dynamic weight's unused state) has a zero
    gradient; a used one never has a zero scale.
    """
    out = {}
    for name, t in states.items():
        stem = name.removesuffix("_history").removesuffix("_scale")
        used = state_grads[f"{stem}_scale"].reshape(()) > 0
        out[name] = torch.where(used, state_grads[name], t)
    return out
