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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._casts import activation_casts, cast, cast_delayed, forward_transposes, takes_x_copy, weight_casts
from ._delayed import LinearScalingState, ScalingState, consume, record_merged, record_merged_packed
from ._gathered import casts_only, gathered_casts
from ._gemm import gemm
from ._hooks import full_tensor, is_distributed, read_given
from ._plan import LinearPlan, operand, plan, transposed, untileable
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import CastSpec, Recipe, TensorWise
from ._sharding import Sharding, reduce_amax

__all__ = ["linear", "linear_delayed", "fp8_linear"]


@dataclass(frozen=True)
class _Layout:
    """Static description of the op's tensor inputs after (x, weight, bias), in order: each given
    weight cast's (data, scale), each given input cast's, then the delayed-scaling state: six
    tensors, or one packed (``packed_state``)."""

    w_given: tuple[str, ...] = ()
    x_given: tuple[str, ...] = ()
    delayed: bool = False
    packed_state: int = 0  # delayed: L where the state is one packed [3 * (L + 1)] tensor, 0 for six tensors
    transposes: tuple[bool, bool] = (False, False)  # the forward writes x's / w's transposed fp8 copy
    sharding: Sharding | None = None  # delayed: how x's and dy's rows are split over ranks
    x_inside: bool = False  # x exists only as its casts (x_given), read from x itself inside the op

    @property
    def n_given(self) -> int:
        """How many tensor inputs the given casts take: a (data, scale) pair each, none for x's
        casts read from x itself."""
        return 2 * (len(self.w_given) + (0 if self.x_inside else len(self.x_given)))

    @property
    def n_state(self) -> int:
        """How many tensor inputs the delayed-scaling state takes: six, one packed, or none."""
        return 0 if not self.delayed else 1 if self.packed_state else 6


def _unpack(layout: _Layout, x, leaves) -> tuple[dict, dict, tuple | None]:
    it = iter(leaves)
    w = {name: (next(it), next(it)) for name in layout.w_given}
    if layout.x_inside:
        # A casts-only input made inside a compiled region (a sequence gather): dynamo cannot read
        # its casts, AOTAutograd, tracing this op, can.
        casts = gathered_casts(x)
        x = {name: (casts[name].data, casts[name].scale) for name in layout.x_given}
    else:
        x = {name: (next(it), next(it)) for name in layout.x_given}
    states = _states(layout, tuple(it)) if layout.delayed else None
    return w, x, states


def _states(layout: _Layout, leaves: tuple) -> tuple[ScalingState, ...]:
    """The three casts' states from the op's state inputs: six tensors, or views of one packed
    ``[3 * (L + 1)]`` tensor whose rows are (history, scale) of x, w and dy."""
    if layout.packed_state:
        rows = leaves[0].view(3, layout.packed_state + 1)
        return tuple(ScalingState(r[:-1], r[-1:].view(1, 1)) for r in rows)
    it = iter(leaves)
    return tuple(ScalingState(next(it), next(it)) for _ in range(3))


def _given(pair: tuple, spec: CastSpec, dtype: torch.dtype) -> Fp8Tensor:
    # Views, not the inputs themselves: an autograd.Function output that is saved must not be an
    # input returned as it is.
    return Fp8Tensor(pair[0].view_as(pair[0]), pair[1].view_as(pair[1]), Fp8Meta(spec, dtype, None))


def _cast_operand(t, spec: CastSpec, given: dict, name: str, state, transpose: bool, p: LinearPlan):
    """(cast, its transposed copy or None, amax recorded or None) of the forward's ``x`` / ``w``.
    Compiled, x's tensorwise amax fuses into the kernel that makes x; a weight, which the
    compiled region is given, keeps the amax kernel."""
    if given:
        return _given(given[name], spec, t.dtype), None, None
    if state is not None:
        return cast_delayed(t, spec, state.scale, transpose=transpose, kernels=p.kernels)
    q, q_t = cast(t, spec, transpose=transpose, kernels=p.kernels, fuse_amax=name == "x")
    return q, q_t, None


class _LinearFn(torch.autograd.Function):
    """Outputs: y; the x and w payloads the backward reads (non-differentiable); with delayed
    scaling, the six state tensors passed on, packed in one vector (differentiable: its gradient
    is the later uses' new states; one output, so one tangent), and the x and w amaxes recorded
    (non-differentiable)."""

    @staticmethod
    def forward(x, weight, bias, p: LinearPlan, layout: _Layout, *leaves):
        gw, gx, states = _unpack(layout, x, leaves)
        xs, ws = operand(p, "x"), operand(p, "w")
        tx, tw = layout.transposes
        x2 = x if gx else x.reshape(-1, x.shape[-1])  # given casts: x only routes the gradient
        qx, qx_t, x_amax = _cast_operand(x2, xs.first, gx, "x", states and states[0], tx, p)
        w_state = states[1] if states is not None and p.delayed.weight else None
        qw, qw_t, w_amax = _cast_operand(weight, ws.first, gw, "w", w_state, tw, p)
        y = gemm(qx, qw.t(), out_dtype=x.dtype, bias=bias, path=p.output.path, fast_accum=p.output.fast_accum)
        qx = qx if qx_t is None else qx_t  # what the backward reads
        qw = qw if qw_t is None else qw_t
        out = (y.reshape(*x.shape[:-1], weight.shape[0]), qx.data, qx.scale, qw.data, qw.scale)
        if states is None:
            return out
        # full tensors: a replicated distributed state (TP) would make the passed-on state a DTensor
        # output, whose tangent torch.compile expects as a DTensor even when no later use gives it one
        passed = (leaves[-1].clone() if layout.packed_state else
                  torch.cat([full_tensor(t).reshape(-1) for st in states for t in st]))
        # the amaxes as outputs of their own (saved for the backward): no kernel to put them together
        return out + (passed, full_tensor(x_amax), full_tensor(qx.scale.new_zeros(1) if w_amax is None else w_amax))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, p, layout, *leaves = inputs
        gw, gx, states = _unpack(layout, x, leaves)
        _, qx_data, qx_scale, qw_data, qw_scale, *rest = output
        ctx.mark_non_differentiable(qx_data, qx_scale, qw_data, qw_scale, *rest[1:])
        ctx.plan, ctx.layout = p, layout
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_kind, x_saved = _saved(operand(p, "x"), p.grad_weight.hp, gx, "x", layout.transposes[0],
                                 (qx_data, qx_scale), x)
        w_kind, w_saved = _saved(operand(p, "w"), p.grad_input.hp, gw, "w", layout.transposes[1],
                                 (qw_data, qw_scale), weight)
        if x_kind == "missing":
            raise ValueError(f"linear: plan {p.name!r} needs the input itself or its 'x_t' cast in the backward.")
        ctx.x_kind, ctx.w_kind = x_kind, w_kind
        state_saved = () if states is None else (*leaves[len(leaves) - layout.n_state:], *rest[1:])
        ctx.save_for_backward(*x_saved, *w_saved, *state_saved)

    @staticmethod
    def backward(ctx, dy, *grads):
        p: LinearPlan = ctx.plan
        saved = ctx.saved_tensors
        x_saved, w_saved, state_saved = saved[:2], saved[2:4], saved[4:]
        states = _states(ctx.layout, state_saved[:-2]) if state_saved else None
        dy2, dy_given = _grad_output(dy, ctx)
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        qdy, qdy_t, dy_amax = _cast_grad_output(dy2, dy_given, states and states[2],
                                                need_dx and not p.grad_input.hp, need_dw and not p.grad_weight.hp, p)
        if need_dx:
            if p.grad_input.hp:
                dx = (dy2.to(ctx.x_dtype) @ w_saved[0].to(ctx.x_dtype)).reshape(ctx.x_shape)
            else:
                b = _operand_for_backward(ctx.w_kind, w_saved, operand(p, "w"), ctx.w_dtype, qdy)  # [N, K] along N
                dx = gemm(qdy, b, out_dtype=ctx.x_dtype, path=p.grad_input.path,
                          fast_accum=p.grad_input.fast_accum).reshape(ctx.x_shape)
        if need_dw:
            if p.grad_weight.hp:
                x2 = x_saved[0].reshape(-1, x_saved[0].shape[-1])
                dw = dy2.t().to(x2.dtype) @ x2
            else:
                b = _operand_for_backward(ctx.x_kind, x_saved, operand(p, "x"), ctx.x_dtype, None)  # [M, K] along M
                dw = gemm(qdy_t, b, out_dtype=ctx.w_dtype, path=p.grad_weight.path, fast_accum=p.grad_weight.fast_accum)
            dw = dw.to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            if dy_given is not None:
                raise ValueError("fp8func: a grad_output gathered in FP8 cannot give a bias gradient; "
                                 "use the stock RowwiseParallel for layers with a bias.")
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        given = (None,) * ctx.layout.n_given
        nexts = () if states is None else _next_states(ctx, states, state_saved, grads[4], dy_amax)
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


def _saved(casts, hp: bool, given: dict, name: str, wrote_t: bool, payload: tuple, hp_tensor) -> tuple[str, tuple]:
    """What the backward keeps of one operand: (kind, two tensors). Kinds: "cast" (the forward's
    cast, reused), "cast_t" (the transposed copy the forward wrote), "given" (the transposed-GEMM
    cast made elsewhere), "hp" (the tensor itself, cast in the backward or used in high precision)."""
    if hp:
        return ("hp", (hp_tensor, hp_tensor)) if not given else ("missing", ())
    if given:
        if name + ".T" in given:  # the transposed copy made with the given cast (input_casts)
            return "cast_t", given[name + ".T"]
        if casts.reuses:
            return "cast", payload
        t_name = name + "_t"
        return ("given", given[t_name]) if t_name in given else ("missing", ())
    if wrote_t:
        return "cast_t", payload
    if casts.reuses:
        return "cast", payload
    return "hp", (hp_tensor, hp_tensor)


def _operand_for_backward(kind: str, saved: tuple, casts, dtype, qdy) -> Fp8Tensor:
    """The backward GEMM's ``b`` from what the forward kept: ``[N, K]`` along N for w (grad_input),
    ``[M, K]`` along M for x (grad_weight)."""
    a, b = saved
    if kind == "cast":
        return Fp8Tensor(a, b, Fp8Meta(casts.first, dtype, None))
    if kind == "cast_t":  # a row-major [K, *] copy: its transpose is column-major, as scaled_mm's b
        return Fp8Tensor(a, b, Fp8Meta(casts.first, dtype, None)).t()
    spec = transposed(casts.second)  # the second cast, written on the operand's own layout
    if kind == "given":  # read as the layer that made it asks (fp8func._hooks.read_given)
        return Fp8Tensor(read_given(a, qdy.scale) if qdy is not None else a, b, Fp8Meta(spec, dtype, None))
    t = a.reshape(-1, a.shape[-1])
    return cast(t.t(), casts.second)[0].t()  # cast along the other axis: quantize t.T, view it back


def _grad_output(dy, ctx) -> tuple[torch.Tensor, dict | None]:
    """(dy as [M, N], its casts when it arrives gathered in FP8 by a sequence-parallel layer)."""
    dy_given = gathered_casts(dy)
    if dy_given is not None and ctx.layout.delayed:
        raise ValueError("fp8func: delayed scaling casts the grad_output itself; use the stock TP styles.")
    return (dy.reshape(-1, dy.shape[-1]) if dy_given is None else dy), dy_given


def _cast_grad_output(dy2, given, state, want_first: bool, want_second: bool, p: LinearPlan):
    """(dy along N for grad_input, dy.T along M for grad_weight, dy's amax (delayed) or None)."""
    casts = operand(p, "dy")
    if given is not None:
        qdy = given["dy"] if want_first or casts.reuses else None
        second = given.get("dy_t", given["dy"]).t() if want_second else None
        return qdy, second, None
    if not (want_first or want_second):
        return None, None, None
    if state is not None:
        qdy, qdy_t, amax = cast_delayed(dy2, casts.first, state[1], transpose=want_second, kernels=p.kernels)
        return qdy, qdy_t, amax
    if casts.first == casts.second:  # one call, one amax: [M, N] along N and [N, M] along M
        return cast(dy2, casts.first, transpose=want_second, kernels=p.kernels, fuse_amax=True)[:2] + (None,)
    qdy = cast(dy2, casts.first, kernels=p.kernels)[0] if want_first else None
    qdy_t = cast(dy2.t(), casts.second, kernels=p.kernels)[0] if want_second else None
    return qdy, qdy_t, None


def _next_states(ctx, states: tuple[ScalingState, ...], saved: tuple, passed_grad, dy_amax) -> tuple:
    """The gradients of the state inputs: each state after this use's amax is recorded
    (``record_merged``). Six tensors, ``None`` for a state this plan does not record (a dynamic
    weight); or one packed tensor, where such a state comes back unchanged.
    ``passed_grad``: the gradient of the packed state this use passed on (zeros, or None, when
    no later use read it)."""
    p: LinearPlan = ctx.plan
    layout: _Layout = ctx.layout
    x_amax, w_amax = saved[-2:]
    if passed_grad is not None:  # a state is replicated; under TP its gradient may come as a distributed tensor
        passed_grad = full_tensor(passed_grad)
    algo, sharding = p.delayed.algo, layout.sharding
    recorded = (_global_amax(x_amax, sharding), None if not p.delayed.weight else _global_amax(w_amax, None),
                None if dy_amax is None else _global_amax(dy_amax, sharding))
    specs = (operand(p, "x").first, operand(p, "w").first, operand(p, "dy").first)
    rows = [i for i, a in enumerate(recorded) if a is not None]  # the states this plan records
    if layout.packed_state:  # the three states as the rows of one [3, L + 1] tensor, in one computation
        n = layout.packed_state
        mine = saved[0].view(3, n + 1)
        theirs = mine.new_zeros(3, n + 1) if passed_grad is None else passed_grad.view(3, n + 1)
        # [3, 1] without a concatenation (a state not recorded takes x's amax: its row is not kept)
        row = torch.arange(3, device=mine.device).reshape(3, 1)
        x_a, w_a, dy_a = (recorded[0] if a is None else a for a in recorded)
        new = record_merged_packed(mine, theirs, torch.where(row == 0, x_a, torch.where(row == 1, w_a, dy_a)),
                                   specs, algo)
        if len(rows) < 3:
            new = torch.where(torch.tensor([[i in rows] for i in range(3)], device=mine.device), new, mine)
        return (new.reshape(-1),)
    mine = tuple(tuple(map(full_tensor, st)) for st in states)
    incoming = _unpack_state(passed_grad, tuple(t for st in mine for t in st))
    theirs = tuple(zip(incoming[0::2], incoming[1::2]))
    out = [None] * 6
    if len({mine[i][0].numel() for i in rows}) > 1:  # histories of different lengths: one at a time
        for i in rows:
            st = record_merged(ScalingState(*mine[i]), ScalingState(*theirs[i]), recorded[i], specs[i], algo)
            out[2 * i], out[2 * i + 1] = st
        return tuple(out)
    pack = lambda sts: torch.stack([torch.cat([h.reshape(-1), s.reshape(-1)]) for h, s in sts])  # noqa: E731
    new = record_merged_packed(pack([mine[i] for i in rows]), pack([theirs[i] for i in rows]),
                               torch.cat([recorded[i] for i in rows]), tuple(specs[i] for i in rows), algo)
    for j, i in enumerate(rows):
        out[2 * i], out[2 * i + 1] = new[j, :-1], new[j, -1:].reshape(1, 1)
    return tuple(out)


def _unpack_state(flat, like: tuple) -> tuple:
    """The six state tensors packed in ``flat`` (zeros when ``flat`` is None), shaped as ``like``."""
    if flat is None:
        return tuple(torch.zeros_like(full_tensor(t)) for t in like)
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return tuple(out)


def _global_amax(amax: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
    """The amax of the logical tensor: a distributed tensor's over its mesh (TP), then over
    ``sharding``'s row split (the data-parallel ranks' batches) when given."""
    amax = full_tensor(amax).reshape(1)
    if sharding is not None:
        amax = reduce_amax(amax, sharding.mesh, sharding.amax_mesh_dims(TensorWise(), (2, 2)))
    return amax


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


def _leaves(group: dict[str, Fp8Tensor] | None, wanted: list, what: str, p: LinearPlan) -> tuple[tuple, tuple]:
    """(names, flat (data, scale) leaves) of casts made elsewhere, checked against the plan's."""
    if group is None:
        return (), ()
    names = [name for name, _ in wanted]
    if what == "input" and "x.T" in group and takes_x_copy(p):
        names = ["x", "x.T"]  # input_casts: the forward's cast and its transposed copy
    if sorted(group) != sorted(names):
        raise ValueError(f"linear: plan {p.name!r} needs {what} casts {names}, got {sorted(group)} "
                         "(make them with fp8func.input_casts(x, recipe) for this recipe).")
    return tuple(names), tuple(t for name in names for t in (group[name].data, group[name].scale))


def _check_state(state, p: LinearPlan, x, weight) -> None:
    if not isinstance(state, LinearScalingState):
        raise TypeError(f"linear_delayed: state={type(state).__name__}; expected a LinearScalingState, e.g. "
                        "fp8func.LinearScalingState.init(history_len).requires_grad_().")
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return  # checked when the same code runs eagerly; no update is due without grad
    tracked = [t.requires_grad for st in state for t in st]
    if (x.requires_grad or weight.requires_grad) and not all(tracked):
        raise ValueError(
            "linear_delayed: the next step's scaling state comes back as the gradient of `state`, but its tensors "
            "do not require grad, so the update would be lost. Differentiate with respect to the state "
            "(torch.func.grad(loss, argnums=(..., <state>)) or state.requires_grad_() and read .grad), or run "
            "the forward under torch.no_grad() when no state update is wanted."
        )
    consume(state, "linear_delayed")


def _check_packed_state(flat: torch.Tensor, x, weight) -> int:
    """The history length of a packed state (see ``fp8_linear``), or raises."""
    n = flat.numel()
    if is_distributed(flat) or flat.ndim != 1 or flat.dtype != torch.float32 or n % 3 or n < 6:
        raise ValueError(f"fp8_linear: a packed state is {type(flat).__name__} {tuple(flat.shape)} {flat.dtype}; "
                         "expected a plain float32 [3 * (L + 1)] tensor (the six state tensors concatenated).")
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and not flat.requires_grad \
            and (x.requires_grad or weight.requires_grad):
        raise ValueError("fp8_linear: the packed state does not require grad, so its update (its gradient) would "
                         "be lost; make it require grad, or run the forward under torch.no_grad().")
    return n // 3 - 1


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
    w_names, w_leaves = _leaves(w_casts, weight_casts(p), "weight", p)
    x_names, x_leaves = _leaves(x_casts, activation_casts(p), "input", p)
    if x_inside:
        x_names = tuple(name for name, _ in activation_casts(p))
    states, packed_len = (), 0
    if isinstance(state, torch.Tensor):
        packed_len = _check_packed_state(state, x, weight)
        states = (state,)
    elif state is not None:
        _check_state(state, p, x, weight)
        states = tuple(t for st in state for t in st)
    layout = _Layout(w_names, x_names, state is not None, packed_len,
                     forward_transposes(x, weight, p, bool(x_names), bool(w_names)),
                     amax_sharding if state is not None else None, x_inside)
    out = _LinearFn.apply(x, weight, bias, p, layout, *w_leaves, *x_leaves, *states)
    if state is None:
        return out[0], None
    return out[0], out[5] if packed or packed_len else unpack_state(out[5], state)


def unpack_state(flat: torch.Tensor, like: LinearScalingState) -> LinearScalingState:
    """The state packed in ``flat`` (``fp8_linear(..., packed=True)``), shaped as ``like``."""
    return LinearScalingState.from_tensors(_unpack_state(flat, like.tensors()))


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
