"""``linear``: the FP8 linear layer as a pure, differentiable function.

Forward ``y = x @ w.T`` with x and w quantized per ``recipe.input`` / ``recipe.weight``;
backward quantizes ``dy`` per ``recipe.grad_output`` and computes ``dx = dy @ w`` and
``dw = dy.T @ x``, each operand cast along its own contraction axis. A cast whose granularity
is symmetric under transposition (tensorwise, square blocks) is reused by the backward instead
of being recomputed: the same values, bitwise, and half the saved activation memory.
"""

from __future__ import annotations

import torch

from ._casts import _cast, _forward_transposes, _transpose_invariant, activation_casts, weight_casts
from ._delayed import LinearScalingState
from ._delayed_linear import linear_delayed
from ._gathered import gathered_casts
from ._gemm import gemm
from ._ops import quantize
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import CastSpec, Recipe, block_lengths

__all__ = ["linear"]


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
