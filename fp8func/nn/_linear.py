"""``Fp8Linear``: an ``nn.Linear`` whose forward is one call into ``fp8func.linear``."""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .._autograd import fp8_linear, unpack_state
from .._delayed import LinearScalingState, refresh
from .._gathered import casts_only, gathered_casts
from .._plan import LinearPlan, plan
from .._scaling import Recipe
from .._sharding import Sharding
from ._state_writes import StateWrites
from ._weights import (
    FP8_ALL_GATHER,
    FP8_WEIGHTS,
    check_fp8_weights_recipe,
    hp_weight,
    local_of,
    weight_kind,
    weight_type,
    wrap_weight,
)

__all__ = ["Fp8Linear"]

log = logging.getLogger("fp8func")


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


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computed in FP8 per ``recipe``; same parameters and state_dict keys.

    ``recipe``: a ``Recipe``, a recipe name or a per-GEMM ``LinearPlan``, resolved once to the
    layer's ``plan``, which every forward runs; ``recipe`` reads back the ``Recipe`` (or the plan
    where one was given).

    With ``fsdp_fp8_all_gather=True`` the weight is an ``Fp8AllGatherWeight``: a plain
    high-precision tensor to everything except FSDP2, which then all-gathers it as fp8 bytes,
    bitwise what the bf16 all-gather followed by the cast gives.

    With ``fp8_weights=True`` the weight is an ``Fp8WeightParam``: kept in FP8 (payloads +
    scales, no high-precision copy), sharded and all-gathered as fp8 by FSDP2, trained through
    ``fp8func.nn.MasterWeights`` (see ``docs/fp8_weights.md``). Implies the fp8 all-gather.

    With a delayed-scaling recipe (``"delayed"``) the layer holds its ``LinearScalingState`` as
    buffers (``fp8_{x,w,dy}_{history,scale}``: in the state_dict and checkpoints, never seen by
    the optimizer; views of one packed tensor, autograd's one state leaf per layer, float32 through
    ``.to(dtype)``). The forward casts with them and never changes them; the next step's state
    arrives as their gradient in the backward ("overwrite with gradient") and is written into
    them as soon as it is accumulated (a post-accumulate-grad hook). So activation checkpointing
    recomputes exactly the forward's casts, and a forward without a backward (evaluation)
    changes nothing. A layer called several times before a backward threads its state from one
    call to the next, and the amaxes of the calls merge, by max, into one history entry. With
    ``DelayedScaling(weight=False)`` the weight is cast dynamically (its buffers stay as
    initialized) and FSDP2 can all-gather it in FP8. Under ``torch.func`` transforms, use
    ``fp8func.nn.apply``, which passes the states in and out explicitly.

    Checkpoints and copies: ``state_dict`` holds the plain high-precision weight (an FP8 weight's
    master values where ``MasterWeights`` trains it) under ``nn.Linear``'s keys, and loading one
    keeps the weight type (and reaches the master); ``torch.save`` / ``copy.deepcopy`` of the layer
    give independent layers with the same weight type; ``to_linear`` gives an ``nn.Linear`` back.

    Example:
        >>> layer = Fp8Linear(4096, 4096, recipe=fp8func.Recipe.from_name("rowwise"))
    """

    _STATE = ("x", "w", "dy")
    # the state buffers' names, in LinearScalingState.tensors() order
    _STATE_NAMES = tuple(f"fp8_{n}_{kind}" for n in _STATE for kind in ("history", "scale"))
    note = ""  # convert()'s note on this layer (auto figures, a tied weight gathered in bf16, ...)
    conversion = None  # the Report of the convert() call that made this layer (report(model) reads it)
    _master = None  # a weak reference to the master MasterWeights trains for an FP8 weight (master_weight)
    fp8_weights = False  # True: the weight is an Fp8WeightParam (convert(..., fp8_weights=True))
    fp8_enabled = True  # False: plain F.linear in high precision (PrecisionSchedule's bf16 phases)
    amax_sharding = None  # delayed scaling: how the tokens are split over ranks (share_scaling_state)
    _input_casts = None  # the SharedInputCasts of this layer's sibling group (convert(share_input_casts=True))
    # delayed scaling: ``_pending`` is the state passed on by the last call before a backward (packed
    # in one tensor; ``passed_state`` unpacks it);
    # ``_in_apply`` says fp8func.nn.apply is running the model (states explicit, no hooks)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | LinearPlan | str = "tensorwise", fsdp_fp8_all_gather: bool = True,
                 fp8_weights: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._pending, self._in_apply, self._packed = None, False, None  # instance attributes: stable guards
        # resolved once: every forward passes this frozen object on (a constant to torch.compile)
        self.plan: LinearPlan = plan(recipe, "Fp8Linear")
        self.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        self.fp8_weights = fp8_weights
        if fp8_weights:
            check_fp8_weights(self.plan, fsdp_fp8_all_gather)
            self.weight = nn.Parameter(weight_type(FP8_WEIGHTS)(self.weight.data, self.plan))
            return
        if self.plan.delayed is not None:
            if self.plan.delayed.weight:
                fsdp_fp8_all_gather = False  # the FSDP2 fp8 gather casts dynamically; see convert()
                self.fsdp_fp8_all_gather = False
            self._init_state(self.weight.device)
        if fsdp_fp8_all_gather:
            self.weight = nn.Parameter(weight_type(FP8_ALL_GATHER)(self.weight.data, self.plan))

    @property
    def recipe(self) -> Recipe | LinearPlan:
        """The ``Recipe`` the layer was made with (a name resolved), or its ``LinearPlan`` where it
        was given one: what reports show. The layer runs ``plan``."""
        return self.plan.given

    # What other parts of the shell change on a layer, each through its own method.
    def record_conversion(self, note: str, conversion) -> None:
        """``convert``'s note on this layer and the ``Report`` of that call (``report`` reads them)."""
        self.note, self.conversion = note, conversion

    def attach_master(self, master: torch.Tensor | None) -> None:
        """The master parameter ``MasterWeights`` trains for this layer's FP8 weight (held weakly)."""
        self._master = None if master is None else weakref.ref(master)

    def set_fp8_enabled(self, enabled: bool) -> None:
        """FP8 (True) or plain high-precision ``F.linear`` (False): ``PrecisionSchedule``'s phases."""
        self.fp8_enabled = bool(enabled)

    def set_amax_sharding(self, sharding: Sharding | None) -> None:
        """Delayed scaling: how the tokens are split over ranks, whose recorded amaxes are then
        reduced over them (``share_scaling_state``)."""
        self.amax_sharding = sharding

    def use_input_casts(self, group) -> None:
        """The ``SharedInputCasts`` of this layer's sibling group, or None: it casts its own input."""
        self._input_casts = group

    @contextlib.contextmanager
    def explicit_states(self):
        """While open, the layer reads the states it is given (``fp8func.nn.apply``) and hooks
        nothing; ``passed_on`` reads what its last call passed on."""
        self._in_apply, self._pending = True, None
        try:
            yield self
        finally:
            self._in_apply, self._pending = False, None

    def passed_on(self, given: LinearScalingState) -> LinearScalingState | None:
        """The state the layer's last call passed on, shaped as ``given`` (None: no call since)."""
        return None if self._pending is None else unpack_state(self._pending, given)

    def write_states_with(self, writes: StateWrites) -> None:
        """Delayed scaling: the ``StateWrites`` that writes this layer's next state at the end of a
        backward (``hook_scaling_states`` gives a model's layers one)."""
        self._writes = writes

    def _take_next_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """At the end of a backward: (buffer, next value) pairs of the state gradients it accumulated,
        the gradients cleared, and the layer's step ended (no state pending, the state fresh)."""
        self._pending = None
        packed = self._packed
        if packed is not None:  # one leaf (a state not recorded comes back unchanged)
            pairs = [] if packed.grad is None else [(packed.detach(), packed.grad)]
            packed.grad = None
            return pairs
        state, pairs = self.scaling_state(), []
        for t in state.tensors():
            if t.grad is None:  # a state the plan does not record (a dynamic weight)
                continue
            # A state is replicated: under TP the buffer or its gradient may be a replicated DTensor.
            pairs.append((t.to_local() if isinstance(t, DTensor) else t,
                          t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad))
            t.grad = None
        refresh(state)
        return pairs

    def _init_state(self, device) -> None:
        self._writes = StateWrites()
        state = LinearScalingState.init(self.plan.delayed.history_len, device)
        for name, t in zip(self._STATE_NAMES, state.tensors()):
            self.register_buffer(name, t)
        self._hook_grad_output_state()

    def _hook_grad_output_state(self) -> None:
        """The next state comes back as the gradient of the state: make it require grad, and hook it
        to be written into the buffers at the end of the backward (``StateWrites``).

        The six buffers are views of one packed tensor (``fp8_linear``'s packed state), the one
        leaf autograd accumulates the next state into. Buffers something replaced (``.to()``,
        ``load_state_dict(assign=True)``, a copy, FSDP2 moving them) are packed again, their values
        kept. Replicated DTensor buffers (tensor parallel), and states of other dtypes or history
        lengths than ``LinearScalingState.init`` makes, stay six leaves, the input's scale hooked.
        Hooks live on tensors and are not copied with them, so the layer remembers (weakly) which
        tensor it hooked."""
        state = self.scaling_state()
        if state is None or state.input.scale.is_meta:
            self._packed = None  # packed once the buffers hold values
            return
        tensors = state.tensors()
        if any(isinstance(t, DTensor) or t.dtype != torch.float32 for t in tensors) \
                or len({st.amax_history.numel() for st in state}) > 1:
            self._packed = None
            for t in tensors:
                if not t.requires_grad:
                    t.requires_grad_(True)
            leaf = state.input.scale
        else:
            leaf = self.__dict__.get("_packed")
            if leaf is None or not all(getattr(t, "_fp8func_hooked", None) is _HOOKED for t in tensors):
                leaf = torch.cat([t.detach().reshape(-1) for t in tensors]).requires_grad_()
                for name, view in zip(self._STATE_NAMES, unpack_state(leaf.detach(), state).tensors()):
                    view._fp8func_hooked = _HOOKED
                    self.register_buffer(name, view)
                self._packed = leaf
        hooked = self.__dict__.get("_hooked_state")
        if hooked is not None and hooked() is leaf:
            return
        if self._packed is None:
            log.debug("fp8func: a delayed-scaling Fp8Linear keeps its state as six autograd leaves (its buffers are "
                      "DTensors, or not float32, or of unequal history lengths): the same numbers, more host time.")
        leaf.register_post_accumulate_grad_hook(_StateGradHook(self))
        self._hooked_state = weakref.ref(leaf)
        self.fp8_x_scale._fp8func_hooked = _HOOKED  # what a compiled forward can read (see _Hooked)

    def _apply(self, fn, recurse=True):
        state = self.scaling_state()
        out = super()._apply(fn, recurse)
        if state is not None:
            # A delayed-scaling state is float32 (amaxes and scales): .to(dtype) / .bfloat16() move it, not cast it.
            for name, old in zip(self._STATE_NAMES, state.tensors()):
                new = getattr(self, name)
                if new.dtype != old.dtype:
                    self.register_buffer(name, old if old.device == new.device else old.detach().to(new.device))
        self._hook_grad_output_state()  # .to() / .cuda() / to_empty() make new buffer tensors
        return out

    def passed_state(self) -> LinearScalingState | None:
        """The state the layer's next call reads: the one its last call in this step passed on,
        or its buffers' (None for dynamic scaling)."""
        state = self.scaling_state()
        return state if self._pending is None else unpack_state(self._pending, state)

    def _state_input(self) -> LinearScalingState | torch.Tensor:
        """What the op takes as the state: the packed state (the one passed on, or the packed
        buffers) where the buffers are packed and hooked, else the six tensors."""
        if self._in_apply or self._packed is None:
            return self.passed_state()
        return self._packed if self._pending is None else self._pending

    def scaling_state(self) -> LinearScalingState | None:
        """The layer's delayed-scaling state (views of its buffers), or None for dynamic scaling."""
        if self.plan.delayed is None:
            return None
        return LinearScalingState.from_tensors(getattr(self, name) for name in self._STATE_NAMES)

    @classmethod
    def from_linear(cls, linear_: nn.Linear, recipe: Recipe | LinearPlan | str, fsdp_fp8_all_gather: bool = True,
                    fp8_weights: bool = False) -> "Fp8Linear":
        """An ``Fp8Linear`` holding ``linear_``'s parameters (the same values, no re-init; with
        ``fp8_weights`` the weight's values are staged, quantized at the first use)."""
        p = plan(recipe)
        if fp8_weights:
            check_fp8_weights(p, fsdp_fp8_all_gather)
        fsdp_fp8_all_gather = fsdp_fp8_all_gather and (p.delayed is None or not p.delayed.weight)
        with torch.device("meta"):
            new = cls(linear_.in_features, linear_.out_features, bias=False, recipe=p, fsdp_fp8_all_gather=False)
        weight = linear_.weight
        if fp8_weights:
            weight = nn.Parameter(weight_type(FP8_WEIGHTS)(weight.data, p), requires_grad=weight.requires_grad)
        elif fsdp_fp8_all_gather:
            weight = nn.Parameter(weight_type(FP8_ALL_GATHER)(weight.data, p), requires_grad=weight.requires_grad)
        new.weight = weight
        new.bias = linear_.bias
        new.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        new.fp8_weights = fp8_weights
        if p.delayed is not None:
            new._init_state(linear_.weight.device)
        return new

    def _weight_kind(self) -> str | None:
        """The registered weight type this layer keeps its weight in (None: a plain tensor)."""
        return FP8_WEIGHTS if self.fp8_weights else FP8_ALL_GATHER if self.fsdp_fp8_all_gather else None

    def master_weight(self) -> torch.Tensor | None:
        """The master parameter ``fp8func.nn.MasterWeights`` trains for this layer's FP8 weight
        (placed like it), or None: what checkpoints, copies and ``to_linear`` take the weight from."""
        return None if self._master is None else self._master()

    @torch.no_grad()
    def _hp_weight(self) -> torch.Tensor:
        """The weight's high-precision values (a DTensor over them where it is one), in its dtype."""
        master = self.master_weight()
        if master is not None:
            return master.detach().to(self.weight.dtype)
        return hp_weight(self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight"
        if not keep_vars and key in destination:
            # Plain high-precision values (a DTensor over them under FSDP2 / TP), as an nn.Linear's
            # state_dict has: safetensors, save_pretrained, torch.load(weights_only=True) and every
            # model read them. FP8 weights give their master's values where MasterWeights keeps one.
            destination[key] = self._hp_weight()
        w = self.weight
        if not keep_vars and self.plan.delayed is not None and isinstance(w, DTensor) and w.is_meta:
            # Sharded on the meta device (accelerate's cpu_ram_efficient_loading shards a meta model,
            # reads its state_dict for every tensor's mesh and placements, then loads rank 0's values
            # with load_state_dict(assign=True)): the state buffers, replicated on every rank, are
            # listed as replicated DTensors on the weight's mesh, as every other entry is a DTensor.
            mesh = w.device_mesh
            for name in self._STATE_NAMES:
                if prefix + name in destination and not isinstance(destination[prefix + name], DTensor):
                    destination[prefix + name] = DTensor.from_local(
                        destination[prefix + name], mesh, [Replicate()] * mesh.ndim, run_check=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key, kind = prefix + "weight", self._weight_kind()
        value = state_dict.get(key)
        if (kind is not None and local_metadata.get("assign_to_params_buffers", False)
                and isinstance(value, torch.Tensor) and weight_kind(value) != kind):
            # load_state_dict(assign=True) (accelerate's FSDP2 loading does it) puts the checkpoint's
            # tensor in place of the weight: it takes this layer's weight type.
            state_dict[key] = wrap_weight(value, kind, self.plan)
        for name in self._STATE_NAMES if self.plan.delayed is not None else ():
            # A replicated DTensor for a plain state buffer (the meta-sharded state_dict above, loaded
            # back): its values are the whole state.
            held, given = getattr(self, name, None), state_dict.get(prefix + name)
            if isinstance(given, DTensor) and not isinstance(held, DTensor):
                state_dict[prefix + name] = given.full_tensor()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        master = self.master_weight()
        if master is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(master.shape):
            with torch.no_grad():  # the masters take the loaded values: the next step re-quantizes from them
                master.copy_(value)
        self._hook_grad_output_state()  # load_state_dict(assign=True) puts new state tensors in place

    def __getstate__(self):
        state = super().__getstate__().copy()
        # The state passed on between calls belongs to one autograd graph: never copied or saved;
        # the hooked buffer is a weak reference to this layer's own tensor.
        state.pop("_pending", None)
        state.pop("_hooked_state", None)
        state.pop("_packed", None)  # the copy's buffers are packed again (_hook_grad_output_state)
        master = self.master_weight()
        state["_master"] = None  # a copy is not trained by the original's MasterWeights
        w = self._parameters.get("weight")
        if master is not None and not isinstance(w, DTensor):
            params = dict(state["_parameters"])
            params["weight"] = nn.Parameter(self._hp_weight(), requires_grad=w.requires_grad)
            state["_parameters"] = params
        return state

    def __setstate__(self, state):
        if "plan" not in state and "recipe" in state:  # pickled when the layer held its Recipe itself
            state = {**state, "plan": plan(state["recipe"])}
            del state["recipe"]
        super().__setstate__(state)
        self._pending, self._packed = None, None
        self.__dict__.setdefault("_in_apply", False)
        if self.plan.delayed is not None:
            self.__dict__.setdefault("_writes", StateWrites())
        kind, w = self._weight_kind(), self._parameters.get("weight")
        if kind is not None and isinstance(w, torch.Tensor) and weight_kind(w) != kind:
            # Pickled (torch.save of the model, copy by pickling) as its plain values: wrap them again.
            self.weight = nn.Parameter(wrap_weight(w, kind, self.plan), requires_grad=w.requires_grad)
        # A copy's state buffers are new tensors, without the hook: hook them now, so that a copy's
        # first call may be a compiled one.
        self._hook_grad_output_state()

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with this layer's parameters (``fp8func.unconvert`` calls it).

        The bias is the same ``Parameter``; the weight is the same tensor for a high-precision
        weight, the wrapped tensor itself (same storage, no copy) for the fp8 all-gather weight,
        and the high-precision values of FP8 weights (their master's where ``MasterWeights`` keeps
        one), in the weight's dtype. Raises for a sharded weight (FSDP2, tensor parallel).
        """
        w = self.weight
        if isinstance(w, DTensor):
            raise ValueError(
                "fp8func.unconvert: this layer's weight is a DTensor (sharded by FSDP2 or tensor parallel); "
                "unconvert before fully_shard / parallelize_module, or load the model's full state_dict "
                "(torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
                "full_state_dict=True))) into a plain model.")
        with torch.device("meta"):
            new = nn.Linear(self.in_features, self.out_features, bias=False)
        if weight_kind(w) is not None:
            w = nn.Parameter(self._hp_weight(), requires_grad=w.requires_grad)
        new.weight, new.bias = w, self.bias
        return new.train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        local = local_of(w)
        w_casts = gathered_casts(w)
        if not self.fp8_enabled:
            if w_casts is not None:
                raise RuntimeError("fp8func: a high-precision phase reached a layer whose weight FSDP2 gathered in "
                                   "FP8; convert with fsdp_fp8_all_gather=False to schedule precisions.")
            return F.linear(x, w, self.bias)
        if isinstance(local, weight_type(FP8_WEIGHTS)):
            if local is not w:
                raise RuntimeError(
                    "fp8func: this layer's fp8 weight reached its forward still sharded (a DTensor): only "
                    "FSDP2 gathers fp8 weights. Wrap the layer or a parent with fully_shard, or convert "
                    "without fp8_weights for tensor parallel alone."
                )
            # Outside FSDP2: the stored casts (staged values are quantized now, whole-tensor amax).
            return fp8_linear(x, w, self.bias, self.plan, w_casts=local.casts(), x_casts=self._x_casts(x, w))[0]
        if w_casts is not None and "w" not in local.valid:
            raise RuntimeError(
                "fp8func: this layer's forward ran while FSDP2 held only its backward (grad_input) "
                "weight cast: activation checkpointing recomputes the forward inside the backward, "
                "after FSDP2 re-gathered the weight for the backward alone. Use fully_shard(..., "
                "reshard_after_forward=False) for checkpointed blocks, a tensorwise or blockwise "
                "recipe, or convert(..., fsdp_fp8_all_gather=False)."
            )
        if self.plan.delayed is None:
            return fp8_linear(x, w, self.bias, self.plan, w_casts=w_casts, x_casts=self._x_casts(x, w))[0]
        if not self._in_apply and not torch.compiler.is_compiling():
            if torch._C._functorch.peek_interpreter_stack() is not None:
                raise RuntimeError(
                    "fp8func: a delayed-scaling Fp8Linear ran under a torch.func transform with its state in buffers, "
                    "where the state's update (its gradient) would be lost. Run the model with fp8func.nn.apply("
                    "model, params, states, *args) and differentiate with respect to the states too.")
            self._hook_grad_output_state()
        elif (not self._in_apply and torch.is_grad_enabled()
              and getattr(self.fp8_x_scale, "_fp8func_hooked", None) is not _HOOKED):
            raise RuntimeError(
                "fp8func: a compiled delayed-scaling Fp8Linear found state buffers it has not hooked: something "
                "replaced them after convert (parallelize_module makes them replicated DTensors), and compiled code "
                "cannot hook the new ones, so the next states would never be written. Call "
                "fp8func.nn.hook_scaling_states(model) after parallelize_module and before the first compiled step.")
        # packed: the state passed on stays one tensor (a compiled forward's one output, not six views)
        y, passed = fp8_linear(x, w, self.bias, self.plan, state=self._state_input(), w_casts=w_casts,
                               amax_sharding=self.amax_sharding, packed=True)
        if torch.is_grad_enabled():
            self._pending = passed
        return y

    def _x_casts(self, x: torch.Tensor, w: torch.Tensor) -> dict | None:
        """The input's casts made once for this layer's sibling group (``SharedInputCasts``); None
        where the layer casts it itself, or where ``x`` exists only as its casts (gathered in FP8 by
        a sequence-parallel style), which the op reads from ``x``."""
        # eager only (see SharedInputCasts); compiled code never reads the group, a per-layer object
        if casts_only(x) or torch.compiler.is_compiling() or self._input_casts is None:
            return None
        return self._input_casts.get(x, self.plan, w.requires_grad)

    def extra_repr(self) -> str:
        fp8_weights = ", fp8_weights=True" if self.fp8_weights else ""
        return (f"{super().extra_repr()}, recipe={self.plan.name}, "
                f"fsdp_fp8_all_gather={self.fsdp_fp8_all_gather}{fp8_weights}")


def check_fp8_weights(recipe: Recipe | LinearPlan, fsdp_fp8_all_gather: bool) -> None:
    check_fp8_weights_recipe(recipe)
    if not fsdp_fp8_all_gather:
        raise ValueError("fp8func: fp8_weights=True keeps no high-precision weight to all-gather, so it implies "
                         "the fp8 all-gather; drop fsdp_fp8_all_gather=False (or set fp8_weights=False).")


class _StateGradHook:
    """Hands the layer to its ``StateWrites`` when its state gradient (the next state) is accumulated."""

    def __init__(self, layer: Fp8Linear):
        self._layer = weakref.ref(layer)

    def __call__(self, t: torch.Tensor) -> None:
        layer = self._layer()
        if layer is not None:
            layer._writes.add(layer)


def hook_scaling_states(model: nn.Module) -> int:
    """Hooks the state buffers of every delayed-scaling ``Fp8Linear`` of ``model`` for the write of
    their next state at the end of each backward; returns the number of layers.

    ``convert`` and ``.to()`` hook them, and an eager forward hooks buffers that something else
    replaced; a compiled forward cannot. Call this after a transform that replaces module buffers
    (``parallelize_module`` makes them replicated DTensors) and before the first compiled step.

    Example:
        >>> parallelize_module(model, tp_mesh, plan)
        >>> fp8func.nn.hook_scaling_states(model)
        >>> model.compile()
    """
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.plan.delayed is not None]
    writes = StateWrites()  # one write of the next states for the whole model
    for m in layers:
        m.write_states_with(writes)
        m._hook_grad_output_state()
    return len(layers)
