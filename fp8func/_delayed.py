"""Delayed scaling as explicit functional state: ``ScalingState`` in, ``ScalingState`` out.

A cast with delayed scaling uses the scale made from the amaxes of *earlier* steps, so the
tensor is read once: the cast and the new amax come from the same pass (inductor or the
``cast_amax`` kernel fuses them). The state is a pytree (a NamedTuple of tensors) that the
caller threads, as in JAX:

    q, state = quantize_delayed(x, spec, state)

Update rule (as TransformerEngine's): the history is shifted by one, newest amax first; the next
scale is ``compute_scale(max(history))`` ("max") or ``compute_scale(amax)`` ("most_recent").
A non-finite or zero amax leaves the scale unchanged (the history still records it), so a bad
step cannot poison the next casts' scale; its own cast shows the fault (see ``_casts``).

Inside ``linear_delayed`` the states of a layer's three casts follow flax's "overwrite with
gradient": the new state arrives as the *gradient* of the state input, and a state threaded
through several uses in one step (``y1, s = linear_delayed(x1, w, ..., s); y2, s =
linear_delayed(x2, w, ..., s)``) records the max of their amaxes as one history entry
(``record_merged``). Reusing a state that a call already consumed is refused (``consume``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ._formats import fp8_max, round_up_to_pow2
from ._ops import check_hp, quantize_with_scale
from ._qtensor import Fp8Tensor
from ._scaling import AMAX_ALGOS, EPS, CastSpec, TensorWise, compute_amax, compute_scale
from ._sharding import Sharding, reduce_amax

__all__ = ["ScalingState", "LinearScalingState", "quantize_delayed", "record_merged", "consume", "refresh"]


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

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The six tensors, in order: input, weight, grad_output (history, scale) each."""
        return tuple(t for st in self for t in st)

    def requires_grad_(self, requires_grad: bool = True) -> "LinearScalingState":
        """Makes the six tensors require grad (their gradients are the next state), in place."""
        for t in self.tensors():
            t.requires_grad_(requires_grad)
        return self

    @staticmethod
    def from_tensors(tensors) -> "LinearScalingState":
        """The inverse of ``tensors()``, e.g. from the gradients of a state."""
        t = tuple(tensors)
        if len(t) != 6:
            raise ValueError(f"LinearScalingState.from_tensors: got {len(t)} tensors; expected 6 (input, weight, "
                             "grad_output, each history and scale).")
        return LinearScalingState(ScalingState(t[0], t[1]), ScalingState(t[2], t[3]), ScalingState(t[4], t[5]))


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
    check_hp(x, "quantize")
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


def _rescaled(history: torch.Tensor, basis: torch.Tensor, fallback: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The scale made from ``basis`` (an amax), or ``fallback`` where it is non-finite or zero."""
    fresh = compute_scale(basis, spec.dtype, spec.pow2_scales).reshape(1, 1)
    return torch.where(torch.isfinite(basis) & (basis > 0), fresh, fallback)


def record_merged(state: ScalingState, incoming: ScalingState, amax: torch.Tensor, spec: CastSpec,
                  algo: str = "max") -> ScalingState:
    """The state after one use of ``state`` that cast a tensor of ``amax``, in the backward.

    ``incoming`` is the gradient of the state this use passed on: zeros when no later use in the
    step read it (then ``amax`` is recorded as a new history entry, ``next_state``), else the
    state the later uses made (then ``amax`` is merged into its newest entry by max: one entry
    per step whatever the number of uses, as flax's max-accumulating state gradients). Branch-free,
    so it traces and vmaps. ``amax`` holds one value (already reduced over any mesh).
    """
    amax = amax.reshape(1).float()
    later = (incoming.scale.reshape(()) > 0)
    merged_h = torch.cat([torch.maximum(incoming.amax_history[:1], amax), incoming.amax_history[1:]])
    fresh_h = torch.cat([amax, state.amax_history[:-1]])
    history = torch.where(later, merged_h, fresh_h)
    fallback = torch.where(later, incoming.scale, state.scale)
    # the newest entry after a merge is the max over this step's uses: "most_recent" reads it
    basis = history.max() if algo == "max" else history[0]
    return ScalingState(history, _rescaled(history, basis, fallback, spec))


def record_merged_packed(mine: torch.Tensor, theirs: torch.Tensor, amax: torch.Tensor, specs: tuple[CastSpec, ...],
                         algo: str = "max") -> torch.Tensor:
    """``record_merged`` for R states packed as the rows ``(history [L], scale)`` of ``[R, L + 1]``
    tensors (``linear``'s three, in one computation): ``mine`` the states used, ``theirs`` the
    gradients passed on, ``amax [R]`` (or ``[R, 1]``); returns the R new states packed the same
    way, bitwise ``record_merged`` of each. Pointwise over the rows and one row maximum, without
    concatenations, so that a compiled backward does it in one kernel."""
    n = mine.shape[1] - 1
    col = torch.arange(n + 1, device=mine.device)
    first, in_history = col == 0, col < n
    amax = amax.reshape(-1, 1).float()
    later = theirs[:, n:] > 0
    fresh = torch.where(first, amax, mine.roll(1, 1))  # amax, then the history shifted by one
    merged = torch.where(first, torch.maximum(theirs, amax), theirs)  # the newest entry merged by max
    new = torch.where(later, merged, fresh)
    basis = torch.where(in_history, new, -torch.inf).amax(1, keepdim=True) if algo == "max" else new[:, :1]
    fallback = torch.where(later, theirs[:, n:], mine[:, n:])
    # compute_scale per state: the same fp32 constants, the same rounding
    inv_max = basis.new_tensor([[1.0 / fp8_max(sp.dtype)] for sp in specs])
    scale = basis.clamp(min=EPS) * inv_max
    flags = [sp.pow2_scales for sp in specs]
    if all(flags):
        scale = round_up_to_pow2(scale)
    elif any(flags):
        scale = torch.where(torch.tensor([[f] for f in flags], device=basis.device), round_up_to_pow2(scale), scale)
    scale = torch.where(torch.isfinite(basis) & (basis > 0), scale, fallback)
    return torch.where(in_history, new, scale)


def consume(state: "LinearScalingState", what: str) -> None:
    """Marks ``state`` consumed by a call, or raises if an earlier call consumed it already.

    A state used twice without threading would receive the sum of both uses' new states as its
    gradient (autograd adds gradients): garbage. Raises with the fix (as equinox's stale state).
    The mark lives on the state itself (its input history tensor), so it goes with the state: a
    new state (the next step's, a copy) is fresh. Eager and torch.func only: compiled code is
    traced once and cannot keep this Python-side record.
    """
    if torch.compiler.is_compiling():
        return
    key = state.input.amax_history
    if getattr(key, _CONSUMED, None) is _MARK:
        raise ValueError(
            f"{what}: this LinearScalingState was already consumed by an earlier call in this step. Thread the "
            "state instead of reusing it:\n    y1, state = fp8func.linear_delayed(x1, w, None, recipe, state)\n"
            "    y2, state = fp8func.linear_delayed(x2, w, None, recipe, state)   # not the first call's input state\n"
            "The next step's state is the gradient of the first call's state input (torch.func.grad over it, or "
            "its .grad); a state made that way is fresh."
        )
    setattr(key, _CONSUMED, _MARK)


def refresh(state: "LinearScalingState") -> None:
    """Forgets that ``state`` was consumed (its tensors now hold the next step's values)."""
    key = state.input.amax_history
    if getattr(key, _CONSUMED, None) is _MARK:
        delattr(key, _CONSUMED)


class _Consumed:
    """The mark ``consume`` sets on a state's input history tensor. A tensor's attributes travel
    with ``copy.deepcopy`` and pickles of it; this mark does not, so a copied or loaded state is
    fresh: a copy reads None, a pickle (``torch.save``) an empty set, one of the few values
    ``torch.load(weights_only=True)`` rebuilds."""

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return set, ()


_CONSUMED, _MARK = "_fp8func_consumed", _Consumed()
