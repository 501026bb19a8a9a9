"""The weight types an ``Fp8Linear`` can hold, registered by the layer that defines them.

The shell holds high-precision weights itself. The FP8 weight types (the weight FSDP2 all-gathers
in FP8, FP8 primary weights) live in ``fp8func.distributed``, which registers them here when it
is imported (``import fp8func`` imports it); the shell never imports that layer. A registered
type ``cls`` offers:

* ``cls(values, recipe)``: a weight holding (or staging) the high-precision ``values``;
* ``w.recipe`` and ``w.hp_values()``: a plain tensor of its high-precision values (a view of
  them where it holds them), what checkpoints, copies and ``unconvert`` store.

FSDP2 all-gathers of these types can be observed (``verify`` counts them) through
``observe_all_gathers``: the weight types call ``notify_all_gather`` from their
``fsdp_pre_all_gather``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from .._scaling import Recipe

__all__ = ["FP8_ALL_GATHER", "FP8_WEIGHTS", "check_fp8_weights_recipe", "hp_weight", "local_of", "notify_all_gather",
           "observe_all_gathers", "register_weight_type", "weight_kind", "weight_type", "wrap_weight"]

FP8_ALL_GATHER = "fsdp_fp8_all_gather"  # a high-precision weight FSDP2 all-gathers in FP8
FP8_WEIGHTS = "fp8_weights"  # a weight stored in FP8 (payloads + scales), trained through MasterWeights

# Registries of the process, never of a model: the weight types fp8func.distributed registers (the
# hook by which the shell uses them without importing that layer), and the observers that verify
# opens for the length of a check (observe_all_gathers).
_TYPES: dict[str, type] = {}
_OBSERVERS: list[Callable] = []


def register_weight_type(kind: str, cls: type) -> None:
    """Registers ``cls`` as the weight type for ``kind`` (``FP8_ALL_GATHER`` or ``FP8_WEIGHTS``)."""
    if kind not in (FP8_ALL_GATHER, FP8_WEIGHTS):
        raise ValueError(f"register_weight_type: kind={kind!r}; expected {FP8_ALL_GATHER!r} or {FP8_WEIGHTS!r}.")
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"register_weight_type: {cls!r} is not a torch.Tensor subclass.")
    _TYPES[kind] = cls


def weight_type(kind: str) -> type:
    """The registered weight type for ``kind``; raises if ``fp8func.distributed`` did not register one."""
    cls = _TYPES.get(kind)
    if cls is None:
        raise RuntimeError(f"fp8func: no weight type is registered for {kind!r}; import fp8func (which imports "
                           "fp8func.distributed and registers them) before building Fp8Linear layers.")
    return cls


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view of it through the public ``to_local``, outside autograd:
    for reading its type and values), or ``t`` itself."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def weight_kind(t: torch.Tensor) -> str | None:
    """``FP8_ALL_GATHER`` / ``FP8_WEIGHTS`` for a weight of a registered type (or a DTensor over
    one), None for anything else."""
    local = local_of(t)
    return next((kind for kind, cls in _TYPES.items() if isinstance(local, cls)), None)


@torch.no_grad()
def hp_weight(t: torch.Tensor) -> torch.Tensor:
    """The high-precision values of a weight as a plain tensor, or a DTensor over one placed like
    ``t``; ``t`` itself (detached) when it is not of a registered type."""
    if weight_kind(t) is None:
        return t.detach()
    if not isinstance(t, DTensor):
        return t.hp_values()
    values = t.to_local().hp_values()
    return DTensor.from_local(values, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)


@torch.no_grad()
def wrap_weight(values: torch.Tensor, kind: str, recipe: Recipe) -> torch.Tensor:
    """``values`` (a plain tensor or a DTensor over one) as a weight of ``kind``, placed like it."""
    cls = weight_type(kind)
    if not isinstance(values, DTensor):
        return cls(values.detach(), recipe)
    local = cls(values.to_local().detach(), recipe)
    return DTensor.from_local(local, values.device_mesh, values.placements, shape=values.shape,
                              stride=values.stride(), run_check=False)


def check_fp8_weights_recipe(recipe: Recipe) -> None:
    """Raises unless ``recipe`` can keep its weights in fp8 (every dynamic-scaling recipe can)."""
    if recipe.delayed is not None:
        raise ValueError(
            f"fp8func: recipe {recipe.name!r} uses delayed scaling, whose weight scale comes from an amax "
            "history the layer updates at each forward; fp8 weights are quantized once per optimizer step "
            "with their own amax. Use a dynamic recipe ('tensorwise', 'rowwise', 'blockwise') with "
            "fp8_weights=True, or keep fp8_weights=False for 'delayed'."
        )


@contextlib.contextmanager
def observe_all_gathers(fn: Callable) -> Iterator[None]:
    """Calls ``fn(weight, module, inputs, mp_policy)`` after every FSDP2 pre-all-gather of a
    registered weight type (``inputs``: what FSDP2 all-gathers) while the context is open."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


def notify_all_gather(weight: torch.Tensor, module, inputs, mp_policy) -> None:
    """Called by the weight types' ``fsdp_pre_all_gather``; see ``observe_all_gathers``."""
    for fn in tuple(_OBSERVERS):
        fn(weight, module, inputs, mp_policy)
