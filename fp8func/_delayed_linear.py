"""``linear`` with delayed scaling: the tensorwise linear whose casts use scales from earlier steps.

The input and weight states are updated in the forward, the grad_output state in the backward
(returned as the gradient of its state inputs: see ``fp8func._delayed`` and docs/delayed.md).
On CUDA each cast is one pass of ``kernels.cast_amax`` (the cast, its transposed copy and the
amax recorded for the next step).
"""

from __future__ import annotations

import torch

from ._casts import _cast, _forward_transposes, _kernel_impl, _use_kernels, weight_casts
from ._delayed import LinearScalingState, ScalingState, cast_scale, next_state, quantize_delayed
from ._gemm import gemm
from ._ops import quantize_with_scale
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import CastSpec, Recipe
from ._sharding import Sharding

__all__ = ["linear_delayed"]


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
        data, data_t, amax = kernels.cast_amax(t, scale, spec, transpose=transpose, impl=_kernel_impl())
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
            qw, qw_t, sw = _cast_delayed(weight, recipe.weight, ScalingState(w_hist, w_scale), algo, None,
                                         transposes[1])
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
