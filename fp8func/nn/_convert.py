"""``convert(model, ...)``: swap ``nn.Linear`` layers for ``Fp8Linear`` in place; ``report(model)``."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .._scaling import AxisWise, Recipe, block_lengths
from ._auto import MARGIN, estimate_ms, profile_for
from ._linear import Fp8Linear, _check_fp8_weights
from ._moe import Fp8Experts, is_fused_experts

__all__ = ["convert", "report", "LayerReport", "Report"]

log = logging.getLogger("fp8func")
_DECISIONS = "_fp8func_decisions"  # fqn -> reason it was not converted ("" when converted)
_CONVERTED = "_fp8func_converted"  # the fqns convert() put in FP8


def _why_not(module: nn.Linear, fqn: str, recipe: Recipe, filter_fn) -> str:
    if callable(filter_fn) and not filter_fn(module, fqn):
        return "excluded by filter"
    k, n = module.in_features, module.out_features
    if k % 16 or n % 16:
        return f"K={k}, N={n}: FP8 GEMMs need both divisible by 16"
    for role, spec, shape in (("weight", recipe.weight, (n, k)), ("input", recipe.input, (16, k))):
        try:
            block_lengths(spec.granularity, shape)
        except ValueError:
            return f"{role} cast {spec.granularity!r} does not tile {role} of shape {shape}"
    return ""


def _auto(module: nn.Linear, recipe: Recipe, tokens: int, profile) -> tuple[str, str]:
    """(reason to keep bf16 or "", note for a converted layer) from the roofline model."""
    k, n = module.in_features, module.out_features
    bf16, fp8 = estimate_ms(tokens, k, n, None, profile), estimate_ms(tokens, k, n, recipe, profile)
    figures = f"modelled fwd+bwd at {tokens} tokens on {profile.name}: fp8 {fp8:.3f} ms, bf16 {bf16:.3f} ms"
    if fp8 * MARGIN > bf16:
        why = "FP8 not faster" if fp8 >= bf16 else f"FP8 {bf16 / fp8:.2f}x faster, under the {MARGIN}x margin"
        return f"auto: kept bf16, {why} ({figures})", ""
    return "", f"auto: {bf16 / fp8:.2f}x ({figures})"


def _convert_experts(model: nn.Module, recipe: Recipe, decisions: dict) -> tuple[int, int]:
    """Swaps HF fused MoE experts modules for ``Fp8Experts`` (row-wise recipes: the FP8 grouped
    GEMM casts per token and per expert row). Returns (converted, found)."""
    found = [(fqn, m) for fqn, m in model.named_modules() if fqn and is_fused_experts(m)]
    rowwise = all(isinstance(s.granularity, AxisWise) and s.granularity.axis in (-1, 1)
                  for s in (recipe.input, recipe.weight, recipe.grad_output))
    for fqn, m in found:
        if not rowwise:
            decisions[fqn] = (f"MoE experts kept high precision: FP8 grouped GEMMs take row-wise recipes, "
                              f"not {recipe.name!r}")
            continue
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent), child, Fp8Experts(m, recipe))
        decisions[fqn] = "MoE experts: FP8 grouped GEMMs"
    return (len(found) if rowwise else 0), len(found)


def convert(
    model: nn.Module,
    recipe: Recipe | str = "tensorwise",
    *,
    filter: Callable[[nn.Module, str], bool] | str | None = None,
    fsdp_fp8_all_gather: bool = True,
    fp8_weights: bool = False,
    tokens: int = 8192,
) -> nn.Module:
    """Replaces ``nn.Linear`` layers of ``model`` in place with ``Fp8Linear``; returns ``model``.

    Parameters keep their names and state_dict keys. A layer stays high-precision when
    ``filter(module, fqn)`` returns False or the recipe cannot tile it; ``report(model)`` says
    which and why. ``filter="auto"`` also keeps a layer in bf16 where a roofline model of its
    training step at ``tokens`` rows (batch x sequence per GPU), calibrated on the GPU
    (``fp8func.nn._auto``), says FP8 would not be faster; the report gives both modelled times. A weight shared with another module (tied embeddings) is converted without
    the fp8 all-gather, since the other module needs the high-precision values.

    ``fp8_weights=True``: converted layers keep their weights in FP8 (``Fp8WeightParam``:
    payloads + scales, sharded and all-gathered in FP8 by FSDP2; implies the fp8 all-gather).
    Train them with ``fp8func.nn.MasterWeights``, which holds the high-precision master copy for
    the optimizer and re-quantizes the weights after each step. Shared (tied) weights stay in
    high precision, and ``report`` says why. See ``docs/fp8_weights.md``.

    Logs one line on the ``fp8func`` logger (INFO):
    ``fp8func: converted N/M linear layers (recipe=..., fsdp_fp8_all_gather=...)``.
    """
    recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(recipe, Recipe):
        raise TypeError(f"convert: recipe={recipe!r}; expected a Recipe or a name such as 'tensorwise'.")
    if fp8_weights:
        _check_fp8_weights(recipe, fsdp_fp8_all_gather)
    if isinstance(filter, str) and filter != "auto":
        raise ValueError(f"convert: filter={filter!r}; expected a callable (module, fqn) -> bool, 'auto' or None.")
    profile = profile_for() if filter == "auto" else None
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    decisions = getattr(model, _DECISIONS, {})
    converted_fqns = getattr(model, _CONVERTED, set())
    targets = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear]
    converted = 0
    for fqn, module in targets:
        reason = _why_not(module, fqn, recipe, filter)
        note = ""
        if not reason and profile is not None:
            reason, note = _auto(module, recipe, tokens, profile)
        decisions[fqn] = reason or note
        if reason:
            continue
        delayed_weight = recipe.delayed is not None and recipe.delayed.weight
        gather = fsdp_fp8_all_gather and uses[id(module.weight)] == 1 and not delayed_weight
        if fsdp_fp8_all_gather and delayed_weight:
            delayed = ("delayed scaling casts the gathered weight itself, so FSDP2 all-gathers it in bf16 "
                       "(DelayedScaling(weight=False) casts the weight dynamically and gathers it in FP8)")
            decisions[fqn] = f"{note}; {delayed}" if note else delayed
        elif fsdp_fp8_all_gather and not gather:
            shared = ("weight is shared with another module, so it stays high precision"
                      if fp8_weights else "weight is shared with another module, so it is all-gathered in bf16")
            decisions[fqn] = f"{note}; {shared}" if note else shared
        new = Fp8Linear.from_linear(module, recipe, fsdp_fp8_all_gather=gather, fp8_weights=fp8_weights and gather)
        if fqn:
            parent_name, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        else:
            raise ValueError("convert: the model itself is an nn.Linear; wrap it in a module first.")
        converted += 1
        converted_fqns.add(fqn)
    experts = _convert_experts(model, recipe, decisions)
    object.__setattr__(model, _DECISIONS, decisions)  # plain attribute, not a submodule/buffer
    object.__setattr__(model, _CONVERTED, converted_fqns)
    total = sum(1 for _, m in model.named_modules() if isinstance(m, nn.Linear))
    log.info("fp8func: converted %d/%d linear layers (recipe=%s, fsdp_fp8_all_gather=%s%s)%s",
             converted, total, recipe.name, fsdp_fp8_all_gather, ", fp8_weights=True" if fp8_weights else "",
             f" and {experts[0]}/{experts[1]} MoE expert modules" if experts[1] else "")
    return model


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


def report(model: nn.Module, *, print_table: bool = True) -> Report:
    """Every linear layer of ``model``: converted or not, why, recipe, shapes. Prints the table."""
    decisions = getattr(model, _DECISIONS, {})
    rows = Report()
    for fqn, m in model.named_modules():
        if isinstance(m, Fp8Experts) or (fqn in decisions and is_fused_experts(m)):
            e, f2, h = m.gate_up_proj.shape
            rows.append(LayerReport(fqn, isinstance(m, Fp8Experts), decisions.get(fqn, ""),
                                    m.recipe.name if isinstance(m, Fp8Experts) else None, h, f2, False))
            continue
        if not isinstance(m, nn.Linear):
            continue
        if isinstance(m, Fp8Linear):
            rows.append(LayerReport(fqn, True, decisions.get(fqn, ""), m.recipe.name, m.in_features,
                                    m.out_features, m.fsdp_fp8_all_gather, m.fp8_weights))
        else:
            reason = decisions.get(fqn, "not converted (convert() has not seen this layer)")
            rows.append(LayerReport(fqn, False, reason, None, m.in_features, m.out_features, False))
    if print_table:
        print(rows)
    return rows
