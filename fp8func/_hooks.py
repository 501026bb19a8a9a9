"""What the core op asks of a distributed tensor, answered by the layer that knows one.

The op's modules (``_casts``, ``_delayed``, ``_operands``, ``_autograd``, ``_grouped``) import
nothing of DTensor or FSDP2. ``fp8func.distributed`` registers its answers here when it is imported
(``import fp8func`` imports it, so they are in place before any call); without a registration
every tensor is a plain one. The questions, one ``DistributedHooks`` field each:

* ``is_distributed(t)``: whether ``t`` is a distributed tensor (a DTensor), which the fused
  kernels never take as it is;
* ``full_tensor(t)``: its logical values as a plain tensor (a scaling state or an amax, the
  same on every rank), ``t`` itself for a plain one;
* ``cast(t, spec, transpose, kernels)``: ``fp8func._casts.cast`` of a distributed ``t`` run on
  its local shard (the fused kernels, the amax reduced over the mesh), or None where the
  generic path casts it;
* ``read_given(t, grad_scale)``: a cast made elsewhere as the backward reads it, given the
  grad_output cast's scale (a weight type that refills a cast's buffer before the backward
  makes the read wait for the gradient); ``t`` itself by default.

Example:
    >>> import torch, fp8func
    >>> from fp8func import _hooks
    >>> _hooks.registered().is_distributed(torch.zeros(2))  # DTensor's answers, from fp8func.distributed
    False
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["DistributedHooks", "PLAIN", "cast_distributed", "full_tensor", "is_distributed", "read_given",
           "register_distributed", "registered"]


class DistributedHooks(NamedTuple):
    """The answers of one distributed tensor type (see the module docstring)."""

    is_distributed: Callable[[torch.Tensor], bool]
    full_tensor: Callable[[torch.Tensor], torch.Tensor]
    cast: Callable[..., tuple | None]
    read_given: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PLAIN = DistributedHooks(
    is_distributed=lambda t: False,
    full_tensor=lambda t: t,
    cast=lambda t, spec, transpose, kernels: None,
    read_given=lambda t, grad_scale: t,
)

_registered = PLAIN


def register_distributed(hooks: DistributedHooks) -> None:
    """Makes the core op answer its questions about distributed tensors with ``hooks`` (the
    previous registration is replaced; ``PLAIN`` restores the default)."""
    global _registered
    if not isinstance(hooks, DistributedHooks):
        raise TypeError(f"register_distributed: hooks is a {type(hooks).__name__}; expected a DistributedHooks"
                        "(is_distributed=..., full_tensor=..., cast=..., read_given=...) of fp8func._hooks.")
    _registered = hooks


def registered() -> DistributedHooks:
    """The hooks in use."""
    return _registered


def is_distributed(t: torch.Tensor) -> bool:
    return _registered.is_distributed(t)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return _registered.full_tensor(t)


def cast_distributed(t: torch.Tensor, spec, transpose: bool, kernels: str) -> tuple | None:
    return _registered.cast(t, spec, transpose, kernels)


def read_given(t: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
    return _registered.read_given(t, grad_scale)
