"""How an ``Fp8Linear`` keeps its weight, and how checkpoints, copies and ``to_linear`` see it.

The layer holds its weight in one of three types: a plain high-precision tensor, the weight FSDP2
all-gathers in FP8 (``fsdp_fp8_all_gather=True``) or an FP8 weight (``fp8_weights=True``), the
last two registered with ``_weights`` by ``fp8func.distributed``. Whatever the type, the rest of
the world sees plain high-precision values, under ``nn.Linear``'s keys:

* ``state_dict`` holds the weight's high-precision values (a DTensor over them under FSDP2 / TP):
  safetensors, ``save_pretrained``, ``torch.load(weights_only=True)`` and every model read them.
  An FP8 weight that ``MasterWeights`` trains gives its master's values;
* loading a state dict keeps the weight type (``load_state_dict(assign=True)``, which
  accelerate's FSDP2 loading uses, puts the checkpoint's tensor in place: it is wrapped in the
  layer's type), and writes the values into the master where there is one;
* ``torch.save`` / ``copy.deepcopy`` of the layer pickle the weight as its plain values where a
  master holds them, and wrap them again on load: a copy has the same weight type and is not
  trained by the original's ``MasterWeights``;
* ``to_linear`` gives an ``nn.Linear`` with the layer's parameters.

These functions read the layer's weight and return what the layer assigns; none sets an
attribute of the layer. The forward's checks of the weight it reached live here too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._plan import LinearPlan
from .._scaling import Recipe
from ._weights import (
    FP8_ALL_GATHER,
    FP8_WEIGHTS,
    check_fp8_weights_recipe,
    hp_weight,
    weight_kind,
    weight_type,
    wrap_weight,
)

__all__ = ["all_gather_setting", "check_forward_cast", "check_fp8_weights", "check_high_precision", "hp_values",
           "kept_kind", "load_master", "load_weight", "pickled_state", "plain_linear", "save_weight", "stored_casts",
           "typed_weight", "unpickled_state"]


def check_fp8_weights(recipe: Recipe | LinearPlan, fsdp_fp8_all_gather: bool) -> None:
    """Raises unless a layer of ``recipe`` can keep its weight in FP8 with these options."""
    check_fp8_weights_recipe(recipe)
    if not fsdp_fp8_all_gather:
        raise ValueError("fp8func: fp8_weights=True keeps no high-precision weight to all-gather, so it implies "
                         "the fp8 all-gather; drop fsdp_fp8_all_gather=False (or set fp8_weights=False).")


def all_gather_setting(p: LinearPlan, fsdp_fp8_all_gather: bool, fp8_weights: bool) -> bool:
    """The layer's ``fsdp_fp8_all_gather``, the options checked: False where delayed scaling casts
    the weight (the FSDP2 fp8 all-gather casts dynamically; see ``convert``)."""
    if fp8_weights:
        check_fp8_weights(p, fsdp_fp8_all_gather)
    return fsdp_fp8_all_gather and (p.delayed is None or not p.delayed.weight)


def kept_kind(fp8_weights: bool, fsdp_fp8_all_gather: bool) -> str | None:
    """The registered weight type a layer with these options keeps its weight in (None: plain)."""
    return FP8_WEIGHTS if fp8_weights else FP8_ALL_GATHER if fsdp_fp8_all_gather else None


def typed_weight(weight: torch.Tensor, kind: str | None, p: LinearPlan) -> torch.Tensor:
    """A new layer's weight: ``weight`` itself (``kind`` None), else a ``Parameter`` of ``kind``
    holding (FP8 weights: staging) its values, ``requires_grad`` kept."""
    if kind is None:
        return weight
    return nn.Parameter(weight_type(kind)(weight.data, p), requires_grad=weight.requires_grad)


@torch.no_grad()
def hp_values(weight: torch.Tensor, master: torch.Tensor | None) -> torch.Tensor:
    """The weight's high-precision values (a DTensor over them where it is one), in its dtype: its
    master's where ``MasterWeights`` keeps one."""
    if master is not None:
        return master.detach().to(weight.dtype)
    return hp_weight(weight)


def save_weight(destination: dict, key: str, weight: torch.Tensor, master: torch.Tensor | None) -> None:
    """A state dict's weight entry: the plain high-precision values, as an ``nn.Linear``'s."""
    if key in destination:
        destination[key] = hp_values(weight, master)


def load_weight(state_dict: dict, key: str, kind: str | None, p: LinearPlan, assign: bool) -> torch.Tensor | None:
    """Before a load: with ``assign`` (``load_state_dict(assign=True)``), a checkpoint's tensor of
    another type than ``kind`` is wrapped in it. Returns the checkpoint's tensor as given."""
    value = state_dict.get(key)
    if kind is not None and assign and isinstance(value, torch.Tensor) and weight_kind(value) != kind:
        state_dict[key] = wrap_weight(value, kind, p)
    return value


@torch.no_grad()
def load_master(master: torch.Tensor | None, value: torch.Tensor | None) -> None:
    """After a load: the master takes the loaded values; the next step re-quantizes from them."""
    if master is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(master.shape):
        master.copy_(value)


def pickled_state(state: dict, weight: torch.Tensor | None, master: torch.Tensor | None) -> dict:
    """The layer's pickled ``__dict__`` (``state``, copied): no master (a copy is not trained by the
    original's ``MasterWeights``), and the master's values as the weight where it has one."""
    state = state.copy()
    state["_master"] = None
    if master is not None and not isinstance(weight, DTensor):
        params = dict(state["_parameters"])
        params["weight"] = nn.Parameter(hp_values(weight, master), requires_grad=weight.requires_grad)
        state["_parameters"] = params
    return state


def unpickled_state(state: dict) -> dict:
    """An unpickled layer's ``__dict__`` (``state``), its weight, pickled as its plain values, wrapped
    in the layer's weight type again."""
    kind = kept_kind(state.get("fp8_weights", False), state.get("fsdp_fp8_all_gather", False))
    weight = state["_parameters"].get("weight")
    if kind is None or not isinstance(weight, torch.Tensor) or weight_kind(weight) == kind:
        return state
    params = dict(state["_parameters"])
    params["weight"] = nn.Parameter(wrap_weight(weight, kind, state["plan"]), requires_grad=weight.requires_grad)
    return {**state, "_parameters": params}


@torch.no_grad()
def plain_linear(layer: nn.Linear, master: torch.Tensor | None) -> nn.Linear:
    """A plain ``nn.Linear`` with ``layer``'s parameters (``Fp8Linear.to_linear``): the same bias
    ``Parameter``; the same weight tensor for a high-precision weight, the wrapped tensor itself
    (same storage, no copy) for the fp8 all-gather weight, and the high-precision values of FP8
    weights (``master``'s where ``MasterWeights`` keeps one), in the weight's dtype. Raises for a
    sharded weight (FSDP2, tensor parallel)."""
    w = layer.weight
    if isinstance(w, DTensor):
        raise ValueError(
            "fp8func.unconvert: this layer's weight is a DTensor (sharded by FSDP2 or tensor parallel); "
            "unconvert before fully_shard / parallelize_module, or load the model's full state_dict "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True))) into a plain model.")
    with torch.device("meta"):
        new = nn.Linear(layer.in_features, layer.out_features, bias=False)
    if weight_kind(w) is not None:
        w = nn.Parameter(hp_values(w, master), requires_grad=w.requires_grad)
    new.weight, new.bias = w, layer.bias
    return new.train(layer.training)


# What the forward checks of the weight it reached.
def check_high_precision(w_casts: dict | None) -> None:
    """A high-precision phase (``PrecisionSchedule``) needs the weight's values, not only its casts."""
    if w_casts is not None:
        raise RuntimeError("fp8func: a high-precision phase reached a layer whose weight FSDP2 gathered in "
                           "FP8; convert with fsdp_fp8_all_gather=False to schedule precisions.")


def stored_casts(weight: torch.Tensor, local: torch.Tensor) -> dict:
    """An FP8 weight's stored casts outside FSDP2 (staged values are quantized now, whole-tensor
    amax); raises for one still sharded."""
    if local is not weight:
        raise RuntimeError(
            "fp8func: this layer's fp8 weight reached its forward still sharded (a DTensor): only "
            "FSDP2 gathers fp8 weights. Wrap the layer or a parent with fully_shard, or convert "
            "without fp8_weights for tensor parallel alone.")
    return local.casts()


def check_forward_cast(w_casts: dict | None, local: torch.Tensor) -> None:
    """Raises where FSDP2 gathered the weight's backward cast alone and a forward reads it."""
    if w_casts is not None and "w" not in local.valid:
        raise RuntimeError(
            "fp8func: this layer's forward ran while FSDP2 held only its backward (grad_input) "
            "weight cast: activation checkpointing recomputes the forward inside the backward, "
            "after FSDP2 re-gathered the weight for the backward alone. Use fully_shard(..., "
            "reshard_after_forward=False) for checkpointed blocks, a tensorwise or blockwise "
            "recipe, or convert(..., fsdp_fp8_all_gather=False).")
