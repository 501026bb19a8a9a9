"""Tensor-parallel styles whose sequence-parallel activations travel in FP8.

Under the stock ``ColwiseParallel`` a sequence-sharded input (``Shard(1)``) is all-gathered in
bf16 and the layer then casts the full tensor. ``Fp8ColwiseParallel`` casts each rank's shard
with the amax reduced over the TP group (so every shard gets the full tensor's scale), gathers
the fp8 bytes, and hands the layer the gathered casts: bitwise what the bf16 gather followed by
the cast gives, at half the bytes. Its backward reduce-scatters the input gradient, as the
bf16 gather's would. Stock styles on ``Fp8Linear`` are correct too (fp8func reads global
amaxes through DTensor); these styles save the bandwidth.
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
from .._qtensor import Fp8Tensor
from .._scaling import Recipe, raw_block_lengths
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


def _gather_casts(x_local: torch.Tensor, mesh: DeviceMesh, specs) -> DTensor:
    """Casts each of ``specs`` of a sequence shard ``[B, S/tp, F]`` with the TP-reduced amax and
    all-gathers the fp8 bytes (and the per-token / per-block scales) along the sequence, all of
    them in one collective: a uint8 buffer per group of tokens holding each cast's bytes and
    scales of those tokens.

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
    sharding = Sharding(mesh, (Shard(0),))  # the tokens are split over the TP group
    casts = [(name, spec, cast(rows, spec, sharding=(sharding,))[0]) for name, spec in specs]
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


class _SequenceAllGather(torch.autograd.Function):
    """Forward: the fp8 gather of a ``Shard(1)`` DTensor's casts. Backward: reduce-scatter of its
    gradient (the layer's N is sharded, so each rank holds a partial sum), as the bf16 gather's is.
    The mesh comes with the DTensor: compiled, an argument of this op must be a tensor or a constant."""

    @staticmethod
    def forward(ctx, x: DTensor, recipe: Recipe):
        ctx.mesh = x.device_mesh
        return _gather_casts(x.to_local(), x.device_mesh, activation_casts(recipe))

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            grad = DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False)
        return grad.redistribute(ctx.mesh, [Shard(1)]), None


class _SequenceReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter a row-parallel output (partial sums) to sequence shards. Backward:
    the fp8 gather of the grad_output's casts, which the layer's backward consumes as they are."""

    @staticmethod
    def forward(ctx, y: DTensor, recipe: Recipe, use_local_output: bool):
        ctx.mesh, ctx.recipe, ctx.local = y.device_mesh, recipe, use_local_output
        out = y.redistribute(y.device_mesh, [Shard(1)])
        return out.to_local() if use_local_output else out

    @staticmethod
    def backward(ctx, dy):
        local = dy.to_local() if isinstance(dy, DTensor) else dy
        return _gather_casts(local, ctx.mesh, grad_output_casts(ctx.recipe)), None, None


def sequence_all_gather(x_local: torch.Tensor, mesh: DeviceMesh, recipe: Recipe) -> DTensor:
    """All-gathers a sequence-sharded activation ``[B, S/tp, K]`` in FP8 for ``Fp8Linear``.

    Returns a Replicate DTensor of shape ``[B, S, K]`` that exists only as its casts (see
    ``activation_casts``); an ``Fp8Linear`` consumes it, anything else raises.
    """
    if x_local.ndim != 3:
        raise ValueError(f"sequence_all_gather: expected [batch, seq, features], got shape {tuple(x_local.shape)}.")
    b, s, f = x_local.shape
    n = s * mesh.size(0)  # shape and stride given: computing them is a graph break (torch._C's global tensor info)
    x = DTensor.from_local(x_local, mesh, [Shard(1)], run_check=False, shape=(b, n, f), stride=(n * f, f, 1))
    return _SequenceAllGather.apply(x, recipe)


# One node each in a compiled graph: AOTAutograd traces the gathers (functional collectives) and
# the casts-only DTensor they build; dynamo, tracing into them, could not build that tensor.
torch._dynamo.allow_in_graph(_SequenceAllGather)
torch._dynamo.allow_in_graph(_SequenceReduceScatter)


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


class Fp8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``Fp8Linear``: a ``Shard(1)`` (sequence-parallel) input is cast per
    shard with the TP-reduced amax and all-gathered in FP8 (see module docstring)."""

    def _apply(self, module, device_mesh):
        _require_fp8_linear(self, module, "ColwiseParallel")
        return super()._apply(module, device_mesh)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        fp8_gather = (_is_seq_shard(input_layouts) and not _is_seq_shard(desired_input_layouts)
                      and activation_casts(mod.recipe) and x.ndim == 3
                      and _fp8_gather_fits(_local_len(x), activation_casts(mod.recipe)))
        if not fp8_gather:
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        local = x.to_local() if isinstance(x, DTensor) else x
        return sequence_all_gather(local, device_mesh, mod.recipe)


class Fp8RowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Fp8Linear``: with a ``Shard(1)`` (sequence-parallel) output, the
    backward casts each rank's grad_output shard with the TP-reduced amax and all-gathers it in
    FP8, bitwise what the bf16 gather followed by the cast gives. Layers with a bias keep the
    stock path (a bias gradient needs the high-precision grad_output)."""

    def _apply(self, module, device_mesh):
        _require_fp8_linear(self, module, "RowwiseParallel")
        return super()._apply(module, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        seq = _is_seq_shard(output_layouts)
        fp8 = (seq and isinstance(outputs, DTensor) and outputs.ndim == 3
               and mod.bias is None
               and grad_output_casts(mod.recipe) and all(p.is_partial() for p in outputs.placements)
               and _fp8_gather_fits(outputs.shape[1] // device_mesh.size(0), grad_output_casts(mod.recipe)))
        if not fp8:
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return _SequenceReduceScatter.apply(outputs, mod.recipe, use_local_output)


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
    """

    def _apply(self, module, device_mesh):
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
        return sequence_all_gather(local, mesh, recipe)
