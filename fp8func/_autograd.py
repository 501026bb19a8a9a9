"""The FP8 linear layer as one differentiable op over a ``LinearPlan``: ``linear``, ``linear_delayed``.

Forward ``y = x @ w.T`` with x and w cast per the plan's output GEMM; backward casts ``dy`` and
computes ``dx = dy @ w`` and ``dw = dy.T @ x``, each operand cast along its own contraction axis
(or in high precision where the plan says so). A cast whose groups are the same seen transposed
(tensorwise, square blocks) is reused by the backward instead of being recomputed: the same
values, bitwise, and half the saved activation memory.

Every recipe runs the same ``autograd.Function``: dynamic and delayed scaling, weight casts made
elsewhere (FSDP2's fp8 all-gather) and input casts gathered in FP8 (sequence parallel). It is
``allow_in_graph``: dynamo records one call and AOTAutograd differentiates it through its own
``backward``, so ``torch.compile`` around ``torch.func.grad`` / ``vjp`` / ``vmap`` runs the FP8
backward, as eager autograd does (tracing into the function instead let dynamo differentiate
the forward's fp8 casts).

Delayed scaling follows flax's "overwrite with gradient": the three casts' states go in as
inputs and the next step's states come back as their *gradients*; the op also returns the states
(as new tensors) to thread into a later use of the same state in the step, whose amaxes merge
by max into one history entry (``fp8func._delayed.record_merged``).

The op's variadic tensor inputs and what its backward keeps of each operand are named in
``fp8func._operands``; its delayed-scaling state is read, passed on and updated by ``fp8func._delayed``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._casts import activation_casts, cast_grad_output, cast_operand, forward_transposes, given_leaves
from ._delayed import LinearScalingState, linear_states, next_linear_states, pack_state, state_inputs, unpack_state
from ._gathered import casts_only, gathered_casts
from ._gemm import gemm
from ._hooks import full_tensor
from ._operands import Kept, Layout, keep, operand_for_backward, read_inputs
from ._plan import LinearPlan, operand, plan, untileable
from ._qtensor import Fp8Tensor
from ._scaling import Recipe
from ._sharding import Sharding

__all__ = ["linear", "linear_delayed", "fp8_linear"]


class _Outputs(NamedTuple):
    """The op's outputs: ``y``; the x and w payloads the backward reads (non-differentiable); with
    delayed scaling, the six state tensors passed on, packed in one vector (differentiable: its
    gradient is the later uses' new states; one output, so one tangent), and the x and w amaxes
    recorded (non-differentiable). The last three are None without a state, and then not outputs
    of the op at all (``flat``)."""

    y: torch.Tensor
    x_data: torch.Tensor
    x_scale: torch.Tensor
    w_data: torch.Tensor
    w_scale: torch.Tensor
    state: torch.Tensor | None = None
    x_amax: torch.Tensor | None = None
    w_amax: torch.Tensor | None = None

    def flat(self) -> tuple:
        """The outputs as ``forward`` returns them: the tensors, in field order."""
        return tuple(t for t in self if t is not None)


class _Saved(NamedTuple):
    """What the backward reads, saved flat (``flat`` / ``of``): what it keeps of x and of w (see
    ``Kept``); with delayed scaling, the x and w amaxes recorded and the state's tensor inputs."""

    x: tuple
    w: tuple
    x_amax: torch.Tensor | None
    w_amax: torch.Tensor | None
    state: tuple

    def flat(self) -> tuple:
        return (*self.x, *self.w, self.x_amax, self.w_amax, *self.state)

    @staticmethod
    def of(flat: tuple) -> _Saved:
        return _Saved(tuple(flat[0:2]), tuple(flat[2:4]), flat[4], flat[5], tuple(flat[6:]))


class _LinearFn(torch.autograd.Function):
    """The FP8 linear: inputs ``(x, weight, bias, plan, layout, *leaves)`` (``Layout``, read by
    ``read_inputs``), outputs ``_Outputs``, saved tensors ``_Saved``."""

    @staticmethod
    def forward(x, weight, bias, p: LinearPlan, layout: Layout, *leaves):
        gw, gx, states, state_in, x_spec = read_inputs(layout, x, leaves)
        xs, ws = operand(p, "x"), operand(p, "w")
        tx, tw = layout.transposes
        x2 = x if gx else x.reshape(-1, x.shape[-1])  # given casts: x only routes the gradient
        x_scale = None if states is None else states.input.scale
        w_scale = states.weight.scale if states is not None and p.delayed.weight else None
        qx, qx_t, x_amax = cast_operand(x2, x_spec or xs.first, gx.get("x"), x_scale, tx, p, fuse_amax=True)
        qw, qw_t, w_amax = cast_operand(weight, ws.first, gw.get("w"), w_scale, tw, p)
        y = gemm(qx, qw.t(), out_dtype=x.dtype, bias=bias, path=p.output.path, fast_accum=p.output.fast_accum)
        qx = qx if qx_t is None else qx_t  # what the backward reads
        qw = qw if qw_t is None else qw_t
        out = _Outputs(y.reshape(*x.shape[:-1], weight.shape[0]), qx.data, qx.scale, qw.data, qw.scale)
        if states is None:
            return out.flat()
        passed = pack_state(state_in, layout.packed_state)
        # the amaxes as outputs of their own (saved for the backward): no kernel to put them together
        w_amax = qx.scale.new_zeros(1) if w_amax is None else w_amax
        return out._replace(state=passed, x_amax=full_tensor(x_amax), w_amax=full_tensor(w_amax)).flat()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, p, layout, *leaves = inputs
        given = read_inputs(layout, x, leaves)
        out = _Outputs(*output)
        recorded = () if out.state is None else (out.x_amax, out.w_amax)
        ctx.mark_non_differentiable(out.x_data, out.x_scale, out.w_data, out.w_scale, *recorded)
        ctx.plan, ctx.layout = p, layout
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_kind, x_kept = keep(operand(p, "x"), p.grad_weight.hp, given.x_given, "x", layout.transposes[0],
                              (out.x_data, out.x_scale), x)
        w_kind, w_kept = keep(operand(p, "w"), p.grad_input.hp, given.w_given, "w", layout.transposes[1],
                              (out.w_data, out.w_scale), weight)
        if x_kind is Kept.MISSING:
            raise ValueError(f"linear: plan {p.name!r} needs the input itself or its 'x_t' cast in the backward.")
        ctx.x_kind, ctx.w_kind, ctx.x_spec = x_kind, w_kind, given.x_spec
        ctx.save_for_backward(*_Saved(x_kept, w_kept, out.x_amax, out.w_amax, given.state_inputs).flat())

    @staticmethod
    def backward(ctx, *grads):
        p: LinearPlan = ctx.plan
        layout: Layout = ctx.layout
        saved, g = _Saved.of(ctx.saved_tensors), _Outputs(*grads)
        states = linear_states(saved.state, layout.packed_state) if layout.delayed else None
        dy2, dy_given = _grad_output(g.y, ctx)
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_scale = None if states is None else states.grad_output.scale
        qdy, qdy_t, dy_amax = cast_grad_output(dy2, dy_given, dy_scale,
                                                need_dx and not p.grad_input.hp, need_dw and not p.grad_weight.hp, p)
        if need_dx:
            if p.grad_input.hp:
                dx = (dy2.to(ctx.x_dtype) @ saved.w[0].to(ctx.x_dtype)).reshape(ctx.x_shape)
            else:
                b = operand_for_backward(ctx.w_kind, saved.w, operand(p, "w"), ctx.w_dtype, qdy)  # [N, K] along N
                dx = gemm(qdy, b, out_dtype=ctx.x_dtype, path=p.grad_input.path,
                          fast_accum=p.grad_input.fast_accum).reshape(ctx.x_shape)
        if need_dw:
            if p.grad_weight.hp:
                x2 = saved.x[0].reshape(-1, saved.x[0].shape[-1])
                dw = dy2.t().to(x2.dtype) @ x2
            else:
                b = operand_for_backward(ctx.x_kind, saved.x, operand(p, "x"), ctx.x_dtype, None,
                                         ctx.x_spec)  # [M, K] along M
                dw = gemm(qdy_t, b, out_dtype=ctx.w_dtype, path=p.grad_weight.path, fast_accum=p.grad_weight.fast_accum)
            dw = dw.to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            if dy_given is not None:
                raise ValueError("fp8func: a grad_output gathered in FP8 cannot give a bias gradient; "
                                 "use the stock RowwiseParallel for layers with a bias.")
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        given = (None,) * layout.n_given
        nexts = () if states is None else next_linear_states(
            saved.state, layout.packed_state, g.state,
            (saved.x_amax, saved.w_amax if p.delayed.weight else None, dy_amax),
            tuple(operand(p, role).first for role in ("x", "w", "dy")), p.delayed.algo, layout.sharding)
        return (dx, dw, db, None, None, *given, *nexts)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, p, layout, *leaves):
        # Per-example semantics: each example gets its own scales (a tensorwise amax over the whole
        # batch would change the numbers), and its own state updates, so the rule maps the function
        # over the batch. Unbatched inputs (a shared weight, a shared state) are read by every example.
        def pick(t, d, i):
            return t if t is None or d is None else t.select(d, i)

        if any(d is not None for d in in_dims[5:5 + layout.n_given]) or (layout.x_inside and in_dims[0] is not None):
            raise ValueError("fp8func.linear: vmap over weight or input casts made elsewhere (FSDP2's fp8 "
                             "all-gather, an FP8 sequence gather) is not supported; vmap over the tensors.")
        tensors = (x, weight, bias, *leaves)
        dims = (*in_dims[:3], *in_dims[5:])
        outs = [_LinearFn.apply(*(pick(t, d, i) for t, d in zip(tensors[:3], dims[:3])), p, layout,
                                *(pick(t, d, i) for t, d in zip(tensors[3:], dims[3:])))
                for i in range(info.batch_size)]
        stacked = tuple(torch.stack(parts) for parts in zip(*outs))
        return stacked, (0,) * len(stacked)


def _grad_output(dy, ctx) -> tuple[torch.Tensor, dict | None]:
    """(dy as [M, N], its casts when it arrives gathered in FP8 by a sequence-parallel layer)."""
    dy_given = gathered_casts(dy)
    if dy_given is not None and ctx.layout.delayed:
        raise ValueError("fp8func: delayed scaling casts the grad_output itself; use the stock TP styles.")
    return (dy.reshape(-1, dy.shape[-1]) if dy_given is None else dy), dy_given


torch._dynamo.allow_in_graph(_LinearFn)


def _check_args(x, weight, bias, p: LinearPlan) -> None:
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; expected "
            "x [..., K] and weight [N, K]."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},).")
    m, k, n = x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0]
    why = untileable(p, m, k, n)
    if why:
        raise ValueError(f"linear with plan {p.name!r} on M={m}, K={k}, N={n}: {why}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe, *,
               state: LinearScalingState | torch.Tensor | None = None, w_casts: dict[str, Fp8Tensor] | None = None,
               x_casts: dict[str, Fp8Tensor] | None = None,
               amax_sharding: Sharding | None = None, packed: bool = False):
    """The one FP8 linear op every entry point calls: ``(y, state passed on)``.

    ``w_casts`` / ``x_casts``: the weight's / input's casts made elsewhere (named as
    ``weight_casts(plan)`` / ``activation_casts(plan)``); the tensor then only routes the
    gradient; an ``x`` that exists only as its casts (an FP8 sequence gather) gives them itself,
    read inside the op. ``state``: the delayed-scaling state (a delayed plan needs one, a dynamic one none):
    a ``LinearScalingState``, or its six tensors packed in one float32 ``[3 * (L + 1)]`` (rows
    (history, scale) of x, w, dy: ``torch.cat`` of ``state.tensors()`` flattened), whose gradient is
    then the packed next state (one tensor for autograd to accumulate instead of six).
    ``packed``: the state passed on as the one flat tensor the op returns (``unpack_state``
    makes it a ``LinearScalingState``), which a compiled caller hands on without six views; always
    so for a packed ``state``.
    """
    p = plan(recipe)
    _check_args(x, weight, bias, p)
    x_inside = x_casts is None and casts_only(x)
    if (p.delayed is None) != (state is None):
        raise ValueError(f"linear: plan {p.name!r} " + (
            "scales dynamically; drop the state or use a delayed recipe." if p.delayed is None else
            "uses delayed scaling and needs state=LinearScalingState (fp8func.linear_delayed)."))
    if p.delayed is not None and (x_casts is not None or x_inside or (w_casts is not None and p.delayed.weight)):
        raise ValueError("fp8func: delayed scaling casts the input (and, unless DelayedScaling(weight=False), the "
                         "weight) itself; use the stock TP styles, and fsdp_fp8_all_gather=False or "
                         "DelayedScaling(weight=False) with a delayed recipe.")
    w_names, w_leaves = given_leaves(w_casts, "weight", p)
    x_names, x_leaves = given_leaves(x_casts, "input", p)
    if x_inside:
        x_names = tuple(name for name, _ in activation_casts(p))
    states, packed_len = ((), 0) if state is None else state_inputs(state, x, weight)
    layout = Layout(w_names, x_names, state is not None, packed_len,
                    forward_transposes(x, weight, p, bool(x_names), bool(w_names)),
                    amax_sharding if state is not None else None, x_inside)
    out = _Outputs(*_LinearFn.apply(x, weight, bias, p, layout, *w_leaves, *x_leaves, *states))
    if state is None:
        return out.y, None
    return out.y, out.state if packed or packed_len else unpack_state(out.state, state)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: Recipe | LinearPlan | str = "tensorwise",
    *,
    state: LinearScalingState | None = None,
    x_casts: dict[str, Fp8Tensor] | None = None,
) -> torch.Tensor:
    """FP8 drop-in for ``torch.nn.functional.linear``: ``x @ weight.T + bias``, differentiable.

    Works under ``torch.func.grad`` / ``vjp`` / ``vmap`` / ``functional_call``,
    ``torch.compile(fullgraph=True)`` and their compositions. Always returns a tensor; delayed
    scaling, which threads a state, is ``linear_delayed``.

    Args:
        x: ``[..., K]`` activations (bf16 or fp32); the output has ``x``'s dtype.
        weight: ``[N, K]``; its gradient comes back in its own dtype (fp32 master weights stay fp32).
        bias: optional ``[N]``, added in the output dtype.
        recipe: a ``Recipe``, a recipe name (``Recipe.from_name``) or a per-GEMM ``LinearPlan``.
        x_casts: ``input_casts(x, recipe)``, made once for several linears that read ``x``; the
            result is bitwise the same as without, and ``x`` then only routes the gradient.

    Example:
        >>> import torch, fp8func as f8
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> w = torch.randn(32, 64, requires_grad=True)
        >>> f8.linear(x, w, recipe="rowwise").sum().backward()
    """
    p = plan(recipe)
    if state is not None or p.delayed is not None:
        raise TypeError(f"linear: plan {p.name!r} with state={'given' if state is not None else None}: linear returns "
                        "a tensor and scales dynamically; for delayed scaling call "
                        "fp8func.linear_delayed(x, weight, bias, recipe, state) -> (y, state).")
    return fp8_linear(x, weight, bias, p, x_casts=x_casts)[0]


def linear_delayed(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe | LinearPlan | str,
    state: LinearScalingState,
    *,
    amax_sharding: Sharding | None = None,
) -> tuple[torch.Tensor, LinearScalingState]:
    """``linear`` with delayed scaling: casts with scales from earlier steps; ``(y, state)``.

    The next step's state is the **gradient** of ``state`` (flax's "overwrite with gradient"):
    take ``torch.func.grad`` over it, or make its tensors require grad and read their ``.grad``;
    the returned ``state`` carries the same values, to thread into a later use of this state in
    the same step (their amaxes merge into one history entry, by max). Reusing an input state
    that a call already consumed raises. ``fp8func.nn.Fp8Linear`` and ``fp8func.nn.apply`` do this
    for a whole model.

    Args:
        amax_sharding: how ``x``'s (and ``dy``'s) rows are split across ranks, e.g. the
            data-parallel ranks ``Sharding(dp_mesh, (Shard(0),))``: the recorded amaxes are then
            reduced over them, so every rank keeps the same state.

    Example:
        >>> import torch, fp8func as f8
        >>> x, w = torch.randn(8, 64), torch.randn(32, 64, requires_grad=True)
        >>> state = f8.LinearScalingState.init(16).requires_grad_()
        >>> y, _ = f8.linear_delayed(x, w, None, "delayed", state)
        >>> next_state = torch.autograd.grad(y.sum(), list(state.tensors()))
    """
    p = plan(recipe)
    if p.delayed is None:
        raise ValueError(f"linear_delayed: plan {p.name!r} scales dynamically; use fp8func.linear, or a delayed "
                         "recipe such as 'delayed'.")
    return fp8_linear(x, weight, bias, p, state=state, amax_sharding=amax_sharding)


def linear_with_casts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe,
                      casts: dict[str, Fp8Tensor] | None, x_casts: dict[str, Fp8Tensor] | None = None) -> torch.Tensor:
    """``linear`` with the weight's (and input's) casts made elsewhere; see ``fp8_linear``.
    Bitwise the same as ``linear(x, w_hp, ...)`` when the casts are ``quantize(w_hp, spec)`` for
    the specs of ``weight_casts(plan)``."""
    return fp8_linear(x, weight, bias, recipe, w_casts=casts, x_casts=x_casts)[0]
