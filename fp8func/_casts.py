"""The casts a linear layer makes, and which of them run the fused kernels of ``fp8func.kernels``.

``cast`` is ``quantize`` (and, with ``transpose``, the operand's transposed cast) through the
Triton kernels where they apply, bitwise either way; ``cast_delayed`` the same with a given
scale and the amax recorded; ``weight_casts`` / ``activation_casts`` / ``grad_output_casts``
name the casts a plan consumes (what FSDP2's fp8 all-gather and the FP8 sequence gathers make
ahead of the layer; ``given_leaves`` checks such casts against the plan); ``forward_transposes``
says which transposed copies the forward writes for the backward; ``cast_operand`` and
``cast_grad_output`` are the linear op's casts of its operands, given, delayed or dynamic. Every
decision reads the layer's ``LinearPlan``. A distributed tensor's eager cast runs as the
distributed layer registered it (``fp8func._hooks``).
"""

from __future__ import annotations

import torch

from ._hooks import cast_distributed, is_distributed
from ._ops import quantize, quantize_with_scale
from ._plan import LinearPlan, operand, plan, transposed
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import AxisWise, BlockWise, CastSpec, Recipe, TensorWise, compute_amax, compute_scale
from ._sharding import Sharding, reduce_amax

__all__ = ["activation_casts", "cast_grad_output", "cast_operand", "given_cast", "given_leaves", "grad_output_casts",
           "input_casts", "weight_casts"]


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


def _kernel_tensor(t: torch.Tensor, kernels: str) -> bool:
    """Whether the kernels take ``t``: a plain contiguous 2-D bf16 / fp32 tensor, on CUDA (or
    anywhere with ``kernels="reference"``)."""
    if kernels == "off" or is_distributed(t) or t.ndim != 2 or not t.is_contiguous():
        return False
    if t.dtype not in (torch.bfloat16, torch.float32):
        return False
    return kernels == "reference" or t.is_cuda


def _kernel_impl(kernels: str) -> str:
    """The ``impl`` the casts pass to ``fp8func.kernels`` in mode ``kernels``."""
    return "reference" if kernels == "reference" else "auto"


def use_kernels(t: torch.Tensor, spec: CastSpec, kernels: str = "auto") -> bool:
    return _has_kernel(spec.granularity) and _kernel_tensor(t, kernels)


def amax_for_cast(t: torch.Tensor, granularity, kernels: str = "auto") -> torch.Tensor:
    """``compute_amax(t, granularity)``, by the amax kernel where one applies (tensorwise, per
    row or per column of a contiguous 2-D bf16 / fp32 tensor): the same bits."""
    rows_or_cols = isinstance(granularity, AxisWise) and granularity.axis in (-2, -1, 0, 1)
    if (isinstance(granularity, TensorWise) or rows_or_cols) and _kernel_tensor(t, kernels):
        from . import kernels as kernel_ops

        return kernel_ops.amax(t, granularity, impl=_kernel_impl(kernels))
    return compute_amax(t, granularity)


def scale_for_cast(t: torch.Tensor, spec: CastSpec, sharding: tuple[Sharding, ...] = (),
                   kernels: str = "auto") -> torch.Tensor:
    """The scales ``quantize(t, spec, sharding=...)`` casts local shard ``t`` with: its amax
    (the kernel where one applies) reduced over the mesh dims that split a scale group."""
    amax = amax_for_cast(t, spec.granularity, kernels)
    for sh in sharding:
        amax = reduce_amax(amax, sh.mesh, sh.amax_mesh_dims(spec.granularity, tuple(t.shape)))
    return compute_scale(amax, spec.dtype, spec.pow2_scales)


def cast(t: torch.Tensor, spec: CastSpec, transpose: bool = False, sharding: tuple[Sharding, ...] = (),
          kernels: str = "auto", fuse_amax: bool = False) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """``quantize(t, spec, sharding=sharding)`` and, with ``transpose``, ``quantize(t.T, spec)``
    (a row-major ``[K, M]`` payload), by the fused kernels where they apply: one amax for both
    copies. ``sharding``: ``t`` is a local shard whose amax is reduced over these (as ``quantize``'s
    ``sharding``); where it needs reducing, the kernels run the amax and the cast as two launches
    around the reduction (a transposed copy then only for tensorwise / square blocks).
    ``fuse_amax``: ``t`` is computed in the region being compiled (an activation, a gradient), so
    a tensorwise amax goes to inductor, fused into its producer (``fp8func.kernels.quantize``).
    A distributed ``t`` (eager) casts its local shard as the distributed layer registered
    (``fp8func._hooks``)."""
    if not sharding:
        done = cast_distributed(t, spec, transpose, kernels)
        if done is not None:
            return done
    mesh_dims = [(sh, sh.amax_mesh_dims(spec.granularity, tuple(t.shape))) for sh in sharding]
    reduced = any(dims for _, dims in mesh_dims)
    if use_kernels(t, spec, kernels) and not (reduced and transpose and not _transpose_invariant(spec)):
        from . import kernels as kernel_ops

        impl = _kernel_impl(kernels)
        if not reduced:
            q, q_t = kernel_ops.quantize(t, spec, transpose=transpose, impl=impl, fuse_amax=fuse_amax)
        else:
            scale = scale_for_cast(t, spec, sharding, kernels)
            data, data_t = kernel_ops.cast(t, scale, spec, transpose=transpose, impl=impl)
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
        # Not a second amax, which compiled code would read in the transposed order, with strided
        # loads, at a fraction of the bandwidth.
        return q, quantize_with_scale(t.t(), q.scale.t(), spec)
    return q, quantize(t.t(), spec, sharding=tuple(sh.transpose(2, 0, 1) for sh in sharding) or None)


def cast_with_scale(t: torch.Tensor, scale: torch.Tensor, spec: CastSpec,
                     sharding: tuple[Sharding, ...] = (), kernels: str = "auto",
                     round_to: torch.dtype | None = None) -> Fp8Tensor:
    """``quantize_with_scale(t.to(round_to), scale, spec)`` (e.g. a precomputed, mesh-reduced
    scale), by the fused cast kernel where it applies; fp32 ``t`` rounded to bf16 in the kernel's
    one read (no bf16 copy written)."""
    if round_to is not None and t.dtype != round_to and not (
            t.dtype == torch.float32 and round_to == torch.bfloat16 and use_kernels(t, spec, kernels)):
        t, round_to = t.to(round_to), None
    meta = Fp8Meta(spec, round_to or t.dtype, sharding[0] if len(sharding) == 1 else None)
    if use_kernels(t, spec, kernels):
        from . import kernels as kernel_ops

        data, _ = kernel_ops.cast(t, scale, spec, round_to=round_to, impl=_kernel_impl(kernels))
        return Fp8Tensor(data, scale, meta)
    return quantize_with_scale(t, scale, spec, sharding=sharding[0] if len(sharding) == 1 else None)


def cast_delayed(t: torch.Tensor, spec: CastSpec, scale: torch.Tensor, transpose: bool = False,
                  kernels: str = "auto") -> tuple[Fp8Tensor, Fp8Tensor | None, torch.Tensor]:
    """A delayed-scaling cast of 2-D ``t`` with the state's ``scale (1, 1)``: ``(q, q_t, amax)``,
    ``q_t`` the transposed copy with the same scale (a row-major ``[K, M]`` payload) when asked,
    ``amax`` the tensor's own (recorded for later steps).

    One pass of ``kernels.cast_amax`` where it applies, else ``quantize_with_scale`` and an amax
    (inductor fuses them). The same bits either way. A non-finite amax makes the returned scale
    NaN, so a GEMM that reads this cast shows the fault as the dynamic recipes do: a cast with a
    finite scale would saturate an inf to fp8_max and hide it.
    """
    if use_kernels(t, spec, kernels):
        from . import kernels as kernel_ops

        data, data_t, amax = kernel_ops.cast_amax(t, scale, spec, transpose=transpose, impl=_kernel_impl(kernels))
    else:
        data, amax = quantize_with_scale(t, scale, spec).data, compute_amax(t, TensorWise())
        data_t = quantize_with_scale(t.t(), scale.t(), spec).data if transpose else None
    poisoned = torch.where(torch.isfinite(amax).reshape(1, 1), scale, torch.full_like(scale, float("nan")))
    meta = Fp8Meta(spec, t.dtype, None)
    q_t = Fp8Tensor(data_t, poisoned, meta) if transpose else None
    return Fp8Tensor(data, poisoned, meta), q_t, amax.reshape(1).float()


def given_cast(pair: tuple, spec: CastSpec, dtype: torch.dtype) -> Fp8Tensor:
    """The cast ``(data, scale)`` made elsewhere, as an ``Fp8Tensor`` of ``spec``."""
    # Views, not the inputs themselves: an autograd.Function output that is saved must not be an
    # input returned as it is.
    return Fp8Tensor(pair[0].view_as(pair[0]), pair[1].view_as(pair[1]), Fp8Meta(spec, dtype, None))


def cast_operand(t: torch.Tensor, spec: CastSpec, given: tuple | None, scale: torch.Tensor | None,
                 transpose: bool, p: LinearPlan, fuse_amax: bool = False):
    """(cast, its transposed copy or None, amax recorded or None) of a linear's forward operand
    ``t``: the ``(data, scale)`` pair ``given`` made elsewhere, else a delayed cast with the
    state's ``scale``, else a dynamic one (``fuse_amax``: as ``cast``'s; compiled, x's tensorwise
    amax fuses into the kernel that makes x, while a weight, which the compiled region is given,
    keeps the amax kernel)."""
    if given is not None:
        return given_cast(given, spec, t.dtype), None, None
    if scale is not None:
        return cast_delayed(t, spec, scale, transpose=transpose, kernels=p.kernels)
    q, q_t = cast(t, spec, transpose=transpose, kernels=p.kernels, fuse_amax=fuse_amax)
    return q, q_t, None


def cast_grad_output(dy2: torch.Tensor, given: dict | None, scale: torch.Tensor | None, want_first: bool,
                     want_second: bool, p: LinearPlan):
    """A linear's backward casts of ``dy2 [M, N]``: (dy along N for grad_input, dy.T along M for
    grad_weight, dy's amax or None), from the casts ``given`` (gathered in FP8), else a delayed
    cast with the state's ``scale``, else dynamic ones; each only where wanted."""
    casts = operand(p, "dy")
    if given is not None:
        qdy = given["dy"] if want_first or casts.reuses else None
        second = given.get("dy_t", given["dy"]).t() if want_second else None
        return qdy, second, None
    if not (want_first or want_second):
        return None, None, None
    if scale is not None:
        qdy, qdy_t, amax = cast_delayed(dy2, casts.first, scale, transpose=want_second, kernels=p.kernels)
        return qdy, qdy_t, amax
    if casts.first == casts.second:  # one call, one amax: [M, N] along N and [N, M] along M
        return cast(dy2, casts.first, transpose=want_second, kernels=p.kernels, fuse_amax=True)[:2] + (None,)
    qdy = cast(dy2, casts.first, kernels=p.kernels)[0] if want_first else None
    qdy_t = cast(dy2.t(), casts.second, kernels=p.kernels)[0] if want_second else None
    return qdy, qdy_t, None


def given_leaves(group: dict[str, Fp8Tensor] | None, what: str, p: LinearPlan) -> tuple[tuple, tuple]:
    """(names, flat (data, scale) leaves) of a linear's ``what`` ("weight" / "input") casts made
    elsewhere, checked against the plan's (``weight_casts`` / ``activation_casts``)."""
    if group is None:
        return (), ()
    names = [name for name, _ in (weight_casts(p) if what == "weight" else activation_casts(p))]
    if what == "input" and "x.T" in group and takes_x_copy(p):
        names = ["x", "x.T"]  # input_casts: the forward's cast and its transposed copy
    if sorted(group) != sorted(names):
        raise ValueError(f"linear: plan {p.name!r} needs {what} casts {names}, got {sorted(group)} "
                         "(make them with fp8func.input_casts(x, recipe) for this recipe).")
    return tuple(names), tuple(t for name in names for t in (group[name].data, group[name].scale))


def _transpose_invariant(spec: CastSpec) -> bool:
    """True when quantize(t.T, spec) == quantize(t, spec).T for every 2-D t."""
    g = spec.granularity
    square_blocks = isinstance(g, BlockWise) and len(g.block) == 2 and g.block[0] == g.block[1]
    return isinstance(g, TensorWise) or square_blocks


def weight_casts(recipe: Recipe | LinearPlan | str) -> list[tuple[str, CastSpec]]:
    """The casts of a weight ``w [N, K]`` that a linear layer consumes, as specs on ``[N, K]``.

    ``"w"``: the output GEMM's (contraction K last). ``"w_t"``: the grad_input GEMM's, cast along
    N, present only when the forward's cast cannot be reused for it bitwise. Empty when a GEMM
    that reads the weight runs in high precision (it then needs the weight itself).
    """
    return _casts_of("w", operand(plan(recipe), "w"))


def activation_casts(recipe: Recipe | LinearPlan | str) -> list[tuple[str, CastSpec]]:
    """The casts of an input ``x [M, K]`` that a linear layer consumes, as specs on ``[M, K]``.

    ``"x"``: the output GEMM's (contraction K last). ``"x_t"``: the grad_weight GEMM's, cast
    along M, present only when the forward's cannot be reused for it bitwise. Empty when the
    plan computes grad_weight in high precision (it then needs ``x`` itself).
    """
    return _casts_of("x", operand(plan(recipe), "x"))


def grad_output_casts(recipe: Recipe | LinearPlan | str) -> list[tuple[str, CastSpec]]:
    """The casts of a grad_output ``dy [M, N]`` the backward consumes, as specs on ``[M, N]``.

    ``"dy"``: the grad_input GEMM's (along N); ``"dy_t"``: the grad_weight GEMM's (along M), when
    the first cannot be reused. Empty when a GEMM that reads dy runs in high precision.
    """
    return _casts_of("dy", operand(plan(recipe), "dy"))


def _casts_of(name: str, casts) -> list[tuple[str, CastSpec]]:
    """An operand's first cast, and its transposed-GEMM cast (on the operand's own layout) unless
    the first serves both; none when one of its GEMMs runs in high precision."""
    if casts.first is None or casts.second is None:
        return []
    return [(name, casts.first)] if casts.reuses else [(name, casts.first), (name + "_t", transposed(casts.second))]


def input_casts(x: torch.Tensor, recipe: Recipe | LinearPlan | str, *,
                weight_requires_grad: bool = True) -> dict[str, Fp8Tensor] | None:
    """The casts of ``x [..., K]`` that a linear with ``recipe`` makes of its input, made once so
    that several linears reading ``x`` (an attention block's q, k and v; an MLP's gate and up)
    share them: ``linear(x, w, b, recipe, x_casts=input_casts(x, recipe))`` is bitwise
    ``linear(x, w, b, recipe)``, and ``x`` then only routes the gradient.

    The names are ``activation_casts(recipe)``'s, plus ``"x.T"`` where the fused kernels write the
    forward cast's transposed copy for the grad_weight GEMM in the same pass (as the linear does
    when it casts its input itself; ``weight_requires_grad=False``: no grad_weight, no copy).
    None for a plan whose grad_weight GEMM runs in high precision (it needs ``x`` itself) or
    that scales with a delayed state. The payloads are not differentiable.

    Example:
        >>> h, wq, wk = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32, 64)
        >>> casts = f8.input_casts(h, "tensorwise")
        >>> q, k = (f8.linear(h, w, recipe="tensorwise", x_casts=casts) for w in (wq, wk))
    """
    p = plan(recipe)
    specs = activation_casts(p)
    if not specs or p.delayed is not None:
        return None
    rows = x.detach().reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and weight_requires_grad and _writes_x_copy(x, p):
        # the forward's cast and its transposed copy, from one pass (the second cast is not needed)
        q, q_t = cast(rows, operand(p, "x").first, transpose=True, kernels=p.kernels)
        return {"x": q, "x.T": q_t}
    return {name: cast(rows, spec, kernels=p.kernels)[0] for name, spec in specs}


def takes_x_copy(p: LinearPlan) -> bool:
    """Whether the grad_weight GEMM can read the forward's input cast transposed: its cast is
    the forward's, written on the transposed layout."""
    xs = operand(p, "x")
    return xs.second is not None and xs.second == xs.first


def _writes_x_copy(x: torch.Tensor, p: LinearPlan) -> bool:
    """Whether a cast of the input ``x`` writes that transposed copy in the same pass: the plan
    takes one and the fused kernels cast ``x``."""
    return takes_x_copy(p) and use_kernels(x.reshape(-1, x.shape[-1]) if x.is_contiguous() else x,
                                            operand(p, "x").first, p.kernels)


def forward_transposes(x: torch.Tensor, weight: torch.Tensor, p: LinearPlan, x_given: bool, w_given: bool):
    """(x, w): whether the forward writes the operand's transposed fp8 copy for the backward.

    Only for casts that go through the fused kernels, which write both copies from the same
    pass (or, row-wise, the same two passes) over the operand, and only where the backward GEMM
    reads the copy with the very spec of the forward's cast (written on the transposed layout):
    tensorwise, 128x128 blocks, 1x128 blocks (whose 128x1 grad_weight cast comes from the same
    tiles) and row-wise casts of the input (whose column-wise cast then comes from the same
    amax pass); the input's copy is saved in fp8 instead of the high-precision input (half the
    activation memory). The weight: transpose-invariant casts only, whose fp8 copy the backward
    keeps anyway; a row-wise weight's column-wise copy would be kept from forward to backward
    on top of the weight (one byte per parameter) to save 1-2% of a step, so its backward casts
    the weight itself. The values are the same bits either way.
    """
    if not torch.is_grad_enabled():
        return False, False
    want_x = want_w = False
    ws = operand(p, "w")
    # Given casts (an FP8 sequence-parallel gather, FSDP2's fp8 weight gather) are never read
    # here: those tensors exist only as their casts, and any op on them raises.
    if weight.requires_grad and not x_given:
        want_x = _writes_x_copy(x, p)
    if x.requires_grad and not w_given and ws.reuses and ws.second == ws.first:
        want_w = use_kernels(weight, ws.first, p.kernels)
    return bool(want_x), bool(want_w)
