"""``Fp8Linear``: an ``nn.Linear`` whose forward is one call into ``fp8func.linear``."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .._autograd import fp8_linear
from .._delayed import LinearScalingState
from .._gathered import casts_only, gathered_casts
from .._plan import LinearPlan, plan
from .._scaling import Recipe
from ._scaling_buffers import STATE_NAMES, ScalingBuffers
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

__all__ = ["Fp8Linear", "hook_scaling_states"]


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
    the optimizer) and a ``ScalingBuffers`` (``scaling_buffers``; None for dynamic recipes) that
    packs them into one autograd leaf and writes the next state, their gradient, into them at the
    end of each backward ("overwrite with gradient"): the forward never changes them. With
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

    note = ""  # convert()'s note on this layer (auto figures, a tied weight gathered in bf16, ...)
    conversion = None  # the Report of the convert() call that made this layer (report(model) reads it)
    _master = None  # a weak reference to the master MasterWeights trains for an FP8 weight (master_weight)
    fp8_weights = False  # True: the weight is an Fp8WeightParam (convert(..., fp8_weights=True))
    fp8_enabled = True  # False: plain F.linear in high precision (PrecisionSchedule's bf16 phases)
    _input_casts = None  # the SharedInputCasts of this layer's sibling group (convert(share_input_casts=True))
    scaling_buffers: ScalingBuffers | None = None  # delayed scaling: what the layer does with its state buffers

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | LinearPlan | str = "tensorwise", fsdp_fp8_all_gather: bool = True,
                 fp8_weights: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.scaling_buffers = None  # an instance attribute: a stable guard
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

    def use_input_casts(self, group) -> None:
        """The ``SharedInputCasts`` of this layer's sibling group, or None: it casts its own input."""
        self._input_casts = group

    # Delayed scaling: the state's buffers are this layer's; the rest is its ScalingBuffers'.
    def scaling_state(self) -> LinearScalingState | None:
        """The layer's delayed-scaling state (views of its buffers), or None for dynamic scaling."""
        if self.scaling_buffers is None:
            return None
        return LinearScalingState.from_tensors(getattr(self, name) for name in STATE_NAMES)

    def hook_scaling_state(self) -> None:
        """Hooks the state buffers for the write of the next state (``ScalingBuffers.hook``), packed
        again where something replaced them; nothing for dynamic scaling."""
        if self.scaling_buffers is not None:
            self._register_state(self.scaling_buffers.hook(self.scaling_state()))

    def _register_state(self, state: LinearScalingState | None) -> None:
        for name, t in zip(STATE_NAMES, () if state is None else state.tensors()):
            self.register_buffer(name, t)

    def _init_state(self, device) -> None:
        self.scaling_buffers = ScalingBuffers()
        self._register_state(LinearScalingState.init(self.plan.delayed.history_len, device))
        self.hook_scaling_state()

    def _apply(self, fn, recurse=True):
        state = self.scaling_state()
        out = super()._apply(fn, recurse)
        if state is not None:
            self._register_state(ScalingBuffers.kept_float32(state, self.scaling_state()))
        self.hook_scaling_state()  # .to() / .cuda() / to_empty() make new buffer tensors
        return out

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
        if not keep_vars and self.scaling_buffers is not None:
            self.scaling_buffers.save(destination, prefix, self.weight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key, kind = prefix + "weight", self._weight_kind()
        value = state_dict.get(key)
        if (kind is not None and local_metadata.get("assign_to_params_buffers", False)
                and isinstance(value, torch.Tensor) and weight_kind(value) != kind):
            # load_state_dict(assign=True) (accelerate's FSDP2 loading does it) puts the checkpoint's
            # tensor in place of the weight: it takes this layer's weight type.
            state_dict[key] = wrap_weight(value, kind, self.plan)
        if self.scaling_buffers is not None:
            self.scaling_buffers.load(state_dict, prefix, self.scaling_state())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        master = self.master_weight()
        if master is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(master.shape):
            with torch.no_grad():  # the masters take the loaded values: the next step re-quantizes from them
                master.copy_(value)
        self.hook_scaling_state()  # load_state_dict(assign=True) puts new state tensors in place

    def __getstate__(self):
        state = super().__getstate__().copy()
        master = self.master_weight()
        state["_master"] = None  # a copy is not trained by the original's MasterWeights
        w = self._parameters.get("weight")
        if master is not None and not isinstance(w, DTensor):
            params = dict(state["_parameters"])
            params["weight"] = nn.Parameter(self._hp_weight(), requires_grad=w.requires_grad)
            state["_parameters"] = params
        return state

    def __setstate__(self, state):
        super().__setstate__(_current(state))
        kind, w = self._weight_kind(), self._parameters.get("weight")
        if kind is not None and isinstance(w, torch.Tensor) and weight_kind(w) != kind:
            # Pickled (torch.save of the model, copy by pickling) as its plain values: wrap them again.
            self.weight = nn.Parameter(wrap_weight(w, kind, self.plan), requires_grad=w.requires_grad)
        # A copy's state buffers are new tensors, without the hook: hook them now, so that a copy's
        # first call may be a compiled one.
        self.hook_scaling_state()

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
        buffers = self.scaling_buffers
        if buffers is None:
            return fp8_linear(x, w, self.bias, self.plan, w_casts=w_casts, x_casts=self._x_casts(x, w))[0]
        self._register_state(buffers.before_call(self.scaling_state, self.fp8_x_scale))
        # packed: the state passed on stays one tensor (a compiled forward's one output, not six views)
        y, passed = fp8_linear(x, w, self.bias, self.plan, state=buffers.state_input(self.scaling_state),
                               w_casts=w_casts, amax_sharding=buffers.amax_sharding, packed=True)
        buffers.pass_on(passed)
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


def _current(state: dict) -> dict:
    """A pickled ``Fp8Linear``'s ``__dict__`` in the form this layer reads: a ``Recipe`` held in
    place of the plan becomes its plan, and delayed-scaling attributes held by the layer itself
    (the state passed on, the hooked leaf, the ``StateWrites``, the amax sharding) a ``ScalingBuffers``."""
    state = dict(state)
    if "plan" not in state and "recipe" in state:
        state["plan"] = plan(state.pop("recipe"))
    old = {k: state.pop(k) for k in ("_pending", "_in_apply", "_packed", "_hooked_state", "_writes", "amax_sharding")
           if k in state}
    if state["plan"].delayed is not None and state.get("scaling_buffers") is None:
        state["scaling_buffers"] = ScalingBuffers(old.get("_writes"), old.get("amax_sharding"))
    return state


def check_fp8_weights(recipe: Recipe | LinearPlan, fsdp_fp8_all_gather: bool) -> None:
    check_fp8_weights_recipe(recipe)
    if not fsdp_fp8_all_gather:
        raise ValueError("fp8func: fp8_weights=True keeps no high-precision weight to all-gather, so it implies "
                         "the fp8 all-gather; drop fsdp_fp8_all_gather=False (or set fp8_weights=False).")


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
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.scaling_buffers is not None]
    writes = StateWrites()  # one write of the next states for the whole model
    for m in layers:
        m.scaling_buffers.write_with(writes)
        m.hook_scaling_state()
    return len(layers)
