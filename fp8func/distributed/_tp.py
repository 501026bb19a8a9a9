"""Tensor-parallel styles whose sequence-parallel activations travel in FP8.

Under the stock ``ColwiseParallel`` a sequence-sharded input (``Shard(1)``) is all-gathered in
bf16 and the layer then casts the full tensor. ``Fp8ColwiseParallel`` casts each rank's shard
with the amax reduced over the TP group (so every shard gets the full tensor's scale), gathers
the fp8 bytes, and hands the layer the gathered casts: bitwise what the bf16 gather followed by
the cast gives, at half the bytes. Its backward reduce-scatters the input gradient, as the
bf16 gather's would. Stock styles on ``Fp8Linear`` are correct too (fp8func reads global
amaxes through DTensor); these styles save the bandwidth.

With ``local_scales=True`` (tensorwise recipes) no activation or grad_output cast has a scale
group that spans TP ranks, so the layers run no amax all-reduce: each rank casts what it holds
of a TP-sharded tensor with the amax of what it holds. A sequence gather then carries one scale
per rank's chunk of tokens (row scales of the gathered operand, ``BlockWise((S/tp, F))``); a
``Shard(-1)`` input or grad_output is cast per rank (each rank's GEMM is local, its partial sums
are reduced in high precision as before). docs/tp.md states the contract.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from .._casts import activation_casts, cast, grad_output_casts
from .._collectives import gather_padded, gather_rows
from .._gathered import Fp8GatheredWeight
from .._log import warn_once
from .._plan import operand
from .._qtensor import Fp8Meta, Fp8Tensor
from .._scaling import BlockWise, Recipe, TensorWise, raw_block_lengths
from .._sharding import Sharding
from ..nn._linear import Fp8Linear

__all__ = ["Fp8ColwiseParallel", "Fp8RowwiseParallel", "PrepareFp8ModuleInput", "sequence_all_gather"]

log = logging.getLogger("fp8func")


def _token_block(spec) -> int | None:
    """Tokens per scale group of a ``[tokens, F]`` cast: None (all of them), 1 (per token) or a block."""
    return raw_block_lengths(spec.granularity, (1, 1))[0]


def _split_token_block(s_local: int, specs) -> int | None:
    """A token block of ``specs`` that straddles two ranks' shards of ``s_local`` tokens, if any."""
    return next((blk for blk in map(_token_block, (spec for _, spec in specs))
                 if blk is not None and s_local % blk), None)


def _fp8_gather_fits(s_local: int, specs) -> bool:
    """Whether the FP8 sequence gather applies; if not, says once why the layer gathers in bf16."""
    block = _split_token_block(s_local, specs)
    if block is not None:
        warn_once(("split token block", s_local, block),
                  "fp8func: sequence shards of %d tokens split the %d-token scale blocks of the cast; "
                  "these layers gather their activations in high precision (correct, twice the bytes). "
                  "A sequence length divisible by %d x TP size lets them gather in FP8.",
                  s_local, block, block)
    return block is None


def _gather_casts(x_local: torch.Tensor, mesh: DeviceMesh, specs, local: bool = False) -> DTensor:
    """Casts each of ``specs`` of a sequence shard ``[B, S/tp, F]`` with the TP-reduced amax and
    all-gathers the fp8 bytes (and the per-token / per-block scales) along the sequence, all of
    them in one collective: a uint8 buffer per group of tokens holding each cast's bytes and
    scales of those tokens.

    ``local``: tensorwise casts with this rank's own amax (no all-reduce); the gathered cast has
    one scale per rank's chunk of each sequence, ``BlockWise((S/tp, F))`` on ``[B*S, F]`` (each
    chunk's scale gathered with its bytes).

    Shards are even, as the stock styles assume (``DTensor.from_local`` of a ``Shard(1)`` input).
    Returns a Replicate DTensor ``[B, S, F]`` that exists only as its (2-D, ``[B*S, F]``) casts.
    """
    b, s_local, f = x_local.shape
    block = _split_token_block(s_local, specs)
    if block is not None:
        raise ValueError(
            f"fp8func: sequence shards of {s_local} tokens split the {block}-token scale blocks of "
            "the casts; use a sequence length divisible by the block x TP size."
        )
    ws = mesh.size(0)
    rows = x_local.reshape(-1, f)  # [B * S_local, F]: this rank's tokens
    sharding = () if local else (Sharding(mesh, (Shard(0),)),)  # the tokens are split over the TP group
    casts = [(name, spec, cast(rows, spec, sharding=sharding)[0]) for name, spec in specs]
    if local:
        casts = [(name, *_per_chunk(q, b)) for name, _, q in casts]
    if b == 1 and len(casts) == 1 and _token_block(casts[0][1]) is None and ws > 1:
        # One per-tensor cast of one sequence: its rows, gathered along dim 0, are the sequence in
        # order. On CUDA the graph is the one inductor's micro-pipeline TP pass (async TP) fuses
        # with the GEMMs that read it: all_gather_into_tensor (fp8) -> wait_tensor -> _scaled_mm.
        name, spec, q = casts[0]
        data = gather_rows(q.data, mesh, 0)
        full = Fp8GatheredWeight({name: Fp8Tensor(data, q.scale, q.meta)}, (b, s_local * ws, f), x_local.dtype)
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False)
    group = max(_token_block(spec) or 1 for _, spec, _ in casts)  # tokens per packed row: every block divides it
    parts = []  # per cast: its bytes, then its scales if they split the tokens (a spanning scale is TP-reduced)
    for _, spec, q in casts:
        parts.append(q.data.view(torch.uint8).reshape(b, s_local // group, group * f))
        if _token_block(spec) is not None:
            parts.append(q.scale.contiguous().view(torch.uint8).reshape(b, s_local // group, -1))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    gathered = gather_padded(packed, 1, [s_local // group] * ws, mesh, 0)  # [B, S / group, bytes]
    out, at = {}, 0
    for name, spec, q in casts:
        data = gathered[..., at:at + group * f].reshape(-1, f).view(spec.dtype)
        at += group * f
        scale, block = q.scale, _token_block(spec)
        if block is not None:
            width = group // block * scale.shape[1] * scale.element_size()
            scale = gathered[..., at:at + width].reshape(-1).view(scale.dtype).reshape(-1, scale.shape[1])
            at += width
        out[name] = Fp8Tensor(data, scale, q.meta)
    full = Fp8GatheredWeight(out, (b, s_local * ws, f), x_local.dtype)
    return DTensor.from_local(full, mesh, [Replicate()], run_check=False)


def _per_chunk(q: Fp8Tensor, batch: int) -> tuple:
    """(spec, cast) of this rank's tensorwise cast ``q`` of ``[B * S/tp, F]`` rows as one scale per
    sequence chunk (``BlockWise((S/tp, F))``, the scale repeated ``B`` times), which the gathered
    rows keep: each rank's chunk of each sequence with its rank's scale."""
    rows, f = q.shape
    spec = q.spec.with_granularity(BlockWise((rows // batch, f)))
    return spec, Fp8Tensor(q.data, q.scale.expand(batch, 1).contiguous(), Fp8Meta(spec, q.meta.orig_dtype, None))


class _SequenceAllGather(torch.autograd.Function):
    """Forward: the fp8 gather of a ``Shard(1)`` DTensor's casts. Backward: reduce-scatter of its
    gradient (the layer's N is sharded, so each rank holds a partial sum), as the bf16 gather's is.
    The mesh comes with the DTensor: compiled, an argument of this op must be a tensor or a constant."""

    @staticmethod
    def forward(ctx, x: DTensor, recipe: Recipe, local: bool):
        ctx.mesh = x.device_mesh
        return _gather_casts(x.to_local(), x.device_mesh, activation_casts(recipe), local)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            grad = DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False)
        return grad.redistribute(ctx.mesh, [Shard(1)]), None, None


class _SequenceReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter a row-parallel output (partial sums) to sequence shards. Backward:
    the fp8 gather of the grad_output's casts, which the layer's backward consumes as they are."""

    @staticmethod
    def forward(ctx, y: DTensor, recipe: Recipe, use_local_output: bool, local: bool):
        ctx.mesh, ctx.recipe, ctx.scales_local = y.device_mesh, recipe, local
        out = y.redistribute(y.device_mesh, [Shard(1)])
        return out.to_local() if use_local_output else out

    @staticmethod
    def backward(ctx, dy):
        local = dy.to_local() if isinstance(dy, DTensor) else dy
        return _gather_casts(local, ctx.mesh, grad_output_casts(ctx.recipe), ctx.scales_local), None, None, None


def _local_casts(t: DTensor, specs) -> DTensor:
    """The casts of ``specs`` of the 2-D rows of a DTensor's local shard ``[..., F/tp]``, each with
    this rank's own amax (no collective), as a DTensor placed like ``t`` that exists only as them."""
    local = t.to_local()
    rows = local.reshape(-1, local.shape[-1])
    casts = {name: cast(rows, spec, fuse_amax=True)[0] for name, spec in specs}
    holder = Fp8GatheredWeight(casts, tuple(local.shape), local.dtype)
    stride = [1]
    for size in reversed(t.shape[1:]):
        stride.insert(0, stride[0] * size)
    # shape and stride given: computing them is a graph break (torch._C's global tensor info)
    return DTensor.from_local(holder, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=tuple(stride))


class _LocalInputCasts(torch.autograd.Function):
    """Forward: a ``Shard(-1)`` input's casts, per rank (``_local_casts``), for a row-parallel
    ``Fp8Linear`` whose GEMM is each rank's own. Backward: the gradient as it comes."""

    @staticmethod
    def forward(ctx, x: DTensor, recipe: Recipe):
        ctx.mesh, ctx.placements = x.device_mesh, x.placements
        return _local_casts(x, activation_casts(recipe))

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            grad = DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False)
        return grad, None


class _LocalGradOutputCasts(torch.autograd.Function):
    """Forward: a column-parallel ``Fp8Linear``'s ``Shard(-1)`` output as it is. Backward: its
    grad_output's casts, per rank (``_local_casts``), which the layer's backward consumes."""

    @staticmethod
    def forward(ctx, y: DTensor, recipe: Recipe):
        ctx.recipe, ctx.mesh, ctx.placements = recipe, y.device_mesh, y.placements
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        if not isinstance(dy, DTensor):
            dy = DTensor.from_local(dy, ctx.mesh, ctx.placements, run_check=False)
        elif dy.placements != ctx.placements:
            dy = dy.redistribute(ctx.mesh, ctx.placements)
        return _local_casts(dy, grad_output_casts(ctx.recipe)), None


def sequence_all_gather(x_local: torch.Tensor, mesh: DeviceMesh, recipe: Recipe, *,
                        local_scales: bool = False) -> DTensor:
    """All-gathers a sequence-sharded activation ``[B, S/tp, K]`` in FP8 for ``Fp8Linear``.

    Returns a Replicate DTensor of shape ``[B, S, K]`` that exists only as its casts (see
    ``activation_casts``); an ``Fp8Linear`` consumes it, anything else raises. ``local_scales``:
    each rank casts its shard with its own amax (no all-reduce), the gathered cast keeps one scale
    per rank's chunk of each sequence (tensorwise recipes; docs/tp.md).
    """
    if x_local.ndim != 3:
        raise ValueError(f"sequence_all_gather: expected [batch, seq, features], got shape {tuple(x_local.shape)}.")
    b, s, f = x_local.shape
    n = s * mesh.size(0)  # shape and stride given: computing them is a graph break (torch._C's global tensor info)
    x = DTensor.from_local(x_local, mesh, [Shard(1)], run_check=False, shape=(b, n, f), stride=(n * f, f, 1))
    return _SequenceAllGather.apply(x, recipe, local_scales)


# One node each in a compiled graph: AOTAutograd traces the gathers (functional collectives) and
# the casts-only DTensor they build; dynamo, tracing into them, could not build that tensor.
torch._dynamo.allow_in_graph(_SequenceAllGather)
torch._dynamo.allow_in_graph(_SequenceReduceScatter)
torch._dynamo.allow_in_graph(_LocalInputCasts)
torch._dynamo.allow_in_graph(_LocalGradOutputCasts)


def _check_local_scales(style, module) -> None:
    """Raises (at ``parallelize_module``, on every rank, before any collective) where
    ``local_scales=True`` cannot hold its contract for ``module``."""
    if not isinstance(style.local_scales, bool):
        raise TypeError(f"{type(style).__name__}(local_scales={style.local_scales!r}): expected True or False.")
    if not style.local_scales:
        return
    p = module.plan
    casts = {role: operand(p, short) for role, short in (("input", "x"), ("weight", "w"), ("grad_output", "dy"))}
    bad = [role for role, c in casts.items()
           if not all(spec is not None and isinstance(spec.granularity, TensorWise) for spec in (c.first, c.second))]
    if p.delayed is not None or bad:
        why = "delayed scaling" if p.delayed is not None else f"non-tensorwise or high-precision casts of {bad}"
        raise ValueError(
            f"{type(style).__name__}(local_scales=True) on a layer with recipe {p.name!r} ({why}): TP-local scales "
            "apply to dynamic tensorwise recipes (every GEMM FP8, every cast TensorWise(), no delayed state; e.g. "
            "'tensorwise'). Row-wise and block-wise casts of the tokens already scale within each rank; their "
            "grad_weight casts along the tokens do not. Use local_scales=False with this recipe."
        )
    if isinstance(style, Fp8ColwiseParallel) and module.bias is not None:
        raise ValueError(
            f"Fp8ColwiseParallel(local_scales=True) on a {type(module).__name__} with a bias: the layer's "
            "grad_output arrives cast per rank, and a bias gradient needs it in high precision. Drop the bias, "
            "or use local_scales=False for this layer."
        )


def _require_fp8_linear(style, module, stock: str) -> None:
    if not isinstance(module, Fp8Linear):
        raise TypeError(
            f"{type(style).__name__} applies to fp8func.nn.Fp8Linear, got {type(module).__name__}; "
            f"run fp8func.convert(model, ...) first, or use {stock} for this layer."
        )


def _local_len(x: torch.Tensor) -> int:
    """This rank's sequence length of a ``Shard(1)`` input (a DTensor, or already its local shard)."""
    return x.to_local().shape[1] if isinstance(x, DTensor) else x.shape[1]


def _is_seq_shard(layouts) -> bool:
    layout = layouts[0] if isinstance(layouts, (tuple, list)) else layouts
    return isinstance(layout, Shard) and layout.dim == 1


def _is_last_dim_shard(t) -> bool:
    return (isinstance(t, DTensor) and len(t.placements) == 1 and isinstance(t.placements[0], Shard)
            and t.placements[0].dim % t.ndim == t.ndim - 1)


class Fp8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``Fp8Linear``: a ``Shard(1)`` (sequence-parallel) input is cast per
    shard with the TP-reduced amax and all-gathered in FP8 (see module docstring).

    With ``local_scales=True``, each rank casts its sequence shard with its own amax and the
    gathered input carries one scale per rank's chunk; the layer's grad_output (sharded along its
    features) is cast per rank too, ahead of the layer's backward: no amax all-reduce (tensorwise
    recipes; docs/tp.md, "TP-local scaling", states the contract). A layer with a bias raises (its
    bias gradient needs the high-precision grad_output).
    """

    def __init__(self, *, local_scales: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.local_scales = local_scales

    def _apply(self, module, device_mesh):
        _require_fp8_linear(self, module, "ColwiseParallel")
        _check_local_scales(self, module)
        return super()._apply(module, device_mesh)

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        fp8_gather = (_is_seq_shard(input_layouts) and not _is_seq_shard(desired_input_layouts)
                      and activation_casts(mod.recipe) and x.ndim == 3
                      and _fp8_gather_fits(_local_len(x), activation_casts(mod.recipe)))
        if not fp8_gather:
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        local = x.to_local() if isinstance(x, DTensor) else x
        return sequence_all_gather(local, device_mesh, mod.recipe, local_scales=self.local_scales)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        if self.local_scales and _is_last_dim_shard(outputs):
            outputs = _LocalGradOutputCasts.apply(outputs, mod.recipe)
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class Fp8RowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Fp8Linear``: with a ``Shard(1)`` (sequence-parallel) output, the
    backward casts each rank's grad_output shard with the TP-reduced amax and all-gathers it in
    FP8, bitwise what the bf16 gather followed by the cast gives. Layers with a bias keep the
    stock path (a bias gradient needs the high-precision grad_output).

    With ``local_scales=True``, the layer's input (sharded along its features) is cast per rank
    ahead of the layer, and the gathered grad_output carries one scale per rank's chunk of
    tokens: no amax all-reduce (tensorwise recipes; docs/tp.md, "TP-local scaling").
    """

    def __init__(self, *, local_scales: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.local_scales = local_scales

    def _apply(self, module, device_mesh):
        _require_fp8_linear(self, module, "RowwiseParallel")
        _check_local_scales(self, module)
        return super()._apply(module, device_mesh)

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        return _LocalInputCasts.apply(x, mod.recipe) if self.local_scales and _is_last_dim_shard(x) else x

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        seq = _is_seq_shard(output_layouts)
        fp8 = (seq and isinstance(outputs, DTensor) and outputs.ndim == 3
               and mod.bias is None
               and grad_output_casts(mod.recipe) and all(p.is_partial() for p in outputs.placements)
               and _fp8_gather_fits(outputs.shape[1] // device_mesh.size(0), grad_output_casts(mod.recipe)))
        if not fp8:
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return _SequenceReduceScatter.apply(outputs, mod.recipe, use_local_output, self.local_scales)


class PrepareFp8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` that all-gathers a sequence-sharded input once, in FP8, for every
    ``Fp8Linear`` inside the module that reads it (q, k and v of an attention block).

    The module's ``Fp8Linear`` layers must share one input cast (one recipe); shard them with
    ``Fp8ColwiseParallel()`` (input already Replicate). A module input with another layout, or no
    ``Fp8Linear`` consumer, is prepared as ``PrepareModuleInput`` would.

    Example:
        >>> parallelize_module(block, tp_mesh, {
        ...     "self_attn": PrepareFp8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        ...     "self_attn.q_proj": Fp8ColwiseParallel(), "self_attn.k_proj": Fp8ColwiseParallel(),
        ...     "self_attn.v_proj": Fp8ColwiseParallel(),
        ...     "self_attn.o_proj": Fp8RowwiseParallel(output_layouts=Shard(1))})

    With ``local_scales=True`` (tensorwise recipes), each rank casts its sequence shard with its
    own amax and the gathered input carries one scale per rank's chunk (docs/tp.md, "TP-local
    scaling"); give the module's layers' styles ``local_scales=True`` too.
    """

    def __init__(self, *, local_scales: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.local_scales = local_scales

    def _apply(self, module, device_mesh):
        for m in module.modules():
            if isinstance(m, Fp8Linear):
                _check_local_scales(self, m)
        recipes = {m.recipe for m in module.modules() if isinstance(m, Fp8Linear)}
        if len(recipes) > 1:
            raise ValueError(
                f"PrepareFp8ModuleInput: the Fp8Linear layers of {type(module).__name__} use "
                f"{len(recipes)} recipes ({sorted(r.name for r in recipes)}); one gathered input cast "
                "serves one recipe. Convert them with one recipe, or use PrepareModuleInput."
            )
        self._recipe = next(iter(recipes), None)
        return super()._apply(module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        recipe = getattr(self, "_recipe", None)
        if (recipe is None or not activation_casts(recipe) or not isinstance(input, torch.Tensor)
                or input.ndim != 3 or not _is_seq_shard(input_layout) or _is_seq_shard(desired_layout)
                or not _fp8_gather_fits(_local_len(input), activation_casts(recipe))):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        local = input.to_local() if isinstance(input, DTensor) else input
        return sequence_all_gather(local, mesh, recipe, local_scales=self.local_scales)
