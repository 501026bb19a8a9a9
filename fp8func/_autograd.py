"""``linear``: the FP8 linear layer as a pure, differentiable function.

Forward ``y = x @ w.T`` with x and w quantized per ``recipe.input`` / ``recipe.weight``;
backward quantizes ``dy`` per ``recipe.grad_output`` and computes ``dx = dy @ w`` and
``dw = dy.T @ x``, each operand cast along its own contraction axis. A cast whose granularity
is symmetric under transposition (tensorwise, square blocks) is reused by the backward instead
of being recomputed: the same values, bitwise, and half the saved activation memory.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ._delayed import LinearScalingState, ScalingState, cast_scale, next_state, quantize_delayed
from ._gathered import gathered_casts
from ._gemm import gemm
from ._ops import quantize, quantize_with_scale
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import (AxisWise, BlockWise, CastSpec, Recipe, TensorWise, block_lengths, compute_amax, compute_scale,
                       raw_block_lengths, scale_shape, transpose_granularity)
from ._sharding import Sharding, reduce_amax

__all__ = ["linear"]

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


def _use_kernels(t: torch.Tensor, spec: CastSpec) -> bool:
    return _has_kernel(spec.granularity) and _kernel_tensor(t)


def _amax(t: torch.Tensor, granularity) -> torch.Tensor:
    """``compute_amax(t, granularity)``, by the amax kernel where one applies (tensorwise, per
    row or per column of a contiguous 2-D bf16 / fp32 tensor): the same bits."""
    rows_or_cols = isinstance(granularity, AxisWise) and granularity.axis in (-2, -1, 0, 1)
    if (isinstance(granularity, TensorWise) or rows_or_cols) and _kernel_tensor(t):
        from . import kernels

        return kernels.amax(t, granularity, impl="reference" if KERNELS == "reference" else "auto")
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

        impl = "reference" if KERNELS == "reference" else "auto"
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

        data, _ = kernels.cast(t, scale, spec, impl="reference" if KERNELS == "reference" else "auto")
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


def _cast_b(t: torch.Tensor, spec: CastSpec) -> Fp8Tensor:
    """The GEMM's b operand ``t [K, N]`` cast along its contraction axis K.

    Quantizes ``t.T [N, K]`` (contraction last, as every Recipe spec is written) and transposes
    back: a column-major ``[K, N]`` payload, which is what scaled_mm wants for b anyway.
    """
    return quantize(t.t(), spec).t()


@torch.library.custom_op("fp8func::read_in_backward", mutates_args=())
def _read_in_backward(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A copy of the 2-D ``t`` made once ``grad`` exists: in the backward, never hoisted into the
    forward. Column-major, the layout in which the grad_input GEMM reads it as ``b`` (scaled_mm
    would copy a row-major one again)."""
    return t.t().contiguous().t()


@_read_in_backward.register_fake
def _(t, grad):
    return t.new_empty_strided(tuple(t.shape), (1, t.shape[0]))


def _given_in_backward(t: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
    """A weight cast FSDP2 fills only before the backward (row-wise ``w_t`` under
    ``reshard_after_forward``: the forward's all-gather carried ``w``; FSDP2 refills the buffer,
    which the autograd context holds, in its pre-backward hook), read no earlier than that.

    Eager, the backward reads the saved tensor when it runs, after the refill. Compiled,
    AOTAutograd's partitioner may compute an op that depends only on forward inputs in the
    forward graph and save its result (nothing in the graph says the buffer changes in between);
    it then read the forward's ``w`` bytes with ``w_t``'s scales (two H200s, torch 2.11: every
    gradient below the first row-wise layer differed from fsdp fp8 all-gather off). An opaque op
    that also takes something of the gradient cannot run before the gradient exists. It takes the
    grad_output cast's scale, an fp32 tensor the GEMM reads anyway: given ``dy`` itself, the
    compiled CPU run's bits changed (likely inductor then stored the bf16 ``dy`` that it otherwise
    fuses unrounded into the cast).
    """
    if not torch.compiler.is_compiling():
        return t
    from torch.distributed.tensor import DTensor

    dep = grad_scale.to_local() if isinstance(grad_scale, DTensor) else grad_scale
    if isinstance(t, DTensor):
        # shape and stride given: computing them is a graph break (torch._C's global tensor info)
        return DTensor.from_local(_read_in_backward(t.to_local(), dep), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=(1, t.shape[0]))
    return _read_in_backward(t, dep)


def _for_backward(reuse: bool, own: tuple, given_t: tuple, hp: torch.Tensor) -> tuple:
    """What the backward needs of one operand: the forward's cast when it can be reused, else
    the transposed cast made elsewhere, else the high-precision tensor (saved twice: two slots)."""
    if reuse:
        return own
    if given_t[0] is not None:
        return given_t
    return hp, hp


class _LinearFn(torch.autograd.Function):
    # Outputs: y, then the payloads that the backward reuses (non-differentiable).

    # ``casts``: None (cast ``weight`` here), or the weight's casts made elsewhere (FSDP2's fp8
    # all-gather) as (w_data, w_scale, w_t_data, w_t_scale), see ``weight_casts``.

    # ``x_data`` ...: the same for the input (a sequence-parallel fp8 all-gather), see
    # ``activation_casts``; ``x`` then only routes the gradient and is not read.

    @staticmethod
    def forward(x, weight, bias, recipe: Recipe, w_data, w_scale, wt_data, wt_scale,
                x_data=None, x_scale=None, xt_data=None, xt_scale=None, transposes=(False, False)):
        # ``transposes`` (for x, for w): also write the operand's fp8 copy transposed, in the same
        # pass as its forward cast, for the backward GEMM that contracts over its other axis (see
        # ``_forward_transposes``). The backward then reads it as the column-major operand
        # scaled_mm wants, instead of transposing fp8 bytes itself.
        x_t = w_t = None
        if x_data is None:
            qx, x_t = _cast(x.reshape(-1, x.shape[-1]), recipe.input, transpose=transposes[0])
        else:
            qx = Fp8Tensor(x_data.view_as(x_data), x_scale.view_as(x_scale), Fp8Meta(recipe.input, x.dtype, None))
        if w_data is None:
            qw, w_t = _cast(weight, recipe.weight, transpose=transposes[1])  # [N, K], contraction last
        else:
            # Views, not the inputs themselves: autograd.Function outputs that are saved must not
            # be inputs returned as they are.
            qw = Fp8Tensor(w_data.view_as(w_data), w_scale.view_as(w_scale), Fp8Meta(recipe.weight, weight.dtype, None))
        y = gemm(qx, qw.t(), out_dtype=x.dtype, bias=bias, path=recipe.path, fast_accum="output" in recipe.fast_accum)
        qx = qx if x_t is None else x_t  # what the backward reads
        qw = qw if w_t is None else w_t
        return y.reshape(*x.shape[:-1], weight.shape[0]), qx.data, qx.scale, qw.data, qw.scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, recipe, _, _, wt_data, wt_scale, x_data, _, xt_data, xt_scale, transposes = (
            inputs + (None,) * 8 + ((False, False),))[:13]
        _, qx_data, qx_scale, qw_data, qw_scale = output
        ctx.mark_non_differentiable(qx_data, qx_scale, qw_data, qw_scale)
        ctx.recipe = recipe
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.reuse_x = not recipe.grad_weight_hp and _transpose_invariant(recipe.input)
        ctx.reuse_w = recipe.grad_input_weight is None and _transpose_invariant(recipe.weight)
        # The saved fp8 copy is the transposed one ([K, M] / [K, N], row-major) when the forward made
        # it (``_forward_transposes`` asks for it only where the backward reads it that way).
        ctx.x_saved_t, ctx.w_saved_t = transposes
        ctx.given_wt = wt_data is not None
        ctx.given_xt = xt_data is not None
        if x_data is not None and not (ctx.reuse_x or ctx.given_xt):
            raise ValueError(f"linear: recipe {recipe.name!r} needs the input itself or its 'x_t' cast in the backward.")
        ctx.save_for_backward(*_for_backward(ctx.reuse_x or ctx.x_saved_t, (qx_data, qx_scale), (xt_data, xt_scale), x),
                              *_for_backward(ctx.reuse_w or ctx.w_saved_t, (qw_data, qw_scale), (wt_data, wt_scale),
                                             weight))

    @staticmethod
    def backward(ctx, dy, *_unused):
        recipe: Recipe = ctx.recipe
        x_a, x_b, w_a, w_b = ctx.saved_tensors
        n = dy.shape[-1]
        dy_casts = gathered_casts(dy)  # a grad_output gathered in FP8 (sequence-parallel output)
        if dy_casts is None:
            dy2 = dy.reshape(-1, n)
        elif ctx.has_bias and ctx.needs_input_grad[2]:
            raise ValueError("fp8func: a grad_output gathered in FP8 cannot give a bias gradient; "
                             "use the stock RowwiseParallel for layers with a bias.")
        dx = dw = db = None
        fp8_dw = ctx.needs_input_grad[1] and not recipe.grad_weight_hp
        if dy_casts is None and (ctx.needs_input_grad[0] or fp8_dw):
            # [M, N] along N for grad_input, and [N, M] along M for grad_weight: one call, one amax
            qdy, qdy_t = _cast(dy2, recipe.grad_output, transpose=fp8_dw)
        if ctx.needs_input_grad[0]:
            qdy = dy_casts["dy"] if dy_casts else qdy
            if ctx.w_saved_t:
                b = Fp8Tensor(w_a, w_b, Fp8Meta(recipe.weight, ctx.w_dtype, None)).t()  # [N, K], column-major
            elif ctx.reuse_w:
                b = Fp8Tensor(w_a, w_b, Fp8Meta(recipe.weight, ctx.w_dtype, None))  # [N, K]
            elif ctx.given_wt:
                b = Fp8Tensor(_given_in_backward(w_a, qdy.scale), w_b,
                              Fp8Meta(weight_casts(recipe)[1][1], ctx.w_dtype, None))
            else:
                b = _cast_b(w_a, recipe.weight_for_grad_input)  # [N, K] along N
            dx = gemm(qdy, b, out_dtype=ctx.x_dtype, path=recipe.path,
                      fast_accum="grad_input" in recipe.fast_accum).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if recipe.grad_weight_hp:
                x2 = x_a.reshape(-1, x_a.shape[-1])
                dw = dy2.t().to(x2.dtype) @ x2
            else:
                if dy_casts is not None:
                    qdy_t = dy_casts.get("dy_t", dy_casts["dy"]).t()
                if ctx.x_saved_t:
                    b = Fp8Tensor(x_a, x_b, Fp8Meta(recipe.input, ctx.x_dtype, None)).t()  # [M, K], column-major
                elif ctx.reuse_x:
                    b = Fp8Tensor(x_a, x_b, Fp8Meta(recipe.input, ctx.x_dtype, None))
                elif ctx.given_xt:
                    b = Fp8Tensor(x_a, x_b, Fp8Meta(activation_casts(recipe)[1][1], ctx.x_dtype, None))
                else:
                    b = _cast_b(x_a.reshape(-1, x_a.shape[-1]), recipe.input)  # [M, K] along M
                dw = gemm(qdy_t, b, out_dtype=ctx.w_dtype, path=recipe.path, fast_accum="grad_weight" in recipe.fast_accum)
            dw = dw.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, recipe, *casts):
        # Per-example semantics: each example gets its own scales (a tensorwise amax over the
        # whole batch would change the numbers), so the rule maps the function over the batch.
        def pick(t, d, i):
            return t if t is None or d is None else t.select(d, i)

        dims = in_dims[:3]
        if any(d is not None for d in torch.utils._pytree.tree_leaves(in_dims[4:])):
            raise ValueError("fp8func.linear: vmap over pre-gathered weight casts is not supported.")
        outs = [
            _LinearFn.apply(*(pick(t, d, i) for t, d in zip((x, weight, bias), dims)), recipe, *casts)
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(parts) for parts in zip(*outs))
        return stacked, (0,) * len(stacked)


def _cast_delayed(t: torch.Tensor, spec: CastSpec, state: ScalingState, algo: str, sharding: Sharding | None = None,
                  transpose: bool = False) -> tuple[Fp8Tensor, Fp8Tensor | None, ScalingState]:
    """``quantize(t, spec, state=state, algo=algo, sharding=sharding)`` and, with ``transpose``,
    ``t.T`` cast with the same scale (a row-major ``[K, M]`` payload): ``(q, q_t, new_state)``.

    By the one-pass kernel where it applies (``kernels.cast_amax``: the cast, its transposed copy
    and the amax the next scale is made from, from one read of ``t``); else by ``quantize``,
    which inductor compiles as an amax and a cast. The same bits either way."""
    if _use_kernels(t, spec):
        from . import kernels

        scale = cast_scale(state)
        data, data_t, amax = kernels.cast_amax(t, scale, spec, transpose=transpose,
                                               impl="reference" if KERNELS == "reference" else "auto")
        q = Fp8Tensor(data, scale, Fp8Meta(spec, t.dtype, sharding))
        q_t = Fp8Tensor(data_t, scale, Fp8Meta(spec, t.dtype, None)) if transpose else None
        return q, q_t, next_state(state, amax, spec, algo, sharding, tuple(t.shape))
    q, new_state = quantize_delayed(t, spec, state, sharding=sharding, algo=algo)
    return q, (quantize_with_scale(t.t(), q.scale.t(), spec) if transpose else None), new_state


class _DelayedLinearFn(torch.autograd.Function):
    """The tensorwise linear with delayed scaling: the input and weight states are updated in the
    forward (returned as outputs), the grad_output state in the backward, returned as the
    *gradient* of the grad_output state inputs ("overwrite with gradient", as flax's fp8_ops), so
    ``torch.func.grad`` / ``vjp`` hand it back and ``.grad`` carries it in eager autograd.

    ``transposes`` as ``_LinearFn``'s: the forward writes x's and w's transposed fp8 copies for
    the backward from the same pass as their casts (tensorwise: the same scale)."""

    # ``w_data, w_scale``: the weight's dynamic cast made elsewhere (FSDP2's fp8 all-gather), for
    # ``DelayedScaling(weight=False)``; ``weight`` then only routes the gradient. That recipe casts
    # the weight dynamically here too, and returns no weight state (two outputs fewer: the
    # caller keeps its own).

    @staticmethod
    def forward(x, weight, bias, recipe: Recipe, sharding, x_hist, x_scale, w_hist, w_scale, dy_hist, dy_scale,
                transposes=(False, False), w_data=None, w_cast_scale=None):
        algo = recipe.delayed.algo
        qx, qx_t, sx = _cast_delayed(x.reshape(-1, x.shape[-1]), recipe.input, ScalingState(x_hist, x_scale), algo,
                                     sharding, transposes[0])
        if recipe.delayed.weight:
            qw, qw_t, sw = _cast_delayed(weight, recipe.weight, ScalingState(w_hist, w_scale), algo, None, transposes[1])
            w_state = (sw.amax_history, sw.scale)
        elif w_data is None:
            qw, qw_t = _cast(weight, recipe.weight, transpose=transposes[1])
            w_state = ()
        else:  # views: a saved output must not be an input returned as it is
            qw = Fp8Tensor(w_data.view_as(w_data), w_cast_scale.view_as(w_cast_scale),
                           Fp8Meta(recipe.weight, weight.dtype, None))
            qw_t, w_state = None, ()
        y = gemm(qx, qw.t(), out_dtype=x.dtype, bias=bias, path=recipe.path, fast_accum="output" in recipe.fast_accum)
        qx = qx if qx_t is None else qx_t  # what the backward reads
        qw = qw if qw_t is None else qw_t
        return (y.reshape(*x.shape[:-1], weight.shape[0]), qx.data, qx.scale, qw.data, qw.scale,
                sx.amax_history, sx.scale, *w_state)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, recipe, sharding, *_, dy_hist, dy_scale = inputs[:11]
        _, qx_data, qx_scale, qw_data, qw_scale, *states = output
        ctx.mark_non_differentiable(qx_data, qx_scale, qw_data, qw_scale, *states)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, x.shape, x.dtype, weight.dtype
        ctx.sharding = sharding
        ctx.x_saved_t, ctx.w_saved_t = inputs[11] if len(inputs) > 11 else (False, False)
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        ctx.save_for_backward(qx_data, qx_scale, qw_data, qw_scale, dy_hist, dy_scale)

    @staticmethod
    def backward(ctx, dy, *_unused):
        recipe: Recipe = ctx.recipe
        qx_data, qx_scale, qw_data, qw_scale, dy_hist, dy_scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        # [M, N] for grad_input and, for grad_weight, [N, M] from the same pass over dy where the
        # kernel runs (elsewhere the GEMM takes dy's cast transposed, as it always did)
        transpose = ctx.needs_input_grad[1] and _use_kernels(dy2, recipe.grad_output)
        qdy, qdy_t, sdy = _cast_delayed(dy2, recipe.grad_output, ScalingState(dy_hist, dy_scale), recipe.delayed.algo,
                                        ctx.sharding, transpose=transpose)
        qx = Fp8Tensor(qx_data, qx_scale, Fp8Meta(recipe.input, ctx.x_dtype, None))
        qw = Fp8Tensor(qw_data, qw_scale, Fp8Meta(recipe.weight, ctx.w_dtype, None))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            b = qw.t() if ctx.w_saved_t else qw  # [N, K]; column-major where the forward wrote w.T
            dx = gemm(qdy, b, out_dtype=ctx.x_dtype, path=recipe.path,
                      fast_accum="grad_input" in recipe.fast_accum).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            b = qx.t() if ctx.x_saved_t else qx  # [M, K]; column-major where the forward wrote x.T
            dw = gemm(qdy.t() if qdy_t is None else qdy_t, b, out_dtype=ctx.w_dtype, path=recipe.path,
                      fast_accum="grad_weight" in recipe.fast_accum).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, sdy.amax_history, sdy.scale, None, None, None


def linear_delayed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, state: LinearScalingState,
    amax_sharding=None, casts: dict[str, Fp8Tensor] | None = None,
) -> tuple[torch.Tensor, LinearScalingState]:
    """``linear`` with delayed scaling: ``(y, new_state)``; see ``linear``.

    ``amax_sharding``: how ``x``'s (and ``dy``'s) rows are split across ranks, e.g. the
    data-parallel ranks ``Sharding(dp_mesh, (Shard(0),))``: the recorded amaxes are then reduced
    over them, so every rank keeps the same state.

    ``casts``: with ``DelayedScaling(weight=False)``, the weight's dynamic cast made elsewhere
    (``{"w": Fp8Tensor}``, e.g. gathered in FP8 by FSDP2), as ``linear_with_casts`` takes it;
    ``new_state.weight`` is then ``state.weight``, unchanged, as for every call of that recipe.
    """
    if not isinstance(state, LinearScalingState):
        raise TypeError(f"linear(recipe={recipe.name!r}) needs state=LinearScalingState (delayed scaling), got "
                        f"{type(state).__name__}; make one with fp8func.LinearScalingState.init(history_len).")
    given = ()
    if casts is not None:
        if recipe.delayed.weight:
            raise ValueError(f"linear: recipe {recipe.name!r} delays the weight's scale too, so it casts the weight "
                             "itself; given weight casts need DelayedScaling(weight=False) (a dynamic weight cast).")
        names = [name for name, _ in weight_casts(recipe)]
        if sorted(casts) != names:
            raise ValueError(f"linear: recipe {recipe.name!r} needs weight casts {names}, got {sorted(casts)}.")
        given = (casts["w"].data, casts["w"].scale)
    transposes = _forward_transposes(x, weight, recipe, False, casts is not None)
    out = _DelayedLinearFn.apply(x, weight, bias, recipe, amax_sharding, *state.input, *state.weight,
                                 *state.grad_output, transposes, *given)
    if recipe.delayed.weight:
        y, *_, xh, xs, wh, ws = out
        w_state = ScalingState(wh, ws)
    else:
        y, *_, xh, xs = out
        w_state = state.weight
    return y, LinearScalingState(ScalingState(xh, xs), w_state, state.grad_output)


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


def _check_gemm_shapes(recipe: Recipe, m: int, k: int, n: int) -> None:
    """Fails in the forward, not halfway through the backward, if a cast cannot tile an operand."""
    operands = [(recipe.input, (m, k), "input x"), (recipe.weight, (n, k), "weight w"),
                (recipe.weight_for_grad_input, (k, n), "weight w.T (grad_input GEMM)"),
                (recipe.grad_output, (m, n), "grad_output dy")]
    if not recipe.grad_weight_hp:
        operands += [(recipe.grad_output, (n, m), "grad_output dy.T (grad_weight GEMM)"),
                     (recipe.input, (k, m), "input x.T (grad_weight GEMM)")]
    for spec, shape, role in operands:
        try:
            block_lengths(spec.granularity, shape)
        except ValueError as e:
            raise ValueError(
                f"linear with recipe {recipe.name!r} on M={m}, K={k}, N={n}: the {role} cast "
                f"cannot tile its operand. {e}"
            ) from None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: Recipe | str = "tensorwise",
    *,
    state: LinearScalingState | None = None,
):
    """FP8 drop-in for ``torch.nn.functional.linear``: ``x @ weight.T + bias``, differentiable.

    Works under ``torch.func.grad`` / ``vjp`` / ``vmap`` / ``functional_call`` and
    ``torch.compile(fullgraph=True)``.

    Delayed scaling (a recipe with ``delayed``, e.g. ``"delayed"``): pass ``state`` (a
    ``LinearScalingState``) and get ``(y, new_state)``. ``new_state`` holds the updated input and
    weight states; the grad_output state is updated in the backward and comes back as the
    gradient of ``state.grad_output`` (``torch.func.grad(..., argnums=...)`` over the state, or
    ``.grad`` of its tensors when they require grad): take it with ``new_state._replace(
    grad_output=state_grads.grad_output)``. ``fp8func.nn.Fp8Linear`` does this for you.

    Args:
        x: ``[..., K]`` activations (bf16 or fp32); the output has ``x``'s dtype.
        weight: ``[N, K]``; its gradient comes back in its own dtype (fp32 master weights stay fp32).
        bias: optional ``[N]``, added in the output dtype.
        recipe: a ``Recipe`` or a recipe name (``Recipe.from_name``).

    Example:
        >>> import torch, fp8func as f8
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> w = torch.randn(32, 64, requires_grad=True)
        >>> f8.linear(x, w, recipe="rowwise").sum().backward()
    """
    if isinstance(recipe, str):
        recipe = Recipe.from_name(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"linear: recipe={recipe!r}; expected a Recipe or a recipe name such as 'tensorwise'.")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; expected "
            "x [..., K] and weight [N, K]."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},).")
    _check_gemm_shapes(recipe, x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0])
    if recipe.delayed is not None:
        return linear_delayed(x, weight, bias, recipe, state)
    if state is not None:
        raise ValueError(f"linear: state= is for delayed scaling, but recipe {recipe.name!r} scales dynamically; "
                         "use recipe='delayed' or drop the state.")
    transposes = _forward_transposes(x, weight, recipe, False, False)
    return _LinearFn.apply(x, weight, bias, recipe, None, None, None, None, None, None, None, None, transposes)[0]


def linear_with_casts(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    casts: dict[str, Fp8Tensor] | None,
    x_casts: dict[str, Fp8Tensor] | None = None,
) -> torch.Tensor:
    """``linear`` with the weight's casts made elsewhere (e.g. gathered in FP8 by FSDP2).

    ``casts`` maps the names of ``weight_casts(recipe)`` to ``Fp8Tensor``s of shape ``[N, K]``;
    ``weight`` only routes the gradient (its values are not read). Bitwise the same as
    ``linear(x, w_hp, ...)`` when the casts are ``quantize(w_hp, spec)`` for those specs.
    """
    for given, wanted in ((casts, weight_casts(recipe)), (x_casts, activation_casts(recipe))):
        names = [name for name, _ in wanted]
        if given is not None and sorted(given) != sorted(names):
            raise ValueError(f"linear_with_casts: recipe {recipe.name!r} needs casts {names}, got {sorted(given)}.")
    _check_gemm_shapes(recipe, x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0])

    def leaves(group: dict[str, Fp8Tensor] | None, first: str, second: str) -> list:
        if group is None:
            return [None] * 4
        a, b = group[first], group.get(second)
        return [a.data, a.scale, None if b is None else b.data, None if b is None else b.scale]

    transposes = _forward_transposes(x, weight, recipe, x_casts is not None, casts is not None)
    return _LinearFn.apply(x, weight, bias, recipe, *leaves(casts, "w", "w_t"), *leaves(x_casts, "x", "x_t"),
                           transposes)[0]
