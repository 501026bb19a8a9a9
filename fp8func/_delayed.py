"""Delayed scaling as explicit functional state: ``ScalingState`` in, ``ScalingState`` out.

A cast with delayed scaling uses the scale made from the amaxes of *earlier* steps, so the
tensor is read once: the cast and the new amax come from the same pass (inductor fuses them).
The state is a pytree (a NamedTuple of tensors) that the caller threads, as in JAX:

    q, state = quantize(x, spec, state=state)

Update rule (as TransformerEngine's): the history is shifted by one, newest amax first; the next
scale is ``compute_scale(max(history))`` ("max") or ``compute_scale(amax)`` ("most_recent").
A non-finite or zero amax leaves the scale unchanged (the history still records it), so a bad
step cannot poison the next casts' scale; its own cast still shows the NaN in its data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ._ops import _check_hp, quantize_with_scale
from ._qtensor import Fp8Tensor
from ._scaling import AMAX_ALGOS, CastSpec, TensorWise, compute_amax, compute_scale
from ._sharding import Sharding, reduce_amax

__all__ = ["ScalingState", "LinearScalingState", "quantize_delayed"]


class ScalingState(NamedTuple):
    """Delayed-scaling state of one tensor: ``amax_history [L]`` (newest first), ``scale (1, 1)``."""

    amax_history: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def init(history_len: int = 16, device: torch.device | str | None = None,
             scale: float = 1.0) -> "ScalingState":
        """An empty history and a starting scale (1.0 casts values up to fp8_max unscaled).

        Use ``ScalingState.from_tensor`` to start from a real tensor's amax instead.
        """
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"ScalingState.init(history_len={history_len!r}): expected an int >= 1.")
        return ScalingState(torch.zeros(history_len, device=device),
                            torch.full((1, 1), float(scale), device=device))

    @staticmethod
    def from_tensor(x: torch.Tensor, spec: CastSpec, history_len: int = 16) -> "ScalingState":
        """A state whose history holds ``x``'s amax (a calibration step): the first cast is then
        what dynamic scaling would give for ``x``."""
        amax = compute_amax(x, TensorWise()).reshape(1).float()
        history = torch.cat([amax, amax.new_zeros(history_len - 1)])
        return ScalingState(history, compute_scale(amax, spec.dtype, spec.pow2_scales).reshape(1, 1))


class LinearScalingState(NamedTuple):
    """The states of a linear layer's three casts (input, weight, grad_output)."""

    input: ScalingState
    weight: ScalingState
    grad_output: ScalingState

    @staticmethod
    def init(history_len: int = 16, device: torch.device | str | None = None) -> "LinearScalingState":
        return LinearScalingState(*(ScalingState.init(history_len, device) for _ in range(3)))


def _check_state(state, spec: CastSpec) -> None:
    if not isinstance(state, ScalingState):
        raise TypeError(f"quantize(state=...): expected a ScalingState, got {type(state).__name__}; "
                        "make one with fp8func.ScalingState.init(history_len).")
    if not isinstance(spec.granularity, TensorWise):
        raise ValueError(f"quantize(state=...): delayed scaling keeps one scale per tensor; spec has "
                         f"{spec.granularity!r}. Use TensorWise() or drop the state (dynamic scaling).")
    h, s = state
    if h.ndim != 1 or h.dtype != torch.float32 or tuple(s.shape) != (1, 1) or s.dtype != torch.float32:
        raise ValueError(f"ScalingState: amax_history {tuple(h.shape)} {h.dtype} and scale {tuple(s.shape)} "
                         f"{s.dtype}; expected float32 [L] and float32 (1, 1) (ScalingState.init).")


def quantize_delayed(
    x: torch.Tensor, spec: CastSpec, state: ScalingState, *, sharding: Sharding | None = None,
    algo: str = "max",
) -> tuple[Fp8Tensor, ScalingState]:
    """Casts ``x`` with ``state.scale`` and returns the new state (see module docstring).

    With ``sharding`` (``x`` a local shard) the recorded amax is the mesh-wide one, so every
    shard's state stays identical.
    """
    _check_hp(x, "quantize")
    _check_state(state, spec)
    if algo not in AMAX_ALGOS:
        raise ValueError(f"quantize(algo={algo!r}): expected one of {AMAX_ALGOS}.")
    q = quantize_with_scale(x, cast_scale(state, x.ndim), spec, sharding=sharding)
    return q, next_state(state, compute_amax(x, TensorWise()), spec, algo, sharding, tuple(x.shape))


def cast_scale(state: ScalingState, ndim: int = 2) -> torch.Tensor:
    """The scale a delayed cast of an ``ndim``-D tensor uses: the state's, as its own tensor (not a
    view of the state, which a module may update in place before the backward reads the cast)."""
    return state.scale.reshape([1] * ndim).clone()


def next_state(state: ScalingState, amax: torch.Tensor, spec: CastSpec, algo: str = "max",
               sharding: Sharding | None = None, shape: tuple[int, ...] = ()) -> ScalingState:
    """``state`` with ``amax`` (the cast tensor's, of any shape holding one value) recorded: the
    history shifted by one, the scale remade from it (see the module docstring). With ``sharding``
    the amax of a local shard of ``shape`` is first reduced over the mesh dims that split it."""
    history, scale = state
    if isinstance(amax, DTensor):  # the amax of a DTensor (TP): the global value, on every rank
        amax = amax.full_tensor()
    amax = amax.reshape(1)
    if sharding is not None:
        amax = reduce_amax(amax, sharding.mesh, sharding.amax_mesh_dims(TensorWise(), shape))
    history = torch.cat([amax, history[:-1]])
    basis = history.max() if algo == "max" else amax[0]
    fresh = compute_scale(basis, spec.dtype, spec.pow2_scales).reshape(1, 1)
    usable = torch.isfinite(basis) & (basis > 0)
    return ScalingState(history, torch.where(usable, fresh, scale))
