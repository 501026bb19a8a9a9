"""Optimizer-step precompute: the FSDP2 fp8 all-gather weights' casts, made once per update, outside the hooks.

``precompute_scales`` casts every cast of every ``Fp8AllGatherWeight`` shard of a model and keeps
each payload with the weight's version, with the all-gather inputs and metadata made from them;
while the weight is unchanged its pre-all-gather hook (``fp8func.distributed._fsdp``) hands FSDP2
those (no cast, no collective), else it casts the shard itself. The casts run here, after the
optimizer, where the host is ahead of the GPU, instead of inside FSDP2's unshard. The same bits as
the hooks' own casts: the amaxes are those of the shard in the param dtype (rounding is monotonic),
and the scales that span ranks are reduced with MAX (exact) over the same meshes, in one all-reduce
per kind of reduction for all weights instead of one per weight:

* Tensorwise weights: one multi-tensor amax pass over the shards (``shard_amaxes``), one
  all-reduce per FSDP2 mesh, the shards cast with one kernel launch into buffers kept from one
  step to the next (``_KeptCasts``; ``_cast_kept``, one launch per kind of shard, where the
  weights of a mesh differ in dtype, cast or rounding).
* Row-wise weights: ``w`` with row scales (within the shard: no collective) and ``w_t`` with
  column scales (each column spans the row shards: ``_reduce_scales``); where the fused kernels
  take the shard, both casts from two reads of it (``_row_col_amaxes``, ``_cast_rows_cols``).
* Block weights: their one cast (blocks lie within the shard), as the hook makes it.

Every ``torch.optim`` optimizer's ``step()`` ends with it (``_AfterStep``; the hooks register it at
the first fp8 all-gather through ``register_after_step``, and ``precompute_after_optimizer_step``
turns it off). The dependency is one-way at import: this module imports the weight type from
``_fsdp``, which imports this one only inside the hook that registers ``_AfterStep``.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._casts import amax_for_cast, cast_with_scale, use_kernels
from .._log import warn_once
from .._scaling import AxisWise, TensorWise, compute_scale
from ._compat import local_tensor
from ._fsdp import Fp8AllGatherWeight

__all__ = ["precompute_after_optimizer_step", "precompute_scales", "register_after_step"]


@torch.no_grad()
def precompute_scales(model: torch.nn.Module) -> int:
    """Casts every FSDP2 fp8 all-gather weight's shard for the next all-gathers (call after
    ``optimizer.step()``), with the scales that span ranks reduced in one all-reduce for all weights.

    Same numbers as the hooks' own casts in ``fsdp_pre_all_gather`` (MAX is exact), with one
    collective instead of one per weight. The casts are kept for the step's all-gathers (the
    forward's and, under ``reshard_after_forward``, the backward's): their hooks launch nothing
    and reduce nothing, and the casts run here, after the optimizer, where the host is ahead of
    the GPU, instead of inside FSDP2's unshard, where the GPU waits for them. Tensorwise weights:
    one scale per weight, all in one all-reduce, the shards cast in one kernel launch into the
    same memory at every step (one byte per parameter of the shard kept). Row-wise weights: ``w``
    with row scales (within the shard: no collective) and ``w_t`` with column scales (each column
    spans the row shards: all columns of all weights in one all-reduce), both kept (two bytes per
    parameter of the shard). Block
    weights: their one cast (blocks lie within the shard). The casts are kept from here to the
    next update of the weight; a kept cast is used only while the weight is unchanged since (its
    version counter says so), a stale one never. Returns the number of weights it covered.

    Every ``torch.optim`` optimizer does this by itself after each ``step()`` for the weights it
    holds (``precompute_after_optimizer_step``); call it yourself after updating weights another
    way (after the optimizer's own, a call is free: the kept casts are current, nothing runs).
    """
    return _precompute(model.parameters())


@torch.no_grad()
def _precompute(params) -> int:
    groups: dict = {}  # mesh -> the weights with one tensorwise cast
    others: list = []  # the rest: row-wise (two casts), blocks
    for p in params:
        local = local_tensor(p)
        if not (isinstance(local, Fp8AllGatherWeight) and isinstance(p, DTensor)):
            continue
        if local._param_dtype is None:  # never all-gathered yet: the param dtype is not known
            continue
        if not isinstance(local._plan.output.b.granularity, TensorWise) or len(local._weight_casts()) != 1:
            others.append(local)
            continue
        groups.setdefault(p.device_mesh, []).append(local)
    covered = _precompute_casts(others)
    for mesh, weights in groups.items():
        covered += len(weights)
        if all(w._payloads_kept() for w in weights):
            # Cast since their last update already (this step's optimizer hook did it): nothing to do.
            # Versions move alike on every rank (the same updates), so every rank skips this all-reduce.
            continue
        kept = _KeptCasts.of(weights)
        if kept is None:
            for w in weights:  # last step's payloads: dropped before the new ones are made (one byte per element)
                w._drop_stale()
        amax = shard_amaxes([w._tensor for w in weights], [w._param_dtype for w in weights])
        amax = _reduce_max_eager(amax, mesh, tuple(range(mesh.ndim)))
        if kept is not None:
            kept.cast(weights, amax)
            continue
        kinds: dict = {}  # one scale computation per (fp8 dtype, power of 2) over all its weights
        for i, w in enumerate(weights):
            kinds.setdefault((w._plan.output.b.dtype, w._plan.output.b.pow2_scales), []).append(i)
        for (dtype, pow2), rows in kinds.items():
            # slices, not an index list (whose copy to the device would wait for the GPU)
            picked = amax if len(kinds) == 1 else torch.stack([amax[i] for i in rows])
            # one row of 4 per scale: each scale 16-byte aligned, as cuBLASLt wants its scale pointers
            scales = compute_scale(picked.reshape(-1, 1).expand(-1, 4).contiguous(), dtype, pow2)
            _cast_kept([weights[i] for i in rows], scales)
    return covered


def _precompute_casts(weights: list) -> int:
    """Every cast of ``weights`` (those that are not one tensorwise cast: row-wise ``w`` and
    ``w_t``, blocks), cast and kept for the hooks as they would cast it themselves
    (``_keep_casts``), bitwise; the scales whose groups span ranks (row-wise ``w_t``'s columns)
    first, for every weight in one all-reduce per kind of reduction (``_reduce_scales``).
    Row-wise weights whose shard the fused kernels take read it twice in all, not once per
    cast and copy: one pass for the row and column amaxes (``_row_col_amaxes``), one that writes
    both casts (``_cast_rows_cols``); the same bits as ``_keep_casts`` (its slow twin).
    Weights whose kept casts are current are skipped (every rank alike: versions move alike).
    Returns the number of weights covered (those gathered under FSDP2 once: their sharding is
    known)."""
    ready = [w for w in weights if "_sharding_kept" in w.__dict__]  # else its hook casts itself
    stale = [w for w in ready if not w._payloads_kept()]
    for w in stale:  # last step's casts: dropped before the new ones are made
        w._drop_stale()
    paired = [w for w in stale if _casts_in_one_read(w)]
    _reduce_scales(stale, _row_col_amaxes(paired))
    _cast_rows_cols(paired)
    for w in stale:  # the casts not made above (current ones are skipped), as the hook makes them
        w._keep_casts()
    return len(ready)


def _casts_in_one_read(w) -> bool:
    """Whether ``w``'s two casts are made from one read of its shard by the fused kernels: a
    row-wise weight (``w`` per row, ``w_t`` per column) whose shard they take (a contiguous 2-D
    bf16 / fp32 tensor on CUDA), cast in its own dtype or, an fp32 master, rounded to bf16 in the
    kernel (the param dtype FSDP2 casts it to)."""
    casts = w._weight_casts()
    if len(casts) != 2:
        return False
    (_, rows), (_, cols) = casts
    t, param_dtype = w._tensor, w._param_dtype
    return (isinstance(rows.granularity, AxisWise) and rows.granularity.axis in (-1, 1)
            and isinstance(cols.granularity, AxisWise) and cols.granularity.axis in (0, -2)
            and use_kernels(t, rows)
            and (t.dtype == param_dtype or (t.dtype == torch.float32 and param_dtype == torch.bfloat16)))


def _row_col_amaxes(weights: list) -> dict:
    """The row and column amaxes of each of ``weights``' shards (``_casts_in_one_read``), from one
    read of it (``kernels.amax_rows_cols``), in one buffer zeroed once per device: ``{(id(w),
    cast name): amax}`` for both casts, shaped like their scales. Of the shard as it is:
    ``_padded_amaxes`` rounds them to the param dtype (rounding is monotonic)."""
    from .. import kernels as kernel_ops

    out: dict = {}
    by_device: dict = {}
    for w in weights:
        by_device.setdefault(w._tensor.device, []).append(w)
    for device, group in by_device.items():
        sizes = [sum(w._tensor.shape) for w in group]
        buf = torch.zeros(sum(sizes), device=device, dtype=torch.float32)
        for w, part in zip(group, buf.split(sizes)):
            (row_name, _), (col_name, _) = w._weight_casts()
            out[(id(w), row_name)], out[(id(w), col_name)] = kernel_ops.amax_rows_cols(w._tensor, out=part)
    return out


def _cast_rows_cols(weights: list) -> None:
    """Both casts of each of ``weights`` (``_casts_in_one_read``) with the scales ``_reduce_scales``
    kept, from one read of the shard (``kernels.cast_rows_cols``; an fp32 master rounded to bf16
    in the kernel, no bf16 copy), kept for the all-gathers: bitwise the hook's ``_cast_shard``."""
    from .. import kernels as kernel_ops

    for w in weights:
        (row_name, row_spec), (col_name, col_spec) = w._weight_casts()
        row_scale, col_scale = w._scales[row_name][1], w._scales[col_name][1]
        round_to = _rounding(w)
        rows, cols = kernel_ops.cast_rows_cols(w._tensor, row_scale, row_spec, col_scale, col_spec, round_to=round_to)
        w._keep_cast(row_name, row_scale, rows)
        w._keep_cast(col_name, col_scale, cols)


def _reduce_scales(weights: list, made: dict) -> None:
    """The scales of the casts that the pre-all-gather hooks would reduce over ranks (a row-wise
    weight's ``w_t``: each column spans FSDP2's row shards; under TP a row-parallel weight's
    rows too), for every weight in one all-reduce per kind of reduction instead of one per weight
    in its hook; and of the casts whose amaxes ``made`` holds (``_row_col_amaxes``), those within
    the shard too (no collective: one scale computation for all). Kept (``_scales``) for
    ``_keep_casts``, ``_cast_rows_cols`` and the hooks while the weight is unchanged. The same
    bits: MAX is exact, and the amax of the fp32 master rounded to the param dtype is the amax
    of the rounded shard (rounding is monotonic)."""
    pending: dict = {}  # the reductions (mesh, mesh dims) in order -> [(weight, cast name, spec, amax)]
    for w in weights:
        sharding, version, shape = w.__dict__["_sharding_kept"][2], w.weight_version(), tuple(w._tensor.shape)
        for name, spec in w._weight_casts():
            reductions = tuple((sh.mesh, dims) for sh in sharding
                               if (dims := tuple(d for d in sh.amax_mesh_dims(spec.granularity, shape)
                                                 if sh.mesh.size(d) > 1)))
            amax, current = made.get((id(w), name)), w._scales.get(name)
            if (not reductions and amax is None) or (current is not None and current[0] == version):
                continue
            if amax is None:
                amax = amax_for_cast(w._tensor, spec.granularity)
            pending.setdefault(reductions, []).append((w, name, spec, amax))
    for reductions, entries in pending.items():
        flat, offsets = _padded_amaxes(entries)
        for mesh, dims in reductions:
            flat = _reduce_max_eager(flat, mesh, dims)
        scales = _scales_of(flat, entries, offsets)
        for (w, name, _, amax), scale in zip(entries, scales):
            w._scales[name] = (w.weight_version(), scale.view(amax.shape))


def _padded_amaxes(entries: list) -> tuple[torch.Tensor, list[int]]:
    """The amaxes of ``entries`` in one float32 vector, each rounded to its weight's param dtype
    (what the hook's shard holds; NaN canonical) and starting at a multiple of 4 elements (so each scale made
    from it is 16-byte aligned, as cuBLASLt wants its scale pointers); with each one's offset.
    One rounding and one copy for all (not one per weight) where the param dtypes agree."""
    rounds = [_rounding(w) for w, *_ in entries]
    once = len(set(rounds)) == 1
    pad = entries[0][3].new_zeros(3, dtype=torch.float32)
    parts, offsets, at = [], [], 0
    for (_, _, _, amax), r in zip(entries, rounds):
        a = amax.reshape(-1).float() if once or r is None else amax.reshape(-1).to(r).float()
        parts.append(a)
        offsets.append(at)
        at += a.numel()
        if at % 4:
            parts.append(pad[:4 - at % 4])
            at += 4 - at % 4
    flat = torch.cat(parts)
    if once and rounds[0] is not None:
        flat = flat.to(rounds[0]).float()
    # A NaN amax as the standard quiet NaN, as the amax kernels give it: rounding may change its
    # bits (the CPU's bf16 conversion makes it negative), and a cast reads the sign off its scale.
    return (_canonical_nan(flat) if any(r is not None for r in rounds) else flat), offsets


def _scales_of(flat: torch.Tensor, entries: list, offsets: list[int]) -> list[torch.Tensor]:
    """Each entry's scales (flat), from its amaxes at its offset in ``flat``: one ``compute_scale``
    for all where the casts agree on fp8 dtype and power-of-two scales (it is elementwise), else one each."""
    kinds = {(spec.dtype, spec.pow2_scales) for _, _, spec, _ in entries}
    if len(kinds) == 1:
        scales = compute_scale(flat, *kinds.pop())
        return [scales[o:o + a.numel()] for o, (*_, a) in zip(offsets, entries)]
    return [compute_scale(flat[o:o + a.numel()], spec.dtype, spec.pow2_scales)
            for o, (_, _, spec, a) in zip(offsets, entries)]


def _reduce_max_eager(t: torch.Tensor, mesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
    """All-reduce (MAX) ``t`` in place over ``mesh_dims`` of ``mesh`` through c10d: the optimizer
    step's precompute runs eagerly, where a functional collective costs the host about three
    times as much (an output copy and its wrapper; 0.5 against 0.16 ms on H200). The same NCCL /
    gloo reduction as ``fp8func._sharding.reduce_amax``, bitwise."""
    for d in mesh_dims:
        if mesh.size(d) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return t


def _rounding(w) -> torch.dtype | None:
    """The dtype ``w``'s shard is rounded to before its cast (FSDP2's param dtype), None where the
    shard is in it already."""
    return w._param_dtype if w._tensor.dtype != w._param_dtype else None


def _cast_many_takes(t: torch.Tensor, round_to: torch.dtype | None) -> bool:
    """Whether ``kernels.cast_many`` casts shard ``t`` rounded to ``round_to``: a contiguous 2-D
    tensor, cast as it is or an fp32 master rounded to bf16."""
    return (t.ndim == 2 and t.is_contiguous() and round_to in (None, torch.bfloat16)
            and (round_to is None or t.dtype == torch.float32))


def _cast_kept(weights: list, scales: torch.Tensor) -> None:
    """Casts each weight's shard with its row of ``scales`` (``[n, 4]``: the scale, then padding)
    and keeps scale and payload for its all-gathers. One kernel launch per kind of shard (its
    dtype and device, the param dtype it is rounded to) where the fused kernels apply
    (``kernels.cast_many``): a model's weights cast after each optimizer step with a few launches,
    not one each, so the host stays ahead of the GPU. Bitwise ``cast_with_scale`` per weight."""
    one = [row.reshape(1, 1) for row in scales[:, :1].split(1)]
    groups: dict = {}
    for i, w in enumerate(weights):
        t, spec, round_to = w._tensor, w._plan.output.b, _rounding(w)
        if use_kernels(t, spec) and _cast_many_takes(t, round_to):
            groups.setdefault((t.dtype, t.device, spec, round_to), []).append(i)
        else:
            data = cast_with_scale(t, one[i], spec, round_to=w._param_dtype).data
            w._keep_cast(w._weight_casts()[0][0], one[i], data)
    for (_, _, spec, round_to), rows in groups.items():
        from .. import kernels as kernel_ops

        picked = scales if len(rows) == len(weights) else torch.stack([scales[i] for i in rows])
        datas = kernel_ops.cast_many([weights[i]._tensor for i in rows], picked, spec, round_to=round_to)
        for i, data in zip(rows, datas):
            weights[i]._keep_cast(weights[i]._weight_casts()[0][0], one[i], data)
    for w in weights:
        w._kept_gathers()


class _KeptCasts:
    """The tensorwise weights of one FSDP2 mesh cast into the same memory at every step: one
    float32 ``[n, 4]`` buffer of scales (each 16-byte aligned) and one fp8 buffer of payloads, with
    each weight's ``_scales`` entry ``[version, scale, payload]`` (views of them) made once and
    updated in place. The all-gather inputs and metadata each weight's hook hands FSDP2 are made
    from those views once (``Fp8AllGatherWeight._keep_entry``) and stay current: a step builds no
    Python objects per weight but its version, so the garbage collector finds no per-step
    objects to promote (a model's worth of them at every step would bring a full collection every
    few steps).
    The same bits as ``_cast_kept``: the same scales, ``kernels.cast_many`` with ``out=`` (its
    reference twin where the fused kernels do not apply: ``cast_with_scale``'s graph ops).

    Kept on each weight (``_kept_casts``) while the mesh group is the very same weights, in the
    same order, of the same shard shapes, dtypes and cast; any change makes a new one. A weight
    whose data is replaced (``param.data = ...``) drops it."""

    __slots__ = ("weights", "key", "scales", "payload", "entries", "name", "spec", "round_to", "impl")

    def __init__(self, weights: list, key: tuple, spec, round_to, kernels: bool):
        shard = weights[0]._tensor
        sizes = [w._tensor.numel() for w in weights]
        self.weights, self.key, self.spec, self.round_to = [weakref.ref(w) for w in weights], key, spec, round_to
        self.impl = "auto" if kernels else "reference"
        self.name = weights[0]._weight_casts()[0][0]
        self.scales = torch.ones(len(weights), 4, dtype=torch.float32, device=shard.device)
        self.payload = torch.empty(sum(sizes), dtype=spec.dtype, device=shard.device)
        # each scale (1, 1) as _cast_kept makes it (its strides are what compiled code guards on)
        ones = [row.reshape(1, 1) for row in self.scales[:, :1].split(1)]
        self.entries = [[None, one, piece.view(w._tensor.shape)]
                        for w, one, piece in zip(weights, ones, self.payload.split(sizes))]

    @classmethod
    def of(cls, weights: list) -> "_KeptCasts | None":
        """The kept buffers of ``weights`` (one FSDP2 mesh's tensorwise weights, each with one cast),
        made where missing or changed; None where they differ in cast, dtype, device or rounding
        (``_precompute`` then casts them as ``_cast_kept`` does: the same bits, new tensors and
        objects at every step), said once on the ``fp8func`` logger at INFO."""
        spec, first, round_to = weights[0]._plan.output.b, weights[0]._tensor, _rounding(weights[0])
        kernels = use_kernels(first, spec)
        for i, w in enumerate(weights):
            t = w._tensor
            differs = ("cast spec" if w._plan.output.b != spec else "dtype" if t.dtype != first.dtype
                       else "device" if t.device != first.device else "rounding" if _rounding(w) != round_to
                       else "layout" if not _cast_many_takes(t, round_to)
                       else "kernels" if use_kernels(t, spec) != kernels else None)
            if differs is not None:
                warn_once(("kept casts", differs),
                          "fp8func: precompute_scales casts the %d tensorwise weights of one FSDP2 mesh without "
                          "its kept buffers (weight %d differs from the first in its %s): the same bits, with "
                          "new tensors at every step. Weights of one recipe and dtype per mesh keep them.",
                          len(weights), i, differs, level=logging.INFO)
                return None
        key = (spec, first.dtype, round_to, kernels, tuple(tuple(w._tensor.shape) for w in weights))
        kept = weights[0].__dict__.get("_kept_casts")
        if (kept is None or kept.key != key or len(kept.weights) != len(weights)
                or not all(r() is w and w.__dict__.get("_kept_casts") is kept for r, w in zip(kept.weights, weights))):
            for w in weights:  # the casts kept before: dropped before new buffers are made
                w._drop_stale()
                w.__dict__.pop("_kept_casts", None)
            kept = cls(weights, key, spec, round_to, kernels)
            for w in weights:
                w._kept_casts = kept
        return kept

    def cast(self, weights: list, amax: torch.Tensor) -> None:
        """Every weight (those ``of`` was given) cast with the scale of its ``amax`` (reduced over
        the mesh) into the kept buffers, and each entry marked current."""
        from .. import kernels as kernel_ops

        self.scales.copy_(compute_scale(amax.reshape(-1, 1).expand(-1, 4), self.spec.dtype, self.spec.pow2_scales))
        kernel_ops.cast_many([w._tensor for w in weights], self.scales, self.spec, round_to=self.round_to,
                             out=self.payload, impl=self.impl)
        for w, entry in zip(weights, self.entries):
            entry[0] = w.weight_version()
            w._keep_entry(self.name, entry)


class _AfterStep:
    """The optimizer step post-hook that precomputes the scales of the FSDP2 fp8 weights an
    optimizer holds (``precompute_after_optimizer_step``); registered with torch.optim at the first
    fp8 all-gather, for every optimizer of the process."""

    enabled = True
    handle = None

    @classmethod
    def register(cls) -> None:
        if cls.handle is None:
            cls.handle = register_optimizer_step_post_hook(cls.hook)

    @classmethod
    def hook(cls, optimizer, args, kwargs) -> None:
        if cls.enabled:
            _precompute(p for group in optimizer.param_groups for p in group["params"])


def register_after_step() -> None:
    """Registers ``_AfterStep`` with torch.optim, once per process (the pre-all-gather hooks call
    it: from the first fp8 all-gather on, every optimizer step precomputes)."""
    _AfterStep.register()


def precompute_after_optimizer_step(enabled: bool = True) -> bool:
    """Sets whether every ``torch.optim`` optimizer's ``step()`` ends with ``precompute_scales`` over
    the FSDP2 fp8 all-gather weights it holds (on by default); returns the previous setting.

    FSDP2 shards a model's weights the same way on every rank and every rank steps its optimizer
    together, so the one all-reduce this makes is matched on every rank. Turn it off only where an
    optimizer steps on some ranks and not on others (then call ``precompute_scales`` yourself, or
    leave the hooks to reduce each weight's amax at its all-gather: the same numbers, bitwise).
    """
    previous, _AfterStep.enabled = _AfterStep.enabled, bool(enabled)
    return previous


def shard_amaxes(shards: list[torch.Tensor], dtypes: list[torch.dtype]) -> torch.Tensor:
    """``max |shard.to(dtype)|`` of each shard (0 for an empty one), float32 ``[n]``: the amax of
    exactly what ``fsdp_pre_all_gather`` casts.

    From one multi-tensor pass over the shards as they are (``_foreach_norm`` with ``ord=inf``):
    rounding to ``dtype`` is monotone and symmetric, so the largest magnitude,
    rounded, is the largest of the rounded magnitudes, bitwise; inf comes through, NaN as the
    canonical NaN (0x7FC00000, as the amax kernels give it). ``shard_amaxes_reference`` is its
    slow twin.
    """
    full = [t for t in shards if t.numel()]  # the inf norm of an empty tensor raises: 0 for those
    norms = iter(torch._foreach_norm(full, math.inf) if full else ())
    # .float() is exact: a shard's own dtype widens to float32
    out = [next(norms).float() if t.numel() else t.new_zeros((), dtype=torch.float32) for t in shards]
    if len(set(dtypes)) == 1:
        return _canonical_nan(torch.stack(out).to(dtypes[0]).float())
    return _canonical_nan(torch.stack([a.to(d).float() for a, d in zip(out, dtypes)]))


def shard_amaxes_reference(shards: list[torch.Tensor], dtypes: list[torch.dtype]) -> torch.Tensor:
    """``shard_amaxes``, one shard at a time: cast, abs, amax."""
    return _canonical_nan(torch.stack([t.to(d).abs().amax().float() if t.numel()
                                       else t.new_zeros((), dtype=torch.float32)
                                       for t, d in zip(shards, dtypes)]))


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
