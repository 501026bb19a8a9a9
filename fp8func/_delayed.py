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
The op takes the state as ``state_inputs``, reads it with ``linear_states``, passes it on packed
(``pack_state``) and returns ``next_linear_states`` as the gradients of its state inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._formats import fp8_max, round_up_to_pow2
from ._hooks import full_tensor, is_distributed
from ._ops import check_hp, quantize_with_scale
from ._qtensor import Fp8Tensor
from ._scaling import AMAX_ALGOS, EPS, CastSpec, TensorWise, compute_amax, compute_scale
from ._sharding import Sharding, reduce_amax

__all__ = ["ScalingState", "LinearScalingState", "quantize_delayed", "record_merged", "consume", "refresh",
           "check_linear_state", "global_amax", "linear_states", "next_linear_states", "packed_history_len",
           "pack_state", "state_inputs", "unpack_state"]


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
    amax = global_amax(amax, sharding, shape)
    history = torch.cat([amax, history[:-1]])
    basis = history.max() if algo == "max" else amax[0]
    fresh = compute_scale(basis, spec.dtype, spec.pow2_scales).reshape(1, 1)
    usable = torch.isfinite(basis) & (basis > 0)
    return ScalingState(history, torch.where(usable, fresh, scale))


def global_amax(amax: torch.Tensor, sharding: Sharding | None = None, shape: tuple[int, ...] = (2, 2)) -> torch.Tensor:
    """The amax of the logical tensor as one value: a distributed tensor's (TP) over its mesh, the
    same on every rank (``fp8func._hooks.full_tensor``); then, with ``sharding``, over the mesh
    dims that split a local shard of ``shape`` (a linear's rows over the data-parallel ranks)."""
    amax = full_tensor(amax).reshape(1)
    if sharding is not None:
        amax = reduce_amax(amax, sharding.mesh, sharding.amax_mesh_dims(TensorWise(), shape))
    return amax


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


def linear_states(inputs: tuple, packed_len: int = 0) -> LinearScalingState:
    """A linear's state from its state inputs: six tensors, or, with ``packed_len`` L, views of
    one packed ``[3 * (L + 1)]`` tensor whose rows are (history, scale) of x, w and dy."""
    if packed_len:
        rows = inputs[0].view(3, packed_len + 1)
        return LinearScalingState(*(ScalingState(r[:-1], r[-1:].view(1, 1)) for r in rows))
    return LinearScalingState.from_tensors(inputs)


def state_inputs(state: LinearScalingState | torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[tuple, int]:
    """A linear's state as the op's tensor inputs, checked for a call on ``x`` and ``weight``: a
    ``LinearScalingState``'s six tensors and 0 (``check_linear_state``, which marks it consumed),
    or a packed state's one tensor and its history length L (``packed_history_len``)."""
    if isinstance(state, torch.Tensor):
        return (state,), packed_history_len(state, x, weight)
    check_linear_state(state, x, weight)
    return state.tensors(), 0


def pack_state(inputs: tuple, packed_len: int = 0) -> torch.Tensor:
    """A linear's state inputs (``state_inputs``) packed in one new ``[3 * (L + 1)]`` tensor, which
    ``unpack_state`` reads back: the state the op passes on to a later use in the step."""
    if packed_len:
        return inputs[0].clone()
    # full tensors: a replicated distributed state (TP) would make the passed-on state a DTensor
    # output, whose tangent torch.compile expects as a DTensor even when no later use gives it one
    return torch.cat([full_tensor(t).reshape(-1) for t in inputs])


def next_linear_states(inputs: tuple, packed_len: int, passed: torch.Tensor | None, amaxes: tuple,
                       specs: tuple[CastSpec, ...], algo: str = "max", sharding: Sharding | None = None) -> tuple:
    """The gradients of a linear's state inputs (``inputs``, read as ``linear_states`` does): each
    state after this use's amax is recorded (``record_merged``). Six tensors, ``None`` for a state
    not recorded (a dynamic weight); or one packed tensor, where such a state comes back unchanged.

    ``passed``: the gradient of the packed state this use passed on (zeros, or None, when no later
    use read it). ``amaxes``: the amaxes of x, w and dy this use recorded, None for w's or dy's
    state not recorded; each is made the logical tensor's (``global_amax``), x's and dy's also over
    ``sharding``, the ranks their rows are split over. ``specs``: the three casts' specs.
    """
    x_amax, w_amax, dy_amax = amaxes  # the tokens are split over ``sharding``, the weight's rows are not
    recorded = (global_amax(x_amax, sharding), None if w_amax is None else global_amax(w_amax),
                None if dy_amax is None else global_amax(dy_amax, sharding))
    if passed is not None:  # a state is replicated; under TP its gradient may come as a distributed tensor
        passed = full_tensor(passed)
    rows = tuple(i for i, a in enumerate(recorded) if a is not None)  # the states recorded
    if packed_len:
        return (_next_packed(inputs[0].view(3, packed_len + 1), passed, recorded, rows, specs, algo),)
    mine = tuple(tuple(map(full_tensor, st)) for st in linear_states(inputs))
    incoming = _unpack_states(passed, tuple(t for st in mine for t in st))
    theirs = tuple(zip(incoming[0::2], incoming[1::2]))
    out = [None] * 6
    if len({mine[i][0].numel() for i in rows}) > 1:  # histories of different lengths: one at a time
        for i in rows:
            st = record_merged(ScalingState(*mine[i]), ScalingState(*theirs[i]), recorded[i], specs[i], algo)
            out[2 * i], out[2 * i + 1] = st
        return tuple(out)
    pack = lambda sts: torch.stack([torch.cat([h.reshape(-1), s.reshape(-1)]) for h, s in sts])  # noqa: E731
    new = record_merged_packed(pack([mine[i] for i in rows]), pack([theirs[i] for i in rows]),
                               torch.cat([recorded[i] for i in rows]), tuple(specs[i] for i in rows), algo)
    for j, i in enumerate(rows):
        out[2 * i], out[2 * i + 1] = new[j, :-1], new[j, -1:].reshape(1, 1)
    return tuple(out)


def _next_packed(mine: torch.Tensor, passed: torch.Tensor | None, recorded: tuple, rows: tuple,
                 specs: tuple[CastSpec, ...], algo: str) -> torch.Tensor:
    """``next_linear_states`` of the three states as the rows of one ``[3, L + 1]`` tensor, in
    one computation; flat, as the packed input."""
    theirs = mine.new_zeros(mine.shape) if passed is None else passed.view(mine.shape)
    # [3, 1] without a concatenation (a state not recorded takes x's amax: its row is not kept)
    row = torch.arange(3, device=mine.device).reshape(3, 1)
    x_a, w_a, dy_a = (recorded[0] if a is None else a for a in recorded)
    new = record_merged_packed(mine, theirs, torch.where(row == 0, x_a, torch.where(row == 1, w_a, dy_a)),
                               specs, algo)
    if len(rows) < 3:
        new = torch.where(torch.tensor([[i in rows] for i in range(3)], device=mine.device), new, mine)
    return new.reshape(-1)


def check_linear_state(state, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raises unless ``state`` can take a ``linear_delayed`` call on ``x`` and ``weight``: a
    ``LinearScalingState`` not consumed yet, whose tensors require grad where its update is due
    (it comes back as their gradient); marks it consumed."""
    if not isinstance(state, LinearScalingState):
        raise TypeError(f"linear_delayed: state={type(state).__name__}; expected a LinearScalingState, e.g. "
                        "fp8func.LinearScalingState.init(history_len).requires_grad_().")
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return  # checked when the same code runs eagerly; no update is due without grad
    tracked = [t.requires_grad for st in state for t in st]
    if (x.requires_grad or weight.requires_grad) and not all(tracked):
        raise ValueError(
            "linear_delayed: the next step's scaling state comes back as the gradient of `state`, but its tensors "
            "do not require grad, so the update would be lost. Differentiate with respect to the state "
            "(torch.func.grad(loss, argnums=(..., <state>)) or state.requires_grad_() and read .grad), or run "
            "the forward under torch.no_grad() when no state update is wanted."
        )
    consume(state, "linear_delayed")


def packed_history_len(flat: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> int:
    """The history length L of a linear's packed state ``[3 * (L + 1)]`` (``fp8_linear``), or raises."""
    n = flat.numel()
    if is_distributed(flat) or flat.ndim != 1 or flat.dtype != torch.float32 or n % 3 or n < 6:
        raise ValueError(f"fp8_linear: a packed state is {type(flat).__name__} {tuple(flat.shape)} {flat.dtype}; "
                         "expected a plain float32 [3 * (L + 1)] tensor (the six state tensors concatenated).")
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and not flat.requires_grad \
            and (x.requires_grad or weight.requires_grad):
        raise ValueError("fp8_linear: the packed state does not require grad, so its update (its gradient) would "
                         "be lost; make it require grad, or run the forward under torch.no_grad().")
    return n // 3 - 1


def unpack_state(flat: torch.Tensor, like: LinearScalingState) -> LinearScalingState:
    """The state packed in ``flat`` (``fp8_linear(..., packed=True)``), shaped as ``like``."""
    return LinearScalingState.from_tensors(_unpack_states(flat, like.tensors()))


def _unpack_states(flat: torch.Tensor | None, like: tuple) -> tuple:
    """The six state tensors packed in ``flat`` (zeros when ``flat`` is None), shaped as ``like``."""
    if flat is None:
        return tuple(torch.zeros_like(full_tensor(t)) for t in like)
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return tuple(out)


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
