"""The one line ``convert`` logs: how many layers are in FP8, and at WARNING what needs a look.

A layer the filter selected but the recipe cannot tile, a model left with nothing in FP8, and FP8
layers of an earlier ``convert`` replaced by this one's are each named there, with the reason, so
that nothing stays in high precision (or changes recipe) without a word. Layers the user's filter
excludes, and those ``filter="auto"`` keeps in bf16, are the user's decision: the line counts them,
and names them only when nothing is in FP8.
"""

from __future__ import annotations

import logging
from typing import Sequence

from torch import nn

from ._linear import Fp8Linear
from ._moe import Fp8Experts

__all__ = ["EXCLUDED", "outcome"]

EXCLUDED = "excluded by filter"  # convert's reason for a layer its filter does not select
_AUTO = "auto:"  # the prefix of filter="auto"'s reasons
_NAMES, _GROUPS = 3, 6  # layers named per reason, reasons named per line: the rest is counted


def outcome(decisions: Sequence, options: str) -> tuple[int, str]:
    """(logging level, line) for ``convert``'s decisions (``fqn``, ``module``, ``row``, ``change``)."""
    if not decisions:
        return logging.WARNING, ("convert: the model has no nn.Linear layer (nor HF fused MoE experts module): "
                                 "nothing is in FP8.")
    linears = [d for d in decisions if isinstance(d.module, nn.Linear)]
    experts = [d for d in decisions if not isinstance(d.module, nn.Linear)]
    line = f"convert: {sum(d.row.converted for d in linears)}/{len(linears)} linear layers in FP8 ({options})"
    if experts:
        line += f" and {sum(d.row.converted for d in experts)}/{len(experts)} MoE expert modules"
    nothing = not any(d.row.converted for d in decisions)
    kept = [d for d in decisions if not d.row.converted
            and (nothing or not (d.row.reason == EXCLUDED or d.row.reason.startswith(_AUTO)))]
    again = [d for d in decisions if d.change and isinstance(d.module, (Fp8Linear, Fp8Experts))]
    notes = ["nothing is in FP8"] if nothing else []
    if kept:
        notes.append("kept in high precision: " + _grouped((d.fqn, d.row.reason) for d in kept))
    if again:
        notes.append("in FP8 from an earlier convert() and converted again from their high-precision values "
                     "(exclude them with filter=[...] to keep them as they are): "
                     + _grouped((d.fqn, f"{_was(d.module)} -> {_now(d.row)}") for d in again))
    if not notes:
        return logging.INFO, line
    return logging.WARNING, f"{line}; {'; '.join(notes)}. fp8func.report(model) lists every layer and why."


def _grouped(pairs) -> str:
    """``"a, b and 4 more (reason); c (other reason)"``: layers grouped by reason, in model order."""
    groups: dict[str, list[str]] = {}
    for fqn, reason in pairs:
        groups.setdefault(reason, []).append(fqn)
    parts = []
    for reason, fqns in list(groups.items())[:_GROUPS]:
        more = f" and {len(fqns) - _NAMES} more" if len(fqns) > _NAMES else ""
        parts.append(f"{', '.join(fqns[:_NAMES])}{more} ({reason})")
    if len(groups) > _GROUPS:
        parts.append(f"{sum(len(f) for f in list(groups.values())[_GROUPS:])} more layers for other reasons")
    return "; ".join(parts)


def _was(module) -> str:
    return _options(module.recipe.name, getattr(module, "fsdp_fp8_all_gather", None),
                    getattr(module, "fp8_weights", False))


def _now(row) -> str:
    return _options(row.recipe, row.fsdp_fp8_all_gather, row.fp8_weights) if row.converted else "high precision"


def _options(recipe: str, gather: bool | None, fp8_weights: bool) -> str:
    out = recipe + ("" if gather is None else f", fsdp_fp8_all_gather={gather}")
    return out + (", fp8_weights=True" if fp8_weights else "")
