"""``Fp8Linear``: an ``nn.Linear`` whose forward is one call into ``fp8func.linear``.

``recipe`` (a ``Recipe``, a recipe name or a per-GEMM ``LinearPlan``) is resolved once to the
layer's ``plan``, which every forward runs; ``recipe`` reads back the ``Recipe`` (or the plan where
one was given).

The weight (``_linear_weights``):

* with ``fsdp_fp8_all_gather=True`` it is an ``Fp8AllGatherWeight``: a plain high-precision
  tensor to everything except FSDP2, which then all-gathers it as fp8 bytes, bitwise what the
  bf16 all-gather followed by the cast gives;
* with ``fp8_weights=True`` it is an ``Fp8WeightParam``: kept in FP8 (payloads + scales, no
  high-precision copy), sharded and all-gathered as fp8 by FSDP2, trained through
  ``fp8func.nn.MasterWeights`` (see ``docs/fp8_weights.md``). Implies the fp8 all-gather;
* checkpoints and copies: ``state_dict`` holds the plain high-precision weight (an FP8 weight's
  master values where ``MasterWeights`` trains it) under ``nn.Linear``'s keys, and loading one
  keeps the weight type (and reaches the master); ``torch.save`` / ``copy.deepcopy`` of the layer
  give independent layers with the same weight type; ``to_linear`` gives an ``nn.Linear`` back.

Delayed scaling (``_scaling_buffers``): with a delayed-scaling recipe (``"delayed"``) the layer
holds its ``LinearScalingState`` as buffers (``fp8_{x,w,dy}_{history,scale}``: in the state_dict
and checkpoints, never seen by the optimizer; its methods over them come from its base class
``ScalingStateMixin``) and a ``ScalingBuffers`` (``scaling_buffers``; None for dynamic recipes)
that packs them into one autograd leaf and writes the next state, their gradient, into them at
the end of each backward ("overwrite with gradient"): the forward never changes them. With
``DelayedScaling(weight=False)`` the weight is cast dynamically (its buffers stay as initialized)
and FSDP2 can all-gather it in FP8. Under ``torch.func`` transforms, use ``fp8func.nn.apply``,
which passes the states in and out explicitly.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .._autograd import fp8_linear
from .._gathered import casts_only, gathered_casts
from .._plan import LinearPlan, plan
from .._scaling import Recipe
from ._linear_weights import (
    all_gather_setting,
    check_forward_cast,
    check_high_precision,
    kept_kind,
    load_master,
    load_weight,
    pickled_state,
    plain_linear,
    save_weight,
    stored_casts,
    typed_weight,
    unpickled_state,
)
from ._scaling_buffers import ScalingBuffers, ScalingStateMixin
from ._state_writes import StateWrites
from ._weights import FP8_WEIGHTS, local_of, weight_type

__all__ = ["Fp8Linear", "hook_scaling_states"]


class Fp8Linear(ScalingStateMixin, nn.Linear):
    """``nn.Linear`` computed in FP8 per ``recipe``; same parameters and state_dict keys.

    ``fsdp_fp8_all_gather``: FSDP2 all-gathers the weight in FP8; ``fp8_weights``: the weight is
    kept in FP8, trained through ``MasterWeights``. See the module docstring for delayed scaling
    (the state's buffers: ``ScalingStateMixin``).

    Example:
        >>> layer = Fp8Linear(4096, 4096, recipe=fp8func.Recipe.from_name("rowwise"))
    """

    note = ""  # convert()'s note on this layer (auto figures, a tied weight gathered in bf16, ...)
    conversion = None  # the Report of the convert() call that made this layer (report(model) reads it)
    _master = None  # a weak reference to the master MasterWeights trains for an FP8 weight (master_weight)
    fp8_weights = False  # True: the weight is an Fp8WeightParam (convert(..., fp8_weights=True))
    fp8_enabled = True  # False: plain F.linear in high precision (PrecisionSchedule's bf16 phases)
    _input_casts = None  # the SharedInputCasts of this layer's sibling group (convert(share_input_casts=True))

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | LinearPlan | str = "tensorwise", fsdp_fp8_all_gather: bool = True,
                 fp8_weights: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.scaling_buffers = None  # an instance attribute: a stable guard
        self.plan: LinearPlan = plan(recipe, "Fp8Linear")  # resolved once: a constant to torch.compile
        self.fsdp_fp8_all_gather = all_gather_setting(self.plan, fsdp_fp8_all_gather, fp8_weights)
        self.fp8_weights = fp8_weights
        if self.plan.delayed is not None:
            self._init_state(self.plan.delayed.history_len, self.weight.device)
        if self._weight_kind() is not None:
            self.weight = typed_weight(self.weight, self._weight_kind(), self.plan)

    @property
    def recipe(self) -> Recipe | LinearPlan:
        """The ``Recipe`` the layer was made with (a name resolved), or the ``LinearPlan`` given."""
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

    @classmethod
    def from_linear(cls, linear_: nn.Linear, recipe: Recipe | LinearPlan | str, fsdp_fp8_all_gather: bool = True,
                    fp8_weights: bool = False) -> "Fp8Linear":
        """An ``Fp8Linear`` holding ``linear_``'s parameters (no re-init; FP8 weights stage the values)."""
        p = plan(recipe)
        fsdp_fp8_all_gather = all_gather_setting(p, fsdp_fp8_all_gather, fp8_weights)
        with torch.device("meta"):
            new = cls(linear_.in_features, linear_.out_features, bias=False, recipe=p, fsdp_fp8_all_gather=False)
        new.fsdp_fp8_all_gather, new.fp8_weights = fsdp_fp8_all_gather, fp8_weights
        new.weight, new.bias = typed_weight(linear_.weight, new._weight_kind(), p), linear_.bias
        if p.delayed is not None:
            new._init_state(p.delayed.history_len, linear_.weight.device)
        return new

    # The weight: what checkpoints, copies and to_linear see of it (_linear_weights).
    def _weight_kind(self) -> str | None:
        return kept_kind(self.fp8_weights, self.fsdp_fp8_all_gather)

    def master_weight(self) -> torch.Tensor | None:
        """The master ``fp8func.nn.MasterWeights`` trains for this layer's FP8 weight, or None."""
        return None if self._master is None else self._master()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            save_weight(destination, prefix + "weight", self.weight, self.master_weight())
            if self.scaling_buffers is not None:
                self.scaling_buffers.save(destination, prefix, self.weight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # args: strict, missing, ...
        value = load_weight(state_dict, prefix + "weight", self._weight_kind(), self.plan,
                            local_metadata.get("assign_to_params_buffers", False))
        if self.scaling_buffers is not None:
            self.scaling_buffers.load(state_dict, prefix, self.scaling_state())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
        load_master(self.master_weight(), value)
        self.hook_scaling_state()  # load_state_dict(assign=True) puts new state tensors in place

    def __getstate__(self):
        return pickled_state(super().__getstate__(), self._parameters.get("weight"), self.master_weight())

    def __setstate__(self, state):
        super().__setstate__(unpickled_state(_current(state)))
        self.hook_scaling_state()  # a copy's buffers are new tensors: hooked now, its first call may be compiled

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with this layer's parameters (``fp8func.unconvert`` calls it)."""
        return plain_linear(self, self.master_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        local, w_casts = local_of(w), gathered_casts(w)
        if not self.fp8_enabled:
            check_high_precision(w_casts)
            return F.linear(x, w, self.bias)
        if isinstance(local, weight_type(FP8_WEIGHTS)):  # outside FSDP2: its stored casts
            x_casts = self._x_casts(x, w)
            return fp8_linear(x, w, self.bias, self.plan, w_casts=stored_casts(w, local), x_casts=x_casts)[0]
        check_forward_cast(w_casts, local)
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
        """The input's casts made once for the sibling group (``SharedInputCasts``; eager only: compiled
        code never reads the group, a per-layer object), or None: the op casts ``x`` or reads its casts."""
        group = None if casts_only(x) or torch.compiler.is_compiling() else self._input_casts
        return None if group is None else group.get(x, self.plan, w.requires_grad)

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
