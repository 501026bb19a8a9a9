"""``Fp8Linear``: an ``nn.Linear`` whose forward is one call into ``fp8func.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .._autograd import linear, linear_with_casts
from .._delayed import LinearScalingState, ScalingState
from .._delayed_linear import linear_delayed
from .._gathered import gathered_casts
from .._scaling import Recipe
from ._checkpoint import current_phase
from ._weights import FP8_ALL_GATHER, FP8_WEIGHTS, check_fp8_weights_recipe, hp_weight, local_of, weight_kind, \
    weight_type, wrap_weight

__all__ = ["Fp8Linear"]


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computed in FP8 per ``recipe``; same parameters and state_dict keys.

    With ``fsdp_fp8_all_gather=True`` the weight is an ``Fp8AllGatherWeight``: a plain
    high-precision tensor to everything except FSDP2, which then all-gathers it as fp8 bytes,
    bitwise what the bf16 all-gather followed by the cast gives.

    With ``fp8_weights=True`` the weight is an ``Fp8WeightParam``: kept in FP8 (payloads +
    scales, no high-precision copy), sharded and all-gathered as fp8 by FSDP2, trained through
    ``fp8func.nn.MasterWeights`` (see ``docs/fp8_weights.md``). Implies the fp8 all-gather.

    With a delayed-scaling recipe (``"delayed"``) the layer holds its ``LinearScalingState`` as
    buffers (``fp8_{x,w,dy}_{history,scale}``: in the state_dict and checkpoints, never seen by
    the optimizer). Each training forward records the input and weight amaxes; the backward's
    grad_output state arrives as the gradient of the ``fp8_dy_*`` buffers and is written into
    them as soon as it is accumulated (a post-accumulate-grad hook). Eval forwards use the
    state without changing it. The input and weight buffers are replaced by new tensors at each
    training forward (never written in place). With ``DelayedScaling(weight=False)`` the weight is
    cast dynamically (its buffers stay as initialized) and FSDP2 can all-gather it in FP8.

    Checkpoints and copies: ``state_dict`` holds the plain high-precision weight (an FP8 weight's
    master values where ``MasterWeights`` trains it) under ``nn.Linear``'s keys, and loading one
    keeps the weight type (and reaches the master); ``torch.save`` / ``copy.deepcopy`` of the layer
    give independent layers with the same weight type; ``to_linear`` gives an ``nn.Linear`` back.

    Example:
        >>> layer = Fp8Linear(4096, 4096, recipe=fp8func.Recipe.from_name("rowwise"))
    """

    _STATE = ("x", "w", "dy")
    note = ""  # convert()'s note on this layer (auto figures, a tied weight gathered in bf16, ...)
    conversion = None  # the Report of the convert() call that made this layer (report(model) reads it)
    _master = None  # a weak reference to the master MasterWeights trains for an FP8 weight (master_weight)
    fp8_weights = False  # True: the weight is an Fp8WeightParam (convert(..., fp8_weights=True))
    fp8_enabled = True  # False: plain F.linear in high precision (PrecisionSchedule's bf16 phases)
    amax_sharding = None  # delayed scaling: how the tokens are split over ranks (share_scaling_state)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | str = "tensorwise", fsdp_fp8_all_gather: bool = True, fp8_weights: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
        self.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        self.fp8_weights = fp8_weights
        if fp8_weights:
            _check_fp8_weights(self.recipe, fsdp_fp8_all_gather)
            self.weight = nn.Parameter(weight_type(FP8_WEIGHTS)(self.weight.data, self.recipe))
            return
        if self.recipe.delayed is not None:
            if self.recipe.delayed.weight:
                fsdp_fp8_all_gather = False  # the FSDP2 fp8 gather casts dynamically; see convert()
                self.fsdp_fp8_all_gather = False
            self._init_state(self.weight.device)
        if fsdp_fp8_all_gather:
            self.weight = nn.Parameter(weight_type(FP8_ALL_GATHER)(self.weight.data, self.recipe))

    def _init_state(self, device) -> None:
        state = LinearScalingState.init(self.recipe.delayed.history_len, device)
        for name, st in zip(self._STATE, state):
            self.register_buffer(f"fp8_{name}_history", st.amax_history)
            self.register_buffer(f"fp8_{name}_scale", st.scale)
        self._hook_grad_output_state()

    def _hook_grad_output_state(self) -> None:
        """The grad_output state comes back as a gradient: write it into the buffer, drop the grad.

        Whether a buffer has the hook is read from its hooks, not from a flag on the tensor: copies
        (``copy.deepcopy``, ``torch.load``) carry a tensor's attributes but not its hooks."""
        for t in (getattr(self, "fp8_dy_history", None), getattr(self, "fp8_dy_scale", None)):
            if t is None or t.is_meta or _apply_state_grad in (t._post_accumulate_grad_hooks or {}).values():
                continue
            t.requires_grad_(True)
            t.register_post_accumulate_grad_hook(_apply_state_grad)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._hook_grad_output_state()  # .to() / .cuda() / to_empty() make new buffer tensors
        return out

    def scaling_state(self) -> LinearScalingState | None:
        """The layer's delayed-scaling state (views of its buffers), or None for dynamic scaling."""
        if self.recipe.delayed is None:
            return None
        return LinearScalingState(*(ScalingState(getattr(self, f"fp8_{n}_history"), getattr(self, f"fp8_{n}_scale"))
                                    for n in self._STATE))

    @classmethod
    def from_linear(cls, linear_: nn.Linear, recipe: Recipe, fsdp_fp8_all_gather: bool = True,
                    fp8_weights: bool = False) -> "Fp8Linear":
        """An ``Fp8Linear`` holding ``linear_``'s parameters (the same values, no re-init; with
        ``fp8_weights`` the weight's values are staged, quantized at the first use)."""
        if fp8_weights:
            _check_fp8_weights(recipe, fsdp_fp8_all_gather)
        fsdp_fp8_all_gather = fsdp_fp8_all_gather and (recipe.delayed is None or not recipe.delayed.weight)
        with torch.device("meta"):
            new = cls(linear_.in_features, linear_.out_features, bias=False, recipe=recipe,
                      fsdp_fp8_all_gather=False)
        weight = linear_.weight
        if fp8_weights:
            weight = nn.Parameter(weight_type(FP8_WEIGHTS)(weight.data, recipe), requires_grad=weight.requires_grad)
        elif fsdp_fp8_all_gather:
            weight = nn.Parameter(weight_type(FP8_ALL_GATHER)(weight.data, recipe), requires_grad=weight.requires_grad)
        new.weight = weight
        new.bias = linear_.bias
        new.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        new.fp8_weights = fp8_weights
        if new.recipe.delayed is not None:
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

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key, kind = prefix + "weight", self._weight_kind()
        value = state_dict.get(key)
        if (kind is not None and local_metadata.get("assign_to_params_buffers", False)
                and isinstance(value, torch.Tensor) and weight_kind(value) != kind):
            # load_state_dict(assign=True) (accelerate's FSDP2 loading does it) puts the checkpoint's
            # tensor in place of the weight: it takes this layer's weight type.
            state_dict[key] = wrap_weight(value, kind, self.recipe)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        master = self.master_weight()
        if master is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(master.shape):
            with torch.no_grad():  # the masters take the loaded values: the next step re-quantizes from them
                master.copy_(value)

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
        super().__setstate__(state)
        kind, w = self._weight_kind(), self._parameters.get("weight")
        if kind is not None and isinstance(w, torch.Tensor) and weight_kind(w) != kind:
            # Pickled (torch.save of the model, copy by pickling) as its plain values: wrap them again.
            self.weight = nn.Parameter(wrap_weight(w, kind, self.recipe), requires_grad=w.requires_grad)

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
            return linear_with_casts(x, w, self.bias, self.recipe, local.casts(), gathered_casts(x))
        if w_casts is not None and "w" not in local.valid:
            raise RuntimeError(
                "fp8func: this layer's forward ran while FSDP2 held only its backward (grad_input) "
                "weight cast: activation checkpointing recomputes the forward inside the backward, "
                "after FSDP2 re-gathered the weight for the backward alone. Use fully_shard(..., "
                "reshard_after_forward=False) for checkpointed blocks, a tensorwise or blockwise "
                "recipe, or convert(..., fsdp_fp8_all_gather=False)."
            )
        x_casts = gathered_casts(x)
        if self.recipe.delayed is not None:
            if x_casts is not None or (w_casts is not None and self.recipe.delayed.weight):
                raise ValueError("fp8func: delayed scaling casts the input (and, unless DelayedScaling(weight=False), "
                                 "the weight) itself; use the stock TP styles, and fsdp_fp8_all_gather=False or "
                                 "DelayedScaling(weight=False) with a delayed recipe.")
            if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None:
                self._hook_grad_output_state()  # (under torch.func the caller threads the state)
            state = self.scaling_state()
            if self.training and not torch.compiler.is_compiling():
                replayed = self._checkpoint_state(state)
                if replayed is not None:  # a recomputation: the forward's own state, nothing recorded
                    return linear_delayed(x, w, self.bias, self.recipe, replayed, self.amax_sharding, w_casts)[0]
            y, new = linear_delayed(x, w, self.bias, self.recipe, state, self.amax_sharding, w_casts)
            if self.training:
                # Rebind, not copy_: the backward may read the old tensors (a compiled backward
                # recomputes cheap ops from the forward's inputs), so they must stay unchanged.
                recorded = self._STATE[:2] if self.recipe.delayed.weight else self._STATE[:1]
                for name, st in zip(recorded, new[:2]):
                    setattr(self, f"fp8_{name}_history", st.amax_history.detach())
                    setattr(self, f"fp8_{name}_scale", st.scale.detach())
            return y
        if w_casts is None and x_casts is None:
            return linear(x, w, self.bias, self.recipe)
        return linear_with_casts(x, w, self.bias, self.recipe, w_casts, x_casts)

    def _checkpoint_state(self, state: LinearScalingState) -> LinearScalingState | None:
        """Activation checkpointing (``fp8func.nn.checkpoint_context``): stashes ``state`` in the
        first forward of a checkpointed region and returns it to the recomputation (None
        otherwise). A recomputation without the context raises: the state has moved on since."""
        phase = current_phase()
        if phase is not None and phase.mode == "replay":
            pending = phase.stash.get(id(self))
            if not pending:
                raise RuntimeError("fp8func: a delayed-scaling layer is recomputed by activation checkpointing "
                                   "but its first forward ran outside checkpoint_context; pass the same "
                                   "context_fn=fp8func.nn.checkpoint_context to every checkpoint around it.")
            return pending.pop(0)
        if phase is not None and phase.mode == "record":
            phase.stash.setdefault(id(self), []).append(state)
        elif torch._C._current_graph_task_id() != -1:  # a training forward inside a backward
            raise RuntimeError(
                "fp8func: a delayed-scaling Fp8Linear ran its training forward inside a backward pass "
                "(activation checkpointing recomputing it): its scaling state moved on after the first "
                "forward, so the recomputed casts would differ from the forward's. Checkpoint with "
                "torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, "
                "context_fn=fp8func.nn.checkpoint_context) (HF: gradient_checkpointing_kwargs="
                "{'use_reentrant': False, 'context_fn': fp8func.nn.checkpoint_context}), or use a "
                "dynamic recipe.")
        return None

    def extra_repr(self) -> str:
        fp8_weights = ", fp8_weights=True" if self.fp8_weights else ""
        return (f"{super().extra_repr()}, recipe={self.recipe.name}, "
                f"fsdp_fp8_all_gather={self.fsdp_fp8_all_gather}{fp8_weights}")


def _check_fp8_weights(recipe: Recipe, fsdp_fp8_all_gather: bool) -> None:
    check_fp8_weights_recipe(recipe)
    if not fsdp_fp8_all_gather:
        raise ValueError("fp8func: fp8_weights=True keeps no high-precision weight to all-gather, so it implies "
                         "the fp8 all-gather; drop fsdp_fp8_all_gather=False (or set fp8_weights=False).")



def _apply_state_grad(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(t.grad)
    t.grad = None
