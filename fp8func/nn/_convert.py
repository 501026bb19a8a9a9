"""``plan_conversion``, ``convert``, ``unconvert`` and ``report``: which layers run in FP8, and why.

``plan_conversion(model, recipe, ...)`` decides, per linear layer (and HF fused MoE experts
module), whether it runs in FP8 and how, and returns the decisions as a ``Report``; it does not
touch the model. ``convert`` applies that plan in place and returns the model. Each converted
layer carries its own note and the plan it came from (they are the library's modules), so
``report(model)`` and ``verify`` read the decisions from the model's FP8 layers: nothing is
stored on the user's modules.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn
from torch.distributed.tensor import DTensor

from .._plan import LinearPlan, plan, why_high_precision
from .._scaling import AxisWise, Recipe
from ._auto import MARGIN, estimate_ms, profile_for
from ._linear import Fp8Linear, hook_scaling_states
from ._linear_weights import check_fp8_weights
from ._moe import Fp8Experts, is_fused_experts
from ._outcome import EXCLUDED, outcome
from ._shared import share_input_casts as _share_input_casts
from ._shared import unshare_input_casts

__all__ = ["convert", "plan_conversion", "planned", "report", "unconvert", "LayerReport", "Report"]

log = logging.getLogger("fp8func")
_SERIAL = itertools.count()  # orders the plans of successive convert() calls on one model
_KEEP = "kept as is: "  # an FP8 layer this call does not change


@dataclass(frozen=True)
class LayerReport:
    fqn: str
    converted: bool
    reason: str
    recipe: str | None
    in_features: int
    out_features: int
    fsdp_fp8_all_gather: bool
    fp8_weights: bool = False


class Report(list):
    """A list of ``LayerReport`` rows that prints as a table."""

    def __init__(self, rows=()):
        super().__init__(rows)
        self.serial = next(_SERIAL)

    def __str__(self) -> str:
        head = ("layer", "fp8", "recipe", "in x out", "fp8 all-gather", "fp8 weights", "note")
        rows = [head] + [
            (r.fqn, "yes" if r.converted else "no", r.recipe or "-", f"{r.in_features}x{r.out_features}",
             "yes" if r.fsdp_fp8_all_gather else "no", "yes" if r.fp8_weights else "no", r.reason)
            for r in self
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        n = sum(r.converted for r in self)
        return "\n".join(lines + [f"{n}/{len(self)} linear layers in FP8"])


def _selector(filter) -> Callable[[nn.Module, str], bool] | None:
    """``filter`` as a predicate (module, fqn) -> convert it; None for "convert every layer"."""
    if filter is None or filter == "auto":
        return None
    if callable(filter):
        return filter
    if isinstance(filter, (list, tuple, set, frozenset)) and all(isinstance(p, str) and p for p in filter):
        patterns = tuple(filter)
        return lambda module, fqn: not any(matches(p, fqn) for p in patterns)
    raise ValueError(
        f"convert: filter={filter!r}; expected a callable (module, fqn) -> bool (True: convert), 'auto', a list of "
        "module names / fqn patterns to keep in high precision (e.g. ['lm_head', 'layers.0.*']), or None.")


def matches(pattern: str, fqn: str) -> bool:
    """torchtitan's ``filter_fqns`` rule (the pattern is a substring of the fqn), or a glob on the
    whole fqn when the pattern has ``*``, ``?`` or ``[``."""
    return fnmatch.fnmatchcase(fqn, pattern) if any(c in pattern for c in "*?[") else pattern in fqn


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without the names that torch.compile, activation checkpointing and FSDP1 wrappers
    add: one layer's name, wrapped or not."""
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _auto(module: nn.Linear, p: LinearPlan, tokens: int, profile) -> tuple[str, str]:
    """(reason to keep bf16 or "", note for a converted layer) from the roofline model."""
    k, n = module.in_features, module.out_features
    bf16, fp8 = estimate_ms(tokens, k, n, None, profile), estimate_ms(tokens, k, n, p, profile)
    figures = f"modelled fwd+bwd at {tokens} tokens on {profile.name}: fp8 {fp8:.3f} ms, bf16 {bf16:.3f} ms"
    if fp8 * MARGIN > bf16:
        why = "FP8 not faster" if fp8 >= bf16 else f"FP8 {bf16 / fp8:.2f}x faster, under the {MARGIN}x margin"
        return f"auto: kept bf16, {why} ({figures})", ""
    return "", f"auto: {bf16 / fp8:.2f}x ({figures})"


@dataclass(frozen=True)
class _Decision:
    """One layer: its row in the plan, and whether ``convert`` replaces the module."""

    fqn: str
    module: nn.Module
    row: LayerReport
    change: bool


def _linear_decision(fqn, module, p: LinearPlan, select, profile, tokens, gather, fp8_weights, uses) -> _Decision:
    k, n = module.in_features, module.out_features
    existing = isinstance(module, Fp8Linear)
    if select is not None and not select(module, fqn):
        if existing:  # converted by an earlier call; this one leaves it alone
            return _Decision(fqn, module, _row_of(fqn, module, _KEEP + "excluded by this call's filter"), False)
        return _Decision(fqn, module, LayerReport(fqn, False, EXCLUDED, None, k, n, False), False)
    reason, note = why_high_precision(p, k, n), ""
    if not reason and profile is not None:
        reason, note = _auto(module, p, tokens, profile)
    if reason:
        return _Decision(fqn, module, LayerReport(fqn, False, reason, None, k, n, False), existing)
    delayed_weight = p.delayed is not None and p.delayed.weight
    fp8_gather = gather and uses[id(module.weight)] == 1 and not delayed_weight
    if gather and delayed_weight:
        extra = ("delayed scaling casts the gathered weight itself, so FSDP2 all-gathers it in bf16 "
                 "(DelayedScaling(weight=False) casts the weight dynamically and gathers it in FP8)")
    elif gather and not fp8_gather:
        extra = ("weight is shared with another module, so it stays high precision" if fp8_weights
                 else "weight is shared with another module, so it is all-gathered in bf16")
    else:
        extra = ""
    row = LayerReport(fqn, True, "; ".join(x for x in (note, extra) if x), p.name, k, n, fp8_gather,
                      fp8_weights and fp8_gather)
    if existing and (module.plan, module.fsdp_fp8_all_gather, module.fp8_weights) == \
            (p, row.fsdp_fp8_all_gather, row.fp8_weights):
        return _Decision(fqn, module, _row_of(fqn, module, _KEEP + "already in FP8 with this recipe and options"),
                         False)
    return _Decision(fqn, module, row, True)


def _row_of(fqn: str, m: Fp8Linear, reason: str) -> LayerReport:
    return LayerReport(fqn, True, reason, m.recipe.name, m.in_features, m.out_features, m.fsdp_fp8_all_gather,
                       m.fp8_weights)


def _experts_decision(fqn, module, p: LinearPlan, select) -> _Decision:
    e, f2, h = module.gate_up_proj.shape
    existing = isinstance(module, Fp8Experts)
    if select is not None and not select(module, fqn):
        reason = (_KEEP if existing else "") + EXCLUDED
        row = LayerReport(fqn, existing, reason, module.recipe.name if existing else None, h, f2, False)
        return _Decision(fqn, module, row, False)
    recipe = p.recipe
    rowwise = recipe is not None and all(isinstance(s.granularity, AxisWise) and s.granularity.axis in (-1, 1)
                                         for s in (recipe.input, recipe.weight, recipe.grad_output))
    if not rowwise:
        what = f"not {p.name!r}" if recipe is not None else f"not the per-GEMM LinearPlan {p.name!r}"
        why = f"MoE experts kept high precision: FP8 grouped GEMMs take row-wise recipes, {what}"
        return _Decision(fqn, module, LayerReport(fqn, False, why, None, h, f2, False), existing)
    if existing and module.recipe == recipe:
        row = LayerReport(fqn, True, _KEEP + "already in FP8 with this recipe", recipe.name, h, f2, False)
        return _Decision(fqn, module, row, False)
    return _Decision(fqn, module, LayerReport(fqn, True, "MoE experts: FP8 grouped GEMMs", recipe.name, h, f2, False),
                     True)


def _check_model(fn: str, model) -> None:
    if not isinstance(model, nn.Module):
        kind = type(model).__qualname__ if type(model).__module__ == "builtins" else \
            f"{type(model).__module__}.{type(model).__qualname__}"
        raise TypeError(
            f"{fn}: model is a {kind}; expected a torch.nn.Module whose nn.Linear layers it puts in FP8 "
            "(e.g. nn.Sequential(nn.Linear(256, 512))). For a tensor, use fp8func.quantize(x, spec) or "
            "fp8func.linear(x, weight, recipe=...).")


def _decide(model, p: LinearPlan, filter, fsdp_fp8_all_gather, fp8_weights, tokens) -> list[_Decision]:
    if fp8_weights:
        check_fp8_weights(p, fsdp_fp8_all_gather)
    select = _selector(filter)  # raises for anything but the accepted forms
    profile = profile_for() if filter == "auto" else None
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    out = []
    for fqn, m in model.named_modules():
        if type(m) is nn.Linear or isinstance(m, Fp8Linear):
            if not fqn:
                raise ValueError("convert: the model itself is an nn.Linear; wrap it in a module first.")
            out.append(_linear_decision(fqn, m, p, select, profile, tokens, fsdp_fp8_all_gather,
                                        fp8_weights, uses))
        elif fqn and (is_fused_experts(m) or isinstance(m, Fp8Experts)):
            out.append(_experts_decision(fqn, m, p, select))
    if isinstance(filter, (list, tuple, set, frozenset)):
        unused = [p for p in filter if not any(matches(p, d.fqn) for d in out)]
        if unused:
            log.warning("convert(filter=...): patterns %s match no linear layer of the model", unused)
    return out


def plan_conversion(
    model: nn.Module,
    recipe: Recipe | LinearPlan | str = "tensorwise",
    *,
    filter: Callable[[nn.Module, str], bool] | str | Sequence[str] | None = None,
    fsdp_fp8_all_gather: bool = True,
    fp8_weights: bool = False,
    tokens: int = 8192,
) -> Report:
    """What ``convert(model, recipe, ...)`` with the same arguments would do, layer by layer,
    without touching the model: a ``Report`` (one row per linear layer and HF fused MoE experts
    module: in FP8 or not, why, recipe, shapes, how FSDP2 gathers it).

    Example:
        >>> print(fp8func.nn.plan_conversion(model, "rowwise", filter=["lm_head"]))
    """
    _check_model("plan_conversion", model)
    p = plan(recipe, "plan_conversion")
    return Report(d.row for d in _decide(model, p, filter, fsdp_fp8_all_gather, fp8_weights, tokens))


def convert(
    model: nn.Module,
    recipe: Recipe | LinearPlan | str = "tensorwise",
    *,
    filter: Callable[[nn.Module, str], bool] | str | Sequence[str] | None = None,
    fsdp_fp8_all_gather: bool = True,
    fp8_weights: bool = False,
    tokens: int = 8192,
    share_input_casts: bool = True,
) -> nn.Module:
    """Puts ``model``'s linear layers in FP8 in place (``Fp8Linear``), per ``plan_conversion``; returns ``model``.

    ``recipe``: a ``Recipe``, a recipe name, or a ``LinearPlan`` (casts per GEMM, e.g. a mixed
    plan), resolved once: every layer this call converts holds that one plan.
    Parameters keep their names, values and state_dict keys. ``filter`` selects the layers:

    * a callable ``filter(module, fqn) -> bool``: True converts the layer;
    * a list of module names / fqn patterns to keep in high precision, as torchtitan's
      ``filter_fqns`` (a pattern that is a substring of the fqn, or a glob such as
      ``"model.layers.0.*"``); patterns that match no layer are logged;
    * ``"auto"``: also keeps a layer in bf16 where a roofline model of its training step at
      ``tokens`` rows (batch x sequence per GPU), calibrated on the GPU (``fp8func.nn._auto``), says
      FP8 would not be faster; the report gives both modelled times;
    * None: every layer the recipe can tile. Anything else raises.

    A layer the recipe cannot tile stays high precision, and so does the weight of a layer whose
    weight another module shares (tied embeddings: converted without the fp8 all-gather). HF
    fused MoE experts modules become ``Fp8Experts`` under row-wise recipes.

    ``fp8_weights=True``: converted layers keep their weights in FP8 (``Fp8WeightParam``:
    payloads + scales, sharded and all-gathered in FP8 by FSDP2; implies the fp8 all-gather).
    Train them with ``fp8func.nn.MasterWeights``. See ``docs/fp8_weights.md``.

    A model converted before: every layer this call selects ends up as this call decides (an FP8
    layer with other options is converted again from its high-precision values; one this recipe
    cannot tile goes back to ``nn.Linear``); layers the filter excludes are left as they are. A
    layer sharded already (FSDP2, tensor parallel) cannot be converted again: that raises, before
    anything changes. ``report(model)`` reads the decisions back from the converted layers;
    ``plan_conversion`` returns them without converting.

    ``share_input_casts``: sibling FP8 layers with one input size and one dynamic recipe (an
    attention block's q, k and v; an MLP's gate and up) cast a tensor they all read once per call
    of their parent module, not once each (``fp8func.nn.SharedInputCasts``): the same bits, fewer
    casts, in eager code (compiled code casts per layer). False: every layer casts its own input.

    Logs one line on the ``fp8func`` logger: ``convert: N/M linear layers in FP8 (recipe=...,
    fsdp_fp8_all_gather=...)`` at INFO; at WARNING when layers the filter selected stay in high
    precision (each named, with its reason), when nothing is in FP8, or when layers that were in
    FP8 with other options are converted again.
    """
    _check_model("convert", model)
    p = plan(recipe, "convert")  # resolved once: every layer this call converts holds this one object
    decisions = _decide(model, p, filter, fsdp_fp8_all_gather, fp8_weights, tokens)
    sharded = [d.fqn for d in decisions if d.change and _is_sharded(d.module)]
    if sharded:
        raise ValueError(
            f"convert: {len(sharded)} layer(s) are in FP8 already with other options and sharded (FSDP2 / tensor "
            f"parallel), e.g. {sharded[0]}: they cannot be converted again in place. Convert once, before "
            "fully_shard / parallelize_module, or exclude them from this call with filter=[...].")
    rows = Report(d.row for d in decisions)
    for d in decisions:
        if d.change:
            _replace(model, d.fqn, _apply(d, p, rows))
    hook_scaling_states(model)  # the delayed layers' next states: one write for the model
    if share_input_casts:
        _share_input_casts(model)
    else:
        unshare_input_casts(model)
    options = f"recipe={p.name}, fsdp_fp8_all_gather={fsdp_fp8_all_gather}" + \
        (", fp8_weights=True" if fp8_weights else "")
    level, message = outcome(decisions, options)
    log.log(level, "%s", message)
    return model


def _is_sharded(m: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in m.parameters(recurse=False))


def _apply(d: _Decision, p: LinearPlan, rows: Report) -> nn.Module:
    """The module ``d`` asks for: a (new) FP8 layer carrying its note and ``rows``, or the high-precision one."""
    module = d.module
    if isinstance(module, Fp8Linear):
        module = module.to_linear()
    elif isinstance(module, Fp8Experts):
        module = module.to_experts()
    if not d.row.converted:
        return module
    if isinstance(module, nn.Linear):
        new = Fp8Linear.from_linear(module, p, fsdp_fp8_all_gather=d.row.fsdp_fp8_all_gather,
                                    fp8_weights=d.row.fp8_weights)
        new.train(module.training)
    else:
        new = Fp8Experts(module, p.recipe)
    new.record_conversion(d.row.reason, rows)
    return new


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def unconvert(model: nn.Module) -> nn.Module:
    """Puts every FP8 layer of ``model`` back to high precision in place; returns ``model``.

    ``Fp8Linear`` becomes ``nn.Linear`` with the same weights (``Fp8Linear.to_linear``: the same
    tensors for high-precision weights, the master's values for FP8 weights trained with
    ``MasterWeights``, the dequantized values otherwise) and the same bias; delayed-scaling state
    is dropped. ``Fp8Experts`` gives back the HF experts module it replaced, holding its current
    parameters. Sharded layers (FSDP2, tensor parallel) raise; unconvert before sharding.

    Example:
        >>> model = fp8func.unconvert(fp8func.convert(model))   # the same nn.Linear weights back
    """
    _check_model("unconvert", model)
    found = [(fqn, m) for fqn, m in model.named_modules() if fqn and isinstance(m, (Fp8Linear, Fp8Experts))]
    sharded = [fqn for fqn, m in found if _is_sharded(m)]
    if sharded:
        raise ValueError(
            f"unconvert: {len(sharded)} FP8 layer(s) are sharded (FSDP2 / tensor parallel), e.g. {sharded[0]}; "
            "unconvert before fully_shard / parallelize_module, or load the model's full state_dict "
            "(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))) into a plain model.")
    if isinstance(model, (Fp8Linear, Fp8Experts)):
        raise ValueError("unconvert: the model itself is an FP8 layer; call its to_linear() / to_experts().")
    unshare_input_casts(model)
    for fqn, m in found:
        _replace(model, fqn, m.to_linear() if isinstance(m, Fp8Linear) else m.to_experts())
    return model


def planned(model: nn.Module) -> dict[str, LayerReport]:
    """The latest decision on each layer, from the plans the model's FP8 layers carry (the
    convert() calls that made them): a later call's row replaces an earlier call's."""
    plans = {id(m.conversion): m.conversion for m in model.modules()
             if isinstance(m, (Fp8Linear, Fp8Experts)) and m.conversion is not None}
    rows: dict[str, LayerReport] = {}
    for conversion in sorted(plans.values(), key=lambda r: r.serial):
        for row in conversion:
            if not row.reason.startswith(_KEEP):
                rows[row.fqn] = row
    return rows


def report(model: nn.Module, *, print_table: bool = True) -> Report:
    """Every linear layer of ``model``: in FP8 or not, why, recipe, shapes. Prints the table.

    FP8 layers describe themselves (their recipe, options and convert()'s note); a
    high-precision layer takes its reason from the plan of the convert() call that decided on it
    (carried by that call's FP8 layers), or says it was never converted."""
    _check_model("report", model)
    decided = planned(model)
    rows = Report()
    for fqn, m in model.named_modules():
        if isinstance(m, Fp8Experts) or (fqn and is_fused_experts(m)):
            e, f2, h = m.gate_up_proj.shape
            fp8 = isinstance(m, Fp8Experts)
            why = m.note if fp8 else hp_reason(decided.get(fqn), m)
            rows.append(LayerReport(fqn, fp8, why, m.recipe.name if fp8 else None, h, f2, False))
        elif isinstance(m, Fp8Linear):
            rows.append(LayerReport(fqn, True, m.note, m.recipe.name, m.in_features, m.out_features,
                                    m.fsdp_fp8_all_gather, m.fp8_weights))
        elif isinstance(m, nn.Linear):
            rows.append(LayerReport(fqn, False, hp_reason(decided.get(fqn), m), None, m.in_features,
                                    m.out_features, False))
    if print_table:
        print(rows)
    return rows


def hp_reason(row: LayerReport | None, m: nn.Module) -> str:
    if row is not None and not row.converted:
        return row.reason
    if row is not None:
        return "convert() put it in FP8, but it has been replaced by a high-precision module since"
    why = why_high_precision(None, m.in_features, m.out_features) if isinstance(m, nn.Linear) else ""
    if why:
        return why
    return ("not converted (no FP8 layer of the model carries a convert() decision on it; "
            "fp8func.nn.plan_conversion(model, recipe, ...) gives the reason)")
