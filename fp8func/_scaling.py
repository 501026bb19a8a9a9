"""Static scaling metadata (granularities, CastSpec, Recipe) and the amax → scale math.

The one scale convention of fp8func: a **dequantization** scale,

    scale = max(amax, EPS) * (1 / fp8_max)    (rounded up to a power of two if asked)
    data  = saturate(x * (1 / scale))         (the reciprocal is computed once, in fp32)
    x    ≈ data.float() * scale               (what ``torch._scaled_mm`` takes as scale_a/b)

Multiplying by the reciprocal instead of dividing makes every implementation (eager, inductor,
our Triton kernels) round identically: an fp32 multiply is correctly rounded everywhere, a
Triton fp32 division is not.

A granularity says which elements share a scale. It is expressed per dimension as a *block
length*: ``None`` means "the whole dimension" (one group along it), an int ``b`` means groups
of ``b`` consecutive elements. The scale tensor always has the data's rank, with
``scale.shape[i] == 1`` for whole dimensions and ``data.shape[i] // b`` otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Union

import einops
import torch

from ._formats import E4M3, E5M2, check_fp8_dtype, fp8_max, round_up_to_pow2

__all__ = [
    "EPS",
    "TensorWise",
    "AxisWise",
    "BlockWise",
    "MX",
    "Granularity",
    "CastSpec",
    "Recipe",
    "DelayedScaling",
    "block_lengths",
    "scale_shape",
    "transpose_granularity",
    "canonical_granularity",
    "as_recipe",
    "compute_amax",
    "compute_scale",
    "split_groups",
    "merge_groups",
    "expand_scale",
]

# amax floor: an all-zero group gets scale EPS / fp8_max (finite, normal) and quantizes to zeros.
# Small enough to never bind for real activations, large enough that 1/scale stays finite.
EPS = 1e-12


@dataclass(frozen=True)
class TensorWise:
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class AxisWise:
    """One scale per slice reduced along ``axis``: for ``[M, K]``, ``axis=-1`` is one per row."""

    axis: int = -1

    def __post_init__(self):
        _check_int(self.axis, f"AxisWise(axis={self.axis!r})", "e.g. AxisWise(-1) (one scale per row)")


def _check_int(value, where: str, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where}: expected an int, got {type(value).__name__}; {example}.")


@dataclass(frozen=True)
class BlockWise:
    """One scale per block of shape ``block`` over the trailing ``len(block)`` dimensions.

    ``BlockWise((1, 128))`` is DeepSeek-style activation scaling, ``BlockWise((128, 128))``
    weight scaling. Leading dimensions (if the tensor has more) get blocks of 1.
    """

    block: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.block, tuple) or not self.block or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in self.block
        ):
            raise ValueError(
                f"BlockWise(block={self.block!r}) needs a non-empty tuple of positive ints, "
                "e.g. BlockWise((1, 128)) or BlockWise((128, 128))."
            )


@dataclass(frozen=True)
class MX:
    """OCP MX scaling: blocks of ``block`` elements along ``axis`` with power-of-two scales.

    Scales are ``2**ceil(log2(amax / fp8_max))`` (the round-up rule that never saturates the
    block maximum), always representable as e8m0 (see ``fp8func.to_e8m0``).
    """

    block: int = 32
    axis: int = -1

    def __post_init__(self):
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block <= 0:
            raise ValueError(f"MX(block={self.block!r}) needs a positive int block, e.g. MX(block=32).")
        _check_int(self.axis, f"MX(axis={self.axis!r})", "e.g. MX(block=32, axis=-1)")


Granularity = Union[TensorWise, AxisWise, BlockWise, MX]
_GRANULARITIES = (TensorWise, AxisWise, BlockWise, MX)


def norm_axis(axis: int, ndim: int, owner: object) -> int:
    # ``owner`` is formatted only when raising: repr() on the hot path would be traced by dynamo.
    if not -ndim <= axis < ndim:
        raise ValueError(f"{owner!r}: axis={axis} is out of range for a tensor with {ndim} dims.")
    return axis % ndim


def raw_block_lengths(granularity: Granularity, shape: tuple[int, ...]) -> tuple[int | None, ...]:
    """Per-dimension block lengths (``None``: the whole dimension), without divisibility checks."""
    ndim = len(shape)
    if isinstance(granularity, TensorWise):
        return (None,) * ndim
    if isinstance(granularity, AxisWise):
        axis = norm_axis(granularity.axis, ndim, granularity)
        return tuple(None if i == axis else 1 for i in range(ndim))
    if isinstance(granularity, MX):
        axis = norm_axis(granularity.axis, ndim, granularity)
        return tuple(granularity.block if i == axis else 1 for i in range(ndim))
    if isinstance(granularity, BlockWise):
        if len(granularity.block) > ndim:
            raise ValueError(
                f"{granularity!r} has {len(granularity.block)} block dims but the tensor of "
                f"shape {tuple(shape)} has only {ndim}."
            )
        return (1,) * (ndim - len(granularity.block)) + granularity.block
    raise TypeError(f"granularity={granularity!r} is not one of TensorWise, AxisWise, BlockWise, MX.")


def block_lengths(granularity: Granularity, shape: tuple[int, ...]) -> tuple[int | None, ...]:
    """Per-dimension block lengths of ``granularity`` on a tensor of ``shape``.

    ``None`` means the whole dimension. Raises if a block does not divide the shape.
    """
    shape = tuple(shape)
    blocks = raw_block_lengths(granularity, shape)
    for d, b in zip(shape, blocks):
        if b is not None and d % b:
            raise ValueError(
                f"{granularity!r} does not divide a tensor of shape {shape}: dimension of size "
                f"{d} is not a multiple of block {b}. Pad the tensor, or keep this layer out of "
                "FP8 (convert(..., filter=...)), or choose a block that divides it."
            )
    return blocks


def scale_shape(granularity: Granularity, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the scale tensor for ``granularity`` on a tensor of ``shape`` (same rank)."""
    return tuple(1 if b is None else d // b for d, b in zip(shape, block_lengths(granularity, shape)))


def transpose_granularity(granularity: Granularity, ndim: int, dim0: int, dim1: int) -> Granularity:
    """The granularity that describes the same groups after ``transpose(dim0, dim1)``."""
    dim0, dim1 = norm_axis(dim0, ndim, "transpose"), norm_axis(dim1, ndim, "transpose")
    swap = {dim0: dim1, dim1: dim0}
    if isinstance(granularity, TensorWise):
        return granularity
    if isinstance(granularity, (AxisWise, MX)):
        axis = norm_axis(granularity.axis, ndim, granularity)
        # Constructors, not dataclasses.replace: under torch.compile replace() makes dynamo guard
        # the dataclass machinery with Python-level guards, evaluated at every call.
        axis = swap.get(axis, axis)
        return AxisWise(axis) if isinstance(granularity, AxisWise) else MX(granularity.block, axis)
    # BlockWise: spell out every dim, swap, and drop leading ones to keep the short form.
    full = [1] * (ndim - len(granularity.block)) + list(granularity.block)
    full[dim0], full[dim1] = full[dim1], full[dim0]
    while len(full) > 1 and full[0] == 1:
        full.pop(0)
    return BlockWise(tuple(full))


def canonical_granularity(g: Granularity, ndim: int = 2) -> Granularity:
    """``g`` on an ``ndim``-D tensor with its axis made non-negative and its blocks spelled out on
    every dim: two granularities group the elements alike exactly when these are equal."""
    if isinstance(g, AxisWise):
        return AxisWise(norm_axis(g.axis, ndim, g))
    if isinstance(g, MX):
        return MX(g.block, norm_axis(g.axis, ndim, g))
    if isinstance(g, BlockWise):
        return BlockWise((1,) * (ndim - len(g.block)) + g.block)
    return g


def _patterns(ndim: int) -> tuple[str, str, str]:
    """einops patterns: a dim split into (groups, block), the grouped layout, groups only."""
    flat = " ".join(f"(g{i} b{i})" for i in range(ndim))
    split = " ".join(f"g{i} b{i}" for i in range(ndim))
    groups = " ".join(f"g{i}" for i in range(ndim))
    return flat, split, groups


def _block_sizes(shape: tuple[int, ...], blocks: tuple[int | None, ...]) -> dict[str, int]:
    return {f"b{i}": (d if b is None else b) for i, (d, b) in enumerate(zip(shape, blocks))}


def split_groups(x: torch.Tensor, blocks: tuple[int | None, ...]) -> torch.Tensor:
    """View ``x`` as ``[g0, b0, g1, b1, ...]``: each dim split into (groups, block)."""
    flat, split, _ = _patterns(x.ndim)
    return einops.rearrange(x, f"{flat} -> {split}", **_block_sizes(tuple(x.shape), blocks))


def merge_groups(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``split_groups``."""
    flat, split, _ = _patterns(x.ndim // 2)
    return einops.rearrange(x, f"{split} -> {flat}")


def expand_scale(scale: torch.Tensor) -> torch.Tensor:
    """View a scale ``[g0, g1, ...]`` as ``[g0, 1, g1, 1, ...]`` to broadcast over ``split_groups``."""
    _, _, groups = _patterns(scale.ndim)
    unit = " ".join(f"g{i} 1" for i in range(scale.ndim))
    return einops.rearrange(scale, f"{groups} -> {unit}")


def compute_amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-group ``max(|x|)`` in fp32, shaped like the scale. NaN propagates into its group."""
    shape = tuple(x.shape)
    blocks = block_lengths(granularity, shape)
    if x.numel() == 0:
        return x.new_zeros(scale_shape(granularity, shape), dtype=torch.float32)
    if x.ndim == 0:
        return x.abs().float()
    if isinstance(granularity, TensorWise) and x.ndim > 1:
        # One group (scale shape all ones, whatever the dim order): reduce in memory order, max is
        # exact in any order. A compiled reduction of a transposed view walks memory with a stride.
        x = x.permute(sorted(range(x.ndim), key=lambda d: -x.stride(d)))
        shape = tuple(x.shape)
        blocks = block_lengths(granularity, shape)
    flat, _, groups = _patterns(x.ndim)
    return einops.reduce(x.abs(), f"{flat} -> {groups}", "max", **_block_sizes(shape, blocks)).float()


def compute_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """Dequantization scale from amax: ``max(amax, EPS) * (1 / fp8_max)``, optionally rounded up to 2**k."""
    # A multiply by the fp32 constant 1/fp8_max, not a division: CUDA divides by a scalar as a
    # multiply by its reciprocal while the CPU divides, so only the multiply is bitwise the same
    # on every device (a / 448 differs in the last bit for about half the values).
    scale = amax.float().clamp(min=EPS) * (1.0 / fp8_max(dtype))
    return round_up_to_pow2(scale) if power_of_2 else scale


@dataclass(frozen=True, init=False)
class CastSpec:
    """How one operand is cast to FP8: element dtype, scale granularity, power-of-two scales.

    Frozen and hashable, so it can be static metadata (a pytree aux field, a compile guard).

    Example:
        >>> import fp8func as f8
        >>> spec = f8.CastSpec(dtype=f8.E4M3, granularity=f8.AxisWise(-1), power_of_2=True)
    """

    dtype: torch.dtype
    granularity: Granularity
    power_of_2: bool

    def __init__(self, dtype: torch.dtype = E4M3, granularity: Granularity | None = None,
                 power_of_2: bool = False):
        # Hand-written so that CastSpec() also builds inside torch.compile: dynamo cannot read
        # the default objects a generated dataclass __init__ closes over.
        granularity = TensorWise() if granularity is None else granularity
        check_fp8_dtype(dtype)
        if not isinstance(granularity, _GRANULARITIES):
            raise TypeError(
                f"CastSpec(granularity={granularity!r}): expected an instance of "
                "TensorWise, AxisWise, BlockWise or MX, e.g. fp8func.AxisWise(axis=-1)."
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "granularity", granularity)
        if not isinstance(power_of_2, bool):
            raise TypeError(f"CastSpec(power_of_2={power_of_2!r}): expected True or False.")
        object.__setattr__(self, "power_of_2", power_of_2)

    @property
    def pow2_scales(self) -> bool:
        """True when scales are powers of two: asked for, or implied by MX."""
        return self.power_of_2 or isinstance(self.granularity, MX)

    def with_granularity(self, granularity: Granularity) -> "CastSpec":
        return CastSpec(self.dtype, granularity, self.power_of_2)  # not dataclasses.replace: see transpose_granularity


PATHS = ("auto", "hardware", "emulated")
# Which casts run the fused kernels of ``fp8func.kernels``: "auto" (CUDA tensors), "off" (always
# ``quantize``) or "reference" (the kernels' PyTorch twins on every device, which tests the kernel
# plumbing on a CPU). The same bits every way.
KERNEL_MODES = ("auto", "off", "reference")
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed (history-based) scaling: each cast uses the scale made from the amaxes of earlier
    steps, and records its own amax for later ones, so the tensor is read once.

    Attributes:
        history_len: amaxes kept per tensor (newest first).
        algo: "max" (scale from the largest amax in the history) or "most_recent".
        weight: whether the weight's cast is delayed too (True, as TransformerEngine's). False:
            the weight is cast with its own amax (dynamic tensorwise) and only the input and
            grad_output keep a history; FSDP2 can then all-gather the weight in FP8
            (``fsdp_fp8_all_gather``; its scales batched by ``precompute_scales``), which a delayed
            weight cannot (its cast needs the layer's state).
    """

    history_len: int = 16
    algo: str = "max"
    weight: bool = True

    def __post_init__(self):
        if not isinstance(self.history_len, int) or isinstance(self.history_len, bool) or self.history_len < 1:
            raise ValueError(f"DelayedScaling(history_len={self.history_len!r}): expected an int >= 1.")
        if self.algo not in AMAX_ALGOS:
            raise ValueError(f"DelayedScaling(algo={self.algo!r}): expected one of {AMAX_ALGOS}.")
        if not isinstance(self.weight, bool):
            raise ValueError(f"DelayedScaling(weight={self.weight!r}): expected True (the weight's cast is delayed "
                             "too) or False (the weight is cast dynamically).")


GEMMS = ("output", "grad_input", "grad_weight")  # the three GEMMs of a linear layer, in torchao's words


@dataclass(frozen=True)
class Recipe:
    """Casts for the three GEMMs of a linear layer.

    Each spec describes its operand laid out as ``[other, contraction]`` (contraction axis last),
    whichever GEMM it feeds: ``input`` is ``x [M, K]`` in the forward and ``x.T [K, M]`` in the
    grad_weight GEMM; ``weight`` is ``w [N, K]`` forward and ``w.T [K, N]`` in grad_input;
    ``grad_output`` is ``dy [M, N]`` in grad_input and ``dy.T [N, M]`` in grad_weight. So
    ``AxisWise(-1)`` always means "one scale per row, reduced along the contraction axis", and a
    granularity that is symmetric under transposition (tensorwise, square blocks) lets the
    backward reuse the forward's quantized tensor.

    Attributes:
        input, weight, grad_output: the three casts (E4M3, E4M3 and E5M2 by default).
        grad_input_weight: an override for the weight cast in the grad_input GEMM (None: same).
        grad_weight_hp: compute grad_weight = dy.T @ x in high precision.
        path: "auto" (hardware GEMM where one exists), "hardware" or "emulated".
        name: a label for reports.
        delayed: ``DelayedScaling`` for history-based tensorwise scales (the "delayed" recipe);
            ``linear`` then takes and returns an explicit ``LinearScalingState``.
        fast_accum: the GEMMs (``"output"``, ``"grad_input"``, ``"grad_weight"``) whose hardware
            kernels may accumulate in the tensor cores' reduced-precision accumulator without
            periodic promotion to fp32 (``use_fast_accum``). Faster (several times for the row-wise
            grouped GEMM, docs/benchmarks.md), less precise for long contractions; the emulated path
            ignores it. Empty by default: every GEMM promotes.
        kernels: which casts run the fused Triton kernels: "auto" (CUDA tensors), "off", or
            "reference" (the kernels' PyTorch twins everywhere; the same bits, for tests).

    A ``Recipe`` names casts by role; ``fp8func.plan(recipe)`` turns it into the per-GEMM
    ``LinearPlan`` that ``linear`` runs (and that mixed recipes are written as directly).
    """

    input: CastSpec = dataclasses.field(default_factory=lambda: CastSpec(E4M3))
    weight: CastSpec = dataclasses.field(default_factory=lambda: CastSpec(E4M3))
    grad_output: CastSpec = dataclasses.field(default_factory=lambda: CastSpec(E5M2))
    grad_input_weight: CastSpec | None = None
    grad_weight_hp: bool = False
    path: str = "auto"
    name: str = "custom"
    delayed: DelayedScaling | None = None
    fast_accum: tuple[str, ...] = ()
    kernels: str = "auto"

    def __post_init__(self):
        _check_recipe_fields(self)
        if not isinstance(self.fast_accum, tuple) or not set(self.fast_accum) <= set(GEMMS):
            raise ValueError(f"Recipe(fast_accum={self.fast_accum!r}): expected a tuple of GEMM names from {GEMMS}, "
                             "e.g. fast_accum=('output',).")
        for role in ("input", "weight", "grad_output"):
            if not isinstance(getattr(self, role), CastSpec):
                raise TypeError(f"Recipe.{role}={getattr(self, role)!r} is not a CastSpec.")
        if self.delayed is not None:
            bad = [role for role in ("input", "weight", "grad_output")
                   if not isinstance(getattr(self, role).granularity, TensorWise)]
            if bad or self.grad_input_weight is not None or self.grad_weight_hp:
                raise ValueError(
                    f"Recipe(delayed=...): delayed scaling keeps one scale per tensor; the casts "
                    f"{bad or ['grad_input_weight / grad_weight_hp']} are not plain tensorwise. Use "
                    "TensorWise() specs (Recipe.from_name('delayed')) or dynamic scaling."
                )
        if self.path not in PATHS:
            raise ValueError(f"Recipe(path={self.path!r}): expected one of {PATHS}.")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"Recipe(kernels={self.kernels!r}): expected one of {KERNEL_MODES}.")

    @staticmethod
    def from_name(name: str, **overrides) -> "Recipe":
        """A named recipe: "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8",
        "delayed" (tensorwise with a 16-step amax history).

        Keyword overrides replace fields, e.g. ``Recipe.from_name("rowwise", path="emulated")``,
        ``Recipe.from_name("delayed", delayed=DelayedScaling(history_len=32))``.
        """
        if name not in NAMED_RECIPES:
            close = difflib.get_close_matches(name, NAMED_RECIPES, n=1) if isinstance(name, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"Recipe.from_name({name!r}): unknown recipe{hint}; expected one of {tuple(NAMED_RECIPES)}."
            )
        recipe = NAMED_RECIPES[name]  # prebuilt: torch.compile reads it as a constant
        return dataclasses.replace(recipe, **overrides) if overrides else recipe

    @property
    def weight_for_grad_input(self) -> CastSpec:
        return self.grad_input_weight if self.grad_input_weight is not None else self.weight


def as_recipe(recipe: "Recipe | str", where: str, example: str = "tensorwise") -> "Recipe":
    """``recipe`` itself, or the named recipe for a name (``Recipe.from_name``); raises for
    anything else, naming ``where`` it was given."""
    if isinstance(recipe, str):
        return Recipe.from_name(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe={recipe!r}; expected a Recipe or a recipe name such as {example!r}.")
    return recipe


def _check_recipe_fields(recipe: Recipe) -> None:
    """Type checks of the fields a dataclass does not check itself, with the value and the fix."""
    for field, want, example in (("grad_weight_hp", bool, "True or False"), ("name", str, "a label"),
                                 ("path", str, f"one of {PATHS}"), ("kernels", str, f"one of {KERNEL_MODES}")):
        value = getattr(recipe, field)
        if not isinstance(value, want):
            raise TypeError(f"Recipe({field}={value!r}): expected {want.__name__} ({example}).")
    if recipe.grad_input_weight is not None and not isinstance(recipe.grad_input_weight, CastSpec):
        raise TypeError(f"Recipe(grad_input_weight={recipe.grad_input_weight!r}): expected a CastSpec or None.")
    if recipe.delayed is not None and not isinstance(recipe.delayed, DelayedScaling):
        raise TypeError(f"Recipe(delayed={recipe.delayed!r}): expected a DelayedScaling or None, "
                        "e.g. DelayedScaling(history_len=16).")


def _named_recipes() -> dict[str, Recipe]:
    row = CastSpec(E4M3, AxisWise(-1), power_of_2=True)  # torchao's ROWWISE: e4m3, 2**k scales
    act_block = CastSpec(E4M3, BlockWise((1, 128)))
    mx = CastSpec(E4M3, MX(32))
    return {
        "tensorwise": Recipe(CastSpec(E4M3), CastSpec(E4M3), CastSpec(E5M2), name="tensorwise"),
        "rowwise": Recipe(row, row, row, name="rowwise"),
        # Row-wise forward; grad_input with a tensorwise weight (no column-wise re-cast of the
        # weight); grad_weight in high precision.
        "rowwise_with_gw_hp": Recipe(row, row, row, grad_input_weight=CastSpec(E4M3, TensorWise(), True),
                                     grad_weight_hp=True, name="rowwise_with_gw_hp"),
        # DeepSeek-V3: 1x128 activations and gradients, 128x128 weights, e4m3 everywhere.
        "blockwise": Recipe(act_block, CastSpec(E4M3, BlockWise((128, 128))), act_block, name="blockwise"),
        "mxfp8": Recipe(mx, mx, mx, name="mxfp8"),
        "delayed": Recipe(CastSpec(E4M3), CastSpec(E4M3), CastSpec(E5M2), name="delayed",
                          delayed=DelayedScaling()),
    }


NAMED_RECIPES = _named_recipes()
