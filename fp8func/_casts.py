"""The casts a linear layer makes, and which of them run the fused kernels of ``fp8func.kernels``.

``_cast`` is ``quantize`` (and, with ``transpose``, the operand's transposed cast) through the
Triton kernels where they apply, bitwise either way; ``weight_casts`` / ``activation_casts`` /
``grad_output_casts`` name the casts a recipe consumes (what FSDP2's fp8 all-gather and the FP8
sequence gathers make ahead of the layer); ``_forward_transposes`` says which transposed copies
the forward writes for the backward.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ._ops import quantize, quantize_with_scale
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import (AxisWise, BlockWise, CastSpec, Recipe, TensorWise, compute_amax, compute_scale,
                       raw_block_lengths, scale_shape, transpose_granularity)
from ._sharding import Sharding, reduce_amax

__all__ = ["activation_casts", "grad_output_casts", "weight_casts"]

# Which casts run the fused kernels of ``fp8func.kernels``: "auto" (CUDA tensors), "off" (always
# ``quantize``) or "reference" (the kernels' PyTorch twins on every device: tests the plumbing
# on the CPU). Same bits every way (tests/test_kernels.py, tests/test_linear.py).
KERNELS = "auto"


def _has_kernel(g) -> bool:
    """Whether ``fp8func.kernels`` has a kernel for ``g``: TensorWise, AxisWise(-1 / 1), BlockWise
    (1, 128) and (128, 128). Spelled with isinstance and ``g``'s own fields, not a membership test
    in a tuple of granularities: under torch.compile every comparison with an entry becomes a guard
    evaluated at every call."""
    if isinstance(g, TensorWise):
        return True
    if isinstance(g, AxisWise):
        return g.axis in (-1, 1)
    return isinstance(g, BlockWise) and g.block in ((1, 128), (128, 128))


def _kernel_tensor(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t``: a plain contiguous 2-D bf16 / fp32 tensor, on CUDA (or
    anywhere with ``KERNELS == "reference"``)."""
    from torch.distributed.tensor import DTensor

    if KERNELS == "off" or isinstance(t, DTensor) or t.ndim != 2 or not t.is_contiguous():
        return False
    if t.dtype not in (torch.bfloat16, torch.float32):
        return False
    return KERNELS == "reference" or t.is_cuda


def _kernel_impl() -> str:
    """The ``impl`` the casts pass to ``fp8func.kernels`` under ``KERNELS``."""
    return "reference" if KERNELS == "reference" else "auto"


def _use_kernels(t: torch.Tensor, spec: CastSpec) -> bool:
    return _has_kernel(spec.granularity) and _kernel_tensor(t)


def _amax(t: torch.Tensor, granularity) -> torch.Tensor:
    """``compute_amax(t, granularity)``, by the amax kernel where one applies (tensorwise, per
    row or per column of a contiguous 2-D bf16 / fp32 tensor): the same bits."""
    rows_or_cols = isinstance(granularity, AxisWise) and granularity.axis in (-2, -1, 0, 1)
    if (isinstance(granularity, TensorWise) or rows_or_cols) and _kernel_tensor(t):
        from . import kernels

        return kernels.amax(t, granularity, impl=_kernel_impl())
    return compute_amax(t, granularity)


def _scale(t: torch.Tensor, spec: CastSpec, sharding: tuple[Sharding, ...] = ()) -> torch.Tensor:
    """The scales ``quantize(t, spec, sharding=...)`` casts local shard ``t`` with: its amax
    (the kernel where one applies) reduced over the mesh dims that split a scale group."""
    amax = _amax(t, spec.granularity)
    for sh in sharding:
        amax = reduce_amax(amax, sh.mesh, sh.amax_mesh_dims(spec.granularity, tuple(t.shape)))
    return compute_scale(amax, spec.dtype, spec.pow2_scales)


def _dtensor_kernels(t, spec: CastSpec, transpose: bool) -> bool:
    """Whether an eager cast of DTensor ``t`` runs the kernels on its local shard (``_cast_dtensor``).

    Eager only: compiled, inductor fuses the DTensor casts into the graph around them. Shard /
    Replicate placements (a Partial tensor's amax says nothing about the sum's); a transposed
    copy for tensorwise only (the other granularities take other groups for ``t.T``)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor) or torch.compiler.is_compiling() or (transpose and not isinstance(
            spec.granularity, TensorWise)):
        return False
    if not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
        return False
    return _use_kernels(t.to_local(), spec)


def _cast_dtensor(t, spec: CastSpec, transpose: bool) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """``_cast`` of a DTensor: its local shard through the kernels with the amax reduced over the
    mesh dims that split a scale group, rewrapped with the placements ``quantize`` gives (data as
    ``t``; a scale split like the data where its groups lie within shards, else replicated)."""
    from torch.distributed.tensor import DTensor

    local, mesh = t.to_local(), t.device_mesh
    sharding = Sharding(mesh, tuple(t.placements))  # amax_mesh_dims raises for a block straddling shards
    q, q_t = _cast(local, spec, transpose, sharding=(sharding,))

    def wrap(x: torch.Tensor, placements, shape) -> DTensor:
        shape = tuple(shape)
        return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=(shape[1], 1))

    blocks = raw_block_lengths(spec.granularity, tuple(local.shape))
    scale_placements = tuple(Shard(p.dim) if isinstance(p, Shard) and blocks[p.dim % 2] is not None else Replicate()
                             for p in t.placements)
    meta = Fp8Meta(spec, t.dtype, None)
    out = Fp8Tensor(wrap(q.data, t.placements, t.shape),
                    wrap(q.scale, scale_placements, scale_shape(spec.granularity, tuple(t.shape))), meta)
    if not transpose:
        return out, None
    n, m = t.shape  # tensorwise: the transposed shards, the same replicated scale
    out_t = Fp8Tensor(wrap(q_t.data, sharding.transpose(2, 0, 1).placements, (m, n)), out.scale, meta)
    return out, out_t


def _cast(t: torch.Tensor, spec: CastSpec, transpose: bool = False,
          sharding: tuple[Sharding, ...] = ()) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """``quantize(t, spec, sharding=sharding)`` and, with ``transpose``, ``quantize(t.T, spec)``
    (a row-major ``[K, M]`` payload), by the fused kernels where they apply: one amax for both
    copies. ``sharding``: ``t`` is a local shard whose amax is reduced over these (as ``quantize``'s
    ``sharding``); where it needs reducing, the kernels run the amax and the cast as two launches
    around the reduction (a transposed copy then only for tensorwise / square blocks)."""
    if not sharding and _dtensor_kernels(t, spec, transpose):
        return _cast_dtensor(t, spec, transpose)
    mesh_dims = [(sh, sh.amax_mesh_dims(spec.granularity, tuple(t.shape))) for sh in sharding]
    reduced = any(dims for _, dims in mesh_dims)
    if _use_kernels(t, spec) and not (reduced and transpose and not _transpose_invariant(spec)):
        from . import kernels

        impl = _kernel_impl()
        if not reduced:
            q, q_t = kernels.quantize(t, spec, transpose=transpose, impl=impl)
        else:
            scale = _scale(t, spec, sharding)
            data, data_t = kernels.cast(t, scale, spec, transpose=transpose, impl=impl)
            meta = Fp8Meta(spec, t.dtype, None)
            q = Fp8Tensor(data, scale, meta)
            q_t = Fp8Tensor(data_t, scale, meta) if transpose else None  # tensorwise: blocks are never reduced
        if len(sharding) == 1:  # quantize records a single sharding in the meta
            q = Fp8Tensor(q.data, q.scale, Fp8Meta(spec, t.dtype, sharding[0]))
        return q, q_t
    q = quantize(t, spec, sharding=sharding or None)
    if not transpose:
        return q, None
    if _transpose_invariant(spec):
        # The same groups seen transposed: the same amaxes, so the forward cast's scales, bitwise.
        # Not a second amax, which compiled code reads in the transposed order (an H200 took 1.7
        # ms for the one of a [8192, 7168] grad_output inside a TP layer, against 0.12 ms).
        return q, quantize_with_scale(t.t(), q.scale.t(), spec)
    return q, quantize(t.t(), spec, sharding=tuple(sh.transpose(2, 0, 1) for sh in sharding) or None)


def _cast_with_scale(t: torch.Tensor, scale: torch.Tensor, spec: CastSpec,
                     sharding: tuple[Sharding, ...] = ()) -> Fp8Tensor:
    """``quantize_with_scale(t, scale, spec)`` (e.g. a precomputed, mesh-reduced scale), by the
    fused cast kernel where it applies."""
    meta = Fp8Meta(spec, t.dtype, sharding[0] if len(sharding) == 1 else None)
    if _use_kernels(t, spec):
        from . import kernels

        data, _ = kernels.cast(t, scale, spec, impl=_kernel_impl())
        return Fp8Tensor(data, scale, meta)
    return quantize_with_scale(t, scale, spec, sharding=sharding[0] if len(sharding) == 1 else None)


def _transpose_invariant(spec: CastSpec) -> bool:
    """True when quantize(t.T, spec) == quantize(t, spec).T for every 2-D t."""
    g = spec.granularity
    square_blocks = isinstance(g, BlockWise) and len(g.block) == 2 and g.block[0] == g.block[1]
    return isinstance(g, TensorWise) or square_blocks


def weight_casts(recipe: Recipe) -> list[tuple[str, CastSpec]]:
    """The casts of a weight ``w [N, K]`` that a linear layer consumes, as specs on ``[N, K]``.

    ``"w"``: the forward's (contraction K last). ``"w_t"``: the grad_input GEMM's, cast along N,
    present only when the forward's cast cannot be reused for it bitwise.
    """
    if recipe.grad_input_weight is None:
        return _casts_of("w", recipe.weight)
    return [("w", recipe.weight), ("w_t", _transposed(recipe.grad_input_weight))]


def activation_casts(recipe: Recipe) -> list[tuple[str, CastSpec]]:
    """The casts of an input ``x [M, K]`` that a linear layer consumes, as specs on ``[M, K]``.

    ``"x"``: the forward's (contraction K last). ``"x_t"``: the grad_weight GEMM's, cast along
    M, present only when the forward's cannot be reused for it bitwise. Empty when the recipe
    computes grad_weight in high precision (it then needs ``x`` itself).
    """
    return [] if recipe.grad_weight_hp else _casts_of("x", recipe.input)


def grad_output_casts(recipe: Recipe) -> list[tuple[str, CastSpec]]:
    """The casts of a grad_output ``dy [M, N]`` the backward consumes, as specs on ``[M, N]``.

    ``"dy"``: the grad_input GEMM's (along N); ``"dy_t"``: the grad_weight GEMM's (along M), when
    the first cannot be reused. Empty when grad_weight is computed in high precision.
    """
    return [] if recipe.grad_weight_hp else _casts_of("dy", recipe.grad_output)


def _transposed(spec: CastSpec) -> CastSpec:
    """``spec`` for the transposed 2-D operand (the same groups, seen from the other side)."""
    return spec.with_granularity(transpose_granularity(spec.granularity, 2, 0, 1))


def _casts_of(name: str, spec: CastSpec) -> list[tuple[str, CastSpec]]:
    """An operand's forward cast, and its transposed-GEMM cast unless the first serves both."""
    return [(name, spec)] if _transpose_invariant(spec) else [(name, spec), (name + "_t", _transposed(spec))]


def _forward_transposes(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, x_given: bool, w_given: bool):
    """(x, w): whether the forward writes the operand's transposed fp8 copy for the backward.

    Only for casts that go through the fused kernels, which write both copies from the same
    pass (or, row-wise, the same two passes) over the operand. The input: every cast that has
    a kernel (``_use_kernels``): transpose-invariant ones (tensorwise, 128x128 blocks), 1x128
    blocks (whose 128x1 grad_weight cast then comes from the same tiles) and row-wise ones
    (whose column-wise grad_weight cast then comes from the same amax pass instead of an amax
    and a cast of its own in the backward); the copy is saved in fp8 instead of the
    high-precision input (half the activation memory). The weight:
    transpose-invariant casts only, whose fp8 copy the backward keeps anyway; a row-wise
    weight's column-wise copy would be kept from forward to backward on top of the weight (one
    byte per parameter, ~7 GB for a Llama-3-8B without FSDP) to save 1-2% of a step, so its
    backward casts the weight itself. Only when the backward GEMM that reads the copy will run
    (grad_weight reads x's, grad_input w's) with that same spec. The values are the same bits
    either way.
    """
    if not torch.is_grad_enabled():
        return False, False
    want_x = want_w = False
    # Given casts (an FP8 sequence-parallel gather, FSDP2's fp8 weight gather) are never read
    # here: those tensors exist only as their casts, and any op on them raises.
    if weight.requires_grad and not x_given and not recipe.grad_weight_hp:
        want_x = _use_kernels(x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x, recipe.input)
    if x.requires_grad and not w_given and recipe.grad_input_weight is None and _transpose_invariant(recipe.weight):
        want_w = _use_kernels(weight, recipe.weight)
    return bool(want_x), bool(want_w)
