"""``ScalingBuffers``: what a delayed-scaling ``Fp8Linear`` does with its state buffers.

The layer keeps its ``LinearScalingState`` as six buffers, ``fp8_{x,w,dy}_{history,scale}``
(``STATE_NAMES``): in the state_dict and checkpoints under the layer's own keys, never seen by the
optimizer, float32 through ``.to(dtype)``. Everything else about them lives in the layer's
``ScalingBuffers``, one per delayed layer (a dynamic layer has none):

* packing: the six buffers are views of one float32 tensor, the one autograd leaf per layer that
  the op takes as its state and accumulates the next state into (``fp8_linear``'s packed
  state). Buffers something replaced (``.to()``, ``load_state_dict(assign=True)``, a copy,
  FSDP2 moving them) are packed again, their values kept; replicated DTensor buffers (tensor
  parallel), and states of other dtypes or history lengths than ``LinearScalingState.init``
  makes, stay six leaves, the input's scale hooked;
* the hook: the forward casts with the state and never changes it; the next step's state arrives
  as its gradient in the backward ("overwrite with gradient"), and a post-accumulate-grad hook
  hands it to the model's ``StateWrites`` (``_state_writes``), which writes every layer's next
  state with one multi-tensor copy once the backward ends. So activation checkpointing recomputes
  exactly the forward's casts, and a forward without a backward (evaluation) changes nothing;
* the state passed on: a layer called several times before a backward threads its state from one
  call to the next (the amaxes of the calls merge, by max, into one history entry);
* ``fp8func.nn.apply``'s explicit states, and how checkpoints see the buffers of a layer sharded
  on the meta device.

The ``ScalingBuffers`` never sets the layer's attributes: where the buffers must change (packed
anew, kept float32) it returns the new tensors, which the layer registers. The layer's own methods
over its buffers (read them as a state, register them, hook them, keep them float32 through
``.to()``) are ``ScalingStateMixin``'s, a base class of ``Fp8Linear``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .._delayed import LinearScalingState, refresh, unpack_state
from .._sharding import Sharding
from ._state_writes import StateWrites

__all__ = ["ROLES", "STATE_NAMES", "ScalingBuffers", "ScalingStateMixin"]

log = logging.getLogger("fp8func")

ROLES = ("x", "w", "dy")
STATE_NAMES = tuple(f"fp8_{r}_{kind}" for r in ROLES for kind in ("history", "scale"))  # tensors() order


class _Hooked:
    """The mark of a state buffer that carries its layer's write-back hook. One object for every
    layer, so compiled code that checks the mark guards on the same value in each (an ``id()`` of
    the buffer would be a different constant per layer: one recompilation each). Hooks are not
    copied with tensors, so neither is the mark: a deep copy or a pickle of the buffer reads None."""

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


_HOOKED = _Hooked()


class ScalingBuffers:
    """The delayed-scaling state of one ``Fp8Linear`` beyond its buffers (see the module docstring).

    Read by the layer's forward (``before_call``, ``state_input``, ``pass_on``), its ``.to()``
    and checkpoint methods, ``fp8func.nn.apply`` (``explicit``, ``passed_on``) and
    ``share_scaling_state`` (``set_amax_sharding``)."""

    def __init__(self, writes: StateWrites | None = None, amax_sharding: Sharding | None = None):
        self.pending: torch.Tensor | None = None  # the packed state passed on by the last call before a backward
        self.in_apply = False  # fp8func.nn.apply runs the model: states explicit, no hooks
        self.packed: torch.Tensor | None = None  # the one leaf the buffers view (None: six leaves)
        self.amax_sharding = amax_sharding  # how the tokens are split over ranks (share_scaling_state)
        self.writes = StateWrites() if writes is None else writes
        self._leaves: tuple = ()  # six leaves: the buffers hooked
        self._hooked: weakref.ref | None = None  # the leaf that carries the hook

    # -- what other parts of the shell set, each through its own method
    def set_amax_sharding(self, sharding: Sharding | None) -> None:
        """How the tokens are split over ranks, whose recorded amaxes are then reduced over them."""
        self.amax_sharding = sharding

    def write_with(self, writes: StateWrites) -> None:
        """The ``StateWrites`` that writes the next state at the end of a backward (one per model)."""
        self.writes = writes

    # -- the forward
    def before_call(self, read: Callable[[], LinearScalingState], x_scale: torch.Tensor) -> LinearScalingState | None:
        """Eager: hooks the buffers ``read()`` gives (``hook``; the tensors to register where it
        packed them anew). Compiled: checks that they are hooked (it cannot hook them itself)."""
        if not self.in_apply and not torch.compiler.is_compiling():
            if torch._C._functorch.peek_interpreter_stack() is not None:
                raise RuntimeError(
                    "fp8func: a delayed-scaling Fp8Linear ran under a torch.func transform with its state in buffers, "
                    "where the state's update (its gradient) would be lost. Run the model with fp8func.nn.apply("
                    "model, params, states, *args) and differentiate with respect to the states too.")
            return self.hook(read())
        if not self.in_apply and torch.is_grad_enabled() and getattr(x_scale, "_fp8func_hooked", None) is not _HOOKED:
            raise RuntimeError(
                "fp8func: a compiled delayed-scaling Fp8Linear found state buffers it has not hooked: something "
                "replaced them after convert (parallelize_module makes them replicated DTensors), and compiled code "
                "cannot hook the new ones, so the next states would never be written. Call "
                "fp8func.nn.hook_scaling_states(model) after parallelize_module and before the first compiled step.")
        return None

    def state_input(self, read: Callable[[], LinearScalingState]) -> LinearScalingState | torch.Tensor:
        """What the op takes as the state: packed (the state passed on, or the packed buffers) where
        the buffers are packed and hooked, else the six tensors (those passed on, or ``read()``)."""
        if self.in_apply or self.packed is None:
            state = read()
            return state if self.pending is None else unpack_state(self.pending, state)
        return self.packed if self.pending is None else self.pending

    def pass_on(self, passed: torch.Tensor) -> None:
        """Keeps the state a call passed on (packed) for the layer's next call before the backward."""
        if torch.is_grad_enabled():
            self.pending = passed

    @contextlib.contextmanager
    def explicit(self):
        """While open, the layer reads the states it is given (``fp8func.nn.apply``) and hooks
        nothing; ``passed_on`` reads what its last call passed on."""
        self.in_apply, self.pending = True, None
        try:
            yield self
        finally:
            self.in_apply, self.pending = False, None

    def passed_on(self, given: LinearScalingState) -> LinearScalingState | None:
        """The state the layer's last call passed on, shaped as ``given`` (None: no call since)."""
        return None if self.pending is None else unpack_state(self.pending, given)

    # -- packing and the hook
    def hook(self, state: LinearScalingState) -> LinearScalingState | None:
        """Makes the next state come back as the gradient of ``state`` (the layer's buffers) and
        hooks its write at the end of the backward; returns the views of a new packed leaf for the
        layer to register in place of its buffers, or None where they stay. Hooks live on tensors
        and are not copied with them, so this remembers (weakly) which tensor it hooked."""
        if state.input.scale.is_meta:
            self.packed = None  # packed once the buffers hold values
            return None
        tensors, views = state.tensors(), None
        if any(isinstance(t, DTensor) or t.dtype != torch.float32 for t in tensors) \
                or len({st.amax_history.numel() for st in state}) > 1:
            self.packed, self._leaves = None, tensors
            for t in tensors:
                if not t.requires_grad:
                    t.requires_grad_(True)
            leaf = state.input.scale
        else:
            leaf, self._leaves = self.packed, ()
            if leaf is None or not all(getattr(t, "_fp8func_hooked", None) is _HOOKED for t in tensors):
                leaf = torch.cat([t.detach().reshape(-1) for t in tensors]).requires_grad_()
                views = unpack_state(leaf.detach(), state)
                for view in views.tensors():
                    view._fp8func_hooked = _HOOKED
                self.packed = leaf
        if self._hooked is None or self._hooked() is not leaf:
            if self.packed is None:
                log.debug("fp8func: a delayed-scaling Fp8Linear keeps its state as six autograd leaves (its buffers "
                          "are DTensors, or not float32, or of unequal history lengths): the same numbers, more host "
                          "time.")
            leaf.register_post_accumulate_grad_hook(_StateGradHook(self))
            self._hooked = weakref.ref(leaf)
            (views or state).input.scale._fp8func_hooked = _HOOKED  # what a compiled forward reads (see _Hooked)
        return views

    def take_next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """At the end of a backward: (buffer, next value) pairs of the state gradients accumulated,
        the gradients cleared, and the step ended (no state pending, the state fresh)."""
        self.pending = None
        packed = self.packed
        if packed is not None:  # one leaf (a state not recorded comes back unchanged)
            pairs = [] if packed.grad is None else [(packed.detach(), packed.grad)]
            packed.grad = None
            return pairs
        pairs = []
        for t in self._leaves:
            if t.grad is None:  # a state the plan does not record (a dynamic weight)
                continue
            # A state is replicated: under TP the buffer or its gradient may be a replicated DTensor.
            pairs.append((t.to_local() if isinstance(t, DTensor) else t,
                          t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad))
            t.grad = None
        if self._leaves:
            refresh(LinearScalingState.from_tensors(self._leaves))
        return pairs

    # -- moves, checkpoints and copies
    @staticmethod
    def kept_float32(old: LinearScalingState, new: LinearScalingState) -> LinearScalingState | None:
        """After ``.to()``: the state is float32 (amaxes and scales), so ``.to(dtype)`` /
        ``.bfloat16()`` move it, not cast it. The tensors to register, or None where ``new`` is."""
        if all(n.dtype == o.dtype for o, n in zip(old.tensors(), new.tensors())):
            return None
        return LinearScalingState.from_tensors(
            n if n.dtype == o.dtype else o if o.device == n.device else o.detach().to(n.device)
            for o, n in zip(old.tensors(), new.tensors()))

    @staticmethod
    def save(destination: dict, prefix: str, weight: torch.Tensor) -> None:
        """Sharded on the meta device (accelerate's cpu_ram_efficient_loading shards a meta model,
        reads its state_dict for every tensor's mesh and placements, then loads rank 0's values with
        load_state_dict(assign=True)): the state buffers, replicated on every rank, are listed as
        replicated DTensors on the weight's mesh, as every other entry is a DTensor."""
        if not (isinstance(weight, DTensor) and weight.is_meta):
            return
        mesh = weight.device_mesh
        for name in STATE_NAMES:
            if prefix + name in destination and not isinstance(destination[prefix + name], DTensor):
                destination[prefix + name] = DTensor.from_local(
                    destination[prefix + name], mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def load(state_dict: dict, prefix: str, held: LinearScalingState) -> None:
        """A replicated DTensor given for a plain state buffer (the meta-sharded state_dict of
        ``save``, loaded back): its values are the whole state."""
        for name, t in zip(STATE_NAMES, held.tensors()):
            given = state_dict.get(prefix + name)
            if isinstance(given, DTensor) and not isinstance(t, DTensor):
                state_dict[prefix + name] = given.full_tensor()

    # The state passed on between calls belongs to one autograd graph and the hook to the buffers'
    # tensors: never copied or saved. A copy's buffers are packed and hooked again by its layer; the
    # layers of a copied model share one new StateWrites (copy's memo, pickle's).
    def __getstate__(self):
        return {"writes": self.writes, "amax_sharding": self.amax_sharding}

    def __setstate__(self, state):
        self.__init__(state.get("writes"), state.get("amax_sharding"))


class _StateGradHook:
    """Hands the layer's ``ScalingBuffers`` to its ``StateWrites`` when the state gradient (the
    next state) is accumulated."""

    def __init__(self, buffers: ScalingBuffers):
        self._buffers = weakref.ref(buffers)

    def __call__(self, t: torch.Tensor) -> None:
        buffers = self._buffers()
        if buffers is not None:
            buffers.writes.add(buffers)


class ScalingStateMixin(nn.Module):
    """The methods of a layer (``Fp8Linear``) over its delayed-scaling state buffers: the buffers
    are the layer's, and these methods, the layer's own, register them; what is done with them is
    its ``ScalingBuffers``' (``scaling_buffers``; None with dynamic scaling: no buffers)."""

    scaling_buffers: ScalingBuffers | None = None  # delayed scaling: what the layer does with its state buffers

    def scaling_state(self) -> LinearScalingState | None:
        """The layer's delayed-scaling state (views of its buffers), or None for dynamic scaling."""
        if self.scaling_buffers is None:
            return None
        return LinearScalingState.from_tensors(getattr(self, name) for name in STATE_NAMES)

    def hook_scaling_state(self) -> None:
        """Hooks the state buffers for the write of the next state (``ScalingBuffers.hook``)."""
        if self.scaling_buffers is not None:
            self._register_state(self.scaling_buffers.hook(self.scaling_state()))

    def _register_state(self, state: LinearScalingState | None) -> None:
        for name, t in zip(STATE_NAMES, () if state is None else state.tensors()):
            self.register_buffer(name, t)

    def _init_state(self, history_len: int, device) -> None:
        self.scaling_buffers = ScalingBuffers()
        self._register_state(LinearScalingState.init(history_len, device))
        self.hook_scaling_state()

    def _apply(self, fn, recurse=True):
        state = self.scaling_state()
        out = super()._apply(fn, recurse)
        if state is not None:
            self._register_state(ScalingBuffers.kept_float32(state, self.scaling_state()))
        self.hook_scaling_state()  # .to() / .cuda() / to_empty() make new buffer tensors
        return out
