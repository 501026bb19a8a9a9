"""The plan of a linear layer: per GEMM, its two operand casts, accumulation and path.

A ``Recipe`` names casts by role (input, weight, grad_output), as torchao does; a ``LinearPlan``
names them per GEMM, as AQT's per-dot configs do, and is what ``linear`` runs. Every consumer
reads the plan: the casts and which copies the forward writes for the backward, the shape
checks, ``convert``'s reasons and the auto filter's byte model.

Each operand cast is written on its operand laid out ``[other, contraction]`` (contraction
last), whichever GEMM it feeds:

=============  =====================  =====================
GEMM           ``a``                  ``b``
=============  =====================  =====================
output         x ``[M, K]``           w ``[N, K]``
grad_input     dy ``[M, N]``          w.T ``[K, N]``
grad_weight    dy.T ``[N, M]``        x.T ``[K, M]``
=============  =====================  =====================

So ``AxisWise(-1)`` is always "one scale per row, reduced along the contraction axis". A GEMM
whose two casts are ``None`` runs in high precision.

Example:
    >>> import fp8func as f8
    >>> row, tw = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True), f8.CastSpec(f8.E4M3)
    >>> mixed = f8.LinearPlan(output=f8.GemmPlan(row, row), grad_input=f8.GemmPlan(row, row),
    ...                       grad_weight=f8.GemmPlan(f8.CastSpec(f8.E5M2), tw), name="row-fwd")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ._scaling import (
    AMAX_ALGOS,
    KERNEL_MODES,
    NAMED_RECIPES,
    PATHS,
    CastSpec,
    DelayedScaling,
    Recipe,
    TensorWise,
    as_recipe,
    block_lengths,
    canonical_granularity,
    raw_block_lengths,
    transpose_granularity,
)

__all__ = ["GemmPlan", "LinearPlan", "OperandCasts", "plan", "operand", "untileable", "transposed",
           "why_high_precision"]


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM: its operand casts ``a`` and ``b`` (both ``None``: high precision).

    Attributes:
        a, b: ``CastSpec``s on the operands laid out ``[other, contraction]`` (module docstring).
        fast_accum: the hardware kernel may skip the periodic fp32 promotion of its accumulator.
        path: "auto" (hardware GEMM where one exists), "hardware" (raise if none) or "emulated".
    """

    a: CastSpec | None
    b: CastSpec | None
    fast_accum: bool = False
    path: str = "auto"

    def __post_init__(self):
        if (self.a is None) != (self.b is None):
            raise ValueError(f"GemmPlan(a={self.a!r}, b={self.b!r}): give both casts (an FP8 GEMM) or neither "
                             "(a high-precision GEMM).")
        for name in ("a", "b"):
            spec = getattr(self, name)
            if spec is not None and not isinstance(spec, CastSpec):
                raise TypeError(f"GemmPlan({name}={spec!r}): expected a CastSpec or None.")
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"GemmPlan(fast_accum={self.fast_accum!r}): expected True or False.")
        if self.path not in PATHS:
            raise ValueError(f"GemmPlan(path={self.path!r}): expected one of {PATHS}.")

    @property
    def hp(self) -> bool:
        """True when this GEMM runs in high precision."""
        return self.a is None


@dataclass(frozen=True)
class LinearPlan:
    """The three GEMMs of a linear layer (torchao's names), and how their casts are made.

    Attributes:
        output, grad_input, grad_weight: the ``GemmPlan`` of ``y = x @ w.T``, ``dx = dy @ w``
            and ``dw = dy.T @ x``.
        delayed: ``DelayedScaling`` when the casts use scales from earlier steps (tensorwise
            casts only; ``linear_delayed`` threads their state).
        kernels: which casts run the fused Triton kernels: "auto", "off" or "reference".
        name: a label for reports.
        recipe: the ``Recipe`` this plan was made from (``plan(recipe)``), None for a plan written
            per GEMM; not part of the plan's equality (two recipes that plan the same GEMMs
            under one name give equal plans). ``given`` reads it.
    """

    output: GemmPlan
    grad_input: GemmPlan
    grad_weight: GemmPlan
    delayed: DelayedScaling | None = None
    kernels: str = "auto"
    name: str = "custom"
    recipe: Recipe | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for gemm in ("output", "grad_input", "grad_weight"):
            if not isinstance(getattr(self, gemm), GemmPlan):
                raise TypeError(f"LinearPlan({gemm}={getattr(self, gemm)!r}): expected a GemmPlan.")
        if self.output.hp:
            raise ValueError("LinearPlan(output=GemmPlan(None, None)): the output GEMM is what makes a layer FP8; "
                             "use torch.nn.functional.linear for a high-precision layer.")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"LinearPlan(kernels={self.kernels!r}): expected one of {KERNEL_MODES}.")
        if not isinstance(self.name, str):
            raise TypeError(f"LinearPlan(name={self.name!r}): expected a str.")
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise TypeError(f"LinearPlan(recipe={self.recipe!r}): expected the Recipe the plan was made from, or None.")
        if self.delayed is not None:
            _check_delayed(self)

    @property
    def given(self) -> Recipe | LinearPlan:
        """The ``Recipe`` this plan was made from, or the plan itself where it was written per GEMM:
        what the shell's public ``recipe`` attributes show."""
        return self if self.recipe is None else self.recipe


def _check_delayed(p: LinearPlan) -> None:
    if not isinstance(p.delayed, DelayedScaling):
        raise TypeError(f"LinearPlan(delayed={p.delayed!r}): expected a DelayedScaling or None.")
    if p.delayed.algo not in AMAX_ALGOS:
        raise ValueError(f"DelayedScaling(algo={p.delayed.algo!r}): expected one of {AMAX_ALGOS}.")
    specs = [s for g in (p.output, p.grad_input, p.grad_weight) for s in (g.a, g.b)]
    x, w, dy = operand(p, "x"), operand(p, "w"), operand(p, "dy")
    if any(s is None or not isinstance(s.granularity, TensorWise) for s in specs) or not all(
            c.reuses for c in (x, w, dy)) or x.first != x.second or w.first != w.second or dy.first != dy.second:
        raise ValueError(
            f"LinearPlan {p.name!r} with delayed scaling: delayed scaling keeps one scale per tensor, so every "
            "GEMM must be FP8 and cast each operand tensorwise with the same spec in both GEMMs that read it. "
            "Use Recipe.from_name('delayed') or dynamic scaling."
        )


def plan(recipe: Recipe | LinearPlan | str, where: str = "") -> LinearPlan:
    """The per-GEMM plan of a recipe: a ``LinearPlan`` is returned as it is, a name goes through
    ``Recipe.from_name``. A named recipe's plan is built once (the same object at every call:
    compiled code reads it as a constant). ``where``: the caller an error names."""
    if isinstance(recipe, LinearPlan):
        return recipe
    if not isinstance(recipe, (Recipe, str)):
        raise TypeError(f"{where + ': ' if where else ''}recipe={recipe!r}; expected a Recipe, a LinearPlan or a "
                        "recipe name such as 'tensorwise'.")
    recipe = as_recipe(recipe, "plan")
    if NAMED_RECIPES.get(recipe.name) is recipe:
        return _NAMED_PLANS[recipe.name]
    return _plan_of(recipe)


def _plan_of(recipe: Recipe) -> LinearPlan:
    fast = recipe.fast_accum
    gw = (None, None) if recipe.grad_weight_hp else (recipe.grad_output, recipe.input)
    return LinearPlan(
        output=GemmPlan(recipe.input, recipe.weight, "output" in fast, recipe.path),
        grad_input=GemmPlan(recipe.grad_output, recipe.weight_for_grad_input, "grad_input" in fast, recipe.path),
        grad_weight=GemmPlan(*gw, "grad_weight" in fast, recipe.path),
        delayed=recipe.delayed, kernels=recipe.kernels, name=recipe.name, recipe=recipe)


class OperandCasts(NamedTuple):
    """The two casts of one operand: ``first`` on its own layout (x and w: the output GEMM's; dy:
    grad_input's), ``second`` on its transpose (the other GEMM that reads it); ``None`` where that
    GEMM runs in high precision. ``reuses``: the second is the first seen transposed (the same
    groups), so the backward reuses the forward's cast, bitwise."""

    first: CastSpec | None
    second: CastSpec | None
    reuses: bool


def operand(p: LinearPlan, role: str) -> OperandCasts:
    """The casts of ``role`` ("x", "w" or "dy") in plan ``p``."""
    if role == "x":
        first, second = p.output.a, p.grad_weight.b
    elif role == "w":
        first, second = p.output.b, p.grad_input.b
    elif role == "dy":
        first, second = p.grad_input.a, p.grad_weight.a
    else:
        raise ValueError(f"operand(role={role!r}): expected 'x', 'w' or 'dy'.")
    reuses = first is not None and second is not None and _same_groups(transposed(first), second)
    return OperandCasts(first, second, reuses)


def transposed(spec: CastSpec) -> CastSpec:
    """``spec`` for the transposed 2-D operand: the same groups, seen from the other side."""
    return spec.with_granularity(transpose_granularity(spec.granularity, 2, 0, 1))


def _same_groups(a: CastSpec, b: CastSpec) -> bool:
    """Whether two casts of one 2-D tensor give the same bits (same dtype, groups and rounding)."""
    return (a.dtype == b.dtype and a.power_of_2 == b.power_of_2
            and canonical_granularity(a.granularity) == canonical_granularity(b.granularity))


def untileable(p: LinearPlan, m: int | None, k: int, n: int) -> str:
    """Why a cast of ``p`` cannot tile its operand of a linear with these sizes ("" when all can).

    ``m=None`` (tokens not known yet, as for ``convert``) checks every cast along the dims that
    do not depend on the token count.
    """
    found = _untiled(p, m, k, n)
    if found is None:
        return ""
    gemm, name, _, shape, error = found
    return f"the {gemm} GEMM's {name} cast cannot tile its operand {shape}: {error}"


def why_high_precision(p: LinearPlan | None, k: int, n: int) -> str:
    """Why a linear layer of ``k`` inputs and ``n`` outputs stays in high precision under ``p``
    ("" when it can run in FP8; ``p=None``: under any plan): the one statement of the reasons
    ``convert`` and ``report`` give."""
    if k % 16 or n % 16:
        return f"K={k}, N={n}: FP8 GEMMs need both divisible by 16"
    if p is None:
        return ""
    found = _untiled(p, None, k, n)
    if found is None:
        return ""
    gemm, name, spec, shape, _ = found
    return f"the {gemm} GEMM's {name} cast {spec.granularity!r} does not tile its operand {shape}"


def _untiled(p: LinearPlan, m: int | None, k: int, n: int) -> tuple[str, str, CastSpec, tuple, str] | None:
    """(GEMM, operand, cast, the operand's shape, the tiling error) of the first cast of ``p``
    that cannot tile its operand, or None."""
    m = _any_multiple(p) if m is None else m
    for gemm, (a_shape, b_shape), names in (
            ("output", ((m, k), (n, k)), ("input x", "weight w")),
            ("grad_input", ((m, n), (k, n)), ("grad_output dy", "weight w.T")),
            ("grad_weight", ((n, m), (k, m)), ("grad_output dy.T", "input x.T"))):
        g = getattr(p, gemm)
        for spec, shape, name in ((g.a, a_shape, names[0]), (g.b, b_shape, names[1])):
            if spec is None:
                continue
            try:
                block_lengths(spec.granularity, shape)
            except ValueError as e:
                return gemm, name, spec, shape, str(e)
    return None


def _any_multiple(p: LinearPlan) -> int:
    """A token count that every block length of ``p`` divides."""
    lengths = {b for g in (p.output, p.grad_input, p.grad_weight) for s in (g.a, g.b) if s is not None
               for b in raw_block_lengths(s.granularity, (1, 1)) if b is not None}
    return math.lcm(*lengths) if lengths else 1


_NAMED_PLANS = {name: _plan_of(r) for name, r in NAMED_RECIPES.items()}  # prebuilt: constants for torch.compile
