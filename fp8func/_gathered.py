"""A tensor that exists only as its FP8 casts (gathered elsewhere), for ``linear`` to consume.

FSDP2's fp8 weight all-gather and the sequence-parallel fp8 activation / grad_output gathers
produce it. It sits below the autograd layer so that ``linear``'s backward can recognise a
grad_output that arrives as gathered casts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._qtensor import Fp8Tensor

__all__ = ["Fp8GatheredWeight", "casts_only", "gathered_casts"]

aten = torch.ops.aten


def casts_only(t) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) exists only as its casts. A type test that
    dynamo answers from the traced value, also for one made inside the compiled region (whose
    casts dynamo cannot read: ``linear`` reads them inside its op)."""
    return isinstance(t.to_local() if isinstance(t, DTensor) else t, Fp8GatheredWeight)


def gathered_casts(t) -> dict[str, Fp8Tensor] | None:
    """The casts of ``t`` when it exists only as casts, else None.

    For a DTensor whose local tensor is such a tensor, the casts come back as DTensors on its
    mesh: data placed like it, each scale sharded where it has one entry per row/block and
    replicated where it spans the dim. A 2-D cast of an ``[..., F]`` holder sharded along its last
    dim (a TP-local cast of a ``Shard(-1)`` activation) is sharded along its last dim; its scale,
    each rank's own, is placed as replicated: every rank's GEMM reads the scale it holds.
    """
    local = t._local_tensor if isinstance(t, DTensor) else t
    if not isinstance(local, Fp8GatheredWeight):
        return None
    if local is t:
        return local.casts
    mesh = t.device_mesh
    out = {}
    for name, q in local.casts.items():
        placements = tuple(t.placements)
        if q.ndim != t.ndim:
            if any(isinstance(p, Shard) and p.dim % t.ndim != t.ndim - 1 for p in placements):
                raise ValueError(f"fp8func: the {name!r} cast has rank {q.ndim}, its holder rank {t.ndim}, "
                                 f"sharded {placements}: only a holder sharded along its last dim maps onto it.")
            placements = tuple(Shard(q.ndim - 1) if isinstance(p, Shard) else p for p in placements)
        scale_placements = tuple(
            Replicate() if isinstance(p, Shard) and q.scale.shape[p.dim] == 1 else p for p in placements
        )
        data = DTensor.from_local(q.data, mesh, placements, run_check=False)
        scale = DTensor.from_local(q.scale, mesh, scale_placements, run_check=False)
        out[name] = Fp8Tensor(data, scale, q.meta)
    return out


class Fp8GatheredWeight(torch.Tensor):
    """A gathered tensor that exists only as its FP8 casts: the unsharded weight FSDP2 builds from
    fp8 payloads, or a sequence-parallel input ``Fp8ColwiseParallel`` gathered. Only
    ``Fp8Linear`` consumes it."""

    @staticmethod
    def __new__(cls, casts: dict[str, Fp8Tensor], shape, dtype, valid=None):
        device = next(iter(casts.values())).data.device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __init__(self, casts, shape, dtype, valid=None):
        self.set_casts(casts, tuple(casts) if valid is None else valid)

    @property
    def casts(self) -> dict[str, Fp8Tensor]:
        return self._casts

    @property
    def valid(self) -> tuple[str, ...]:
        """The casts whose payload this all-gather carried (the others share its buffer and are
        filled by the other pass: FSDP2 refills the same storage before the backward)."""
        return self._valid

    def set_casts(self, casts: dict[str, Fp8Tensor], valid: tuple[str, ...]) -> None:
        # Inner tensors are attributes too: subclass flattening (dynamo, AOTAutograd) reads them so.
        self._casts = casts
        self._valid = tuple(valid)
        for name, q in casts.items():
            setattr(self, f"_{name}_data", q.data)
            setattr(self, f"_{name}_scale", q.scale)
        self._flat = None  # __tensor_flatten__'s answer for these casts, made at its first call

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return cls(self._casts, self.shape, self.dtype, self._valid)
        if func in (aten.as_strided.default, aten.view.default):
            size = args[1]
            same_layout = func is aten.view.default or (
                tuple(args[2]) == self.stride() and (len(args) < 4 or args[3] in (0, None)))
            if tuple(size) == tuple(self.shape) and same_layout:
                return cls(self._casts, self.shape, self.dtype, self._valid)
        raise RuntimeError(
            f"fp8func: {func} was called on a tensor that exists only as its FP8 casts (a weight FSDP2 "
            "all-gathered in FP8, or an input Fp8ColwiseParallel gathered); only Fp8Linear can consume "
            "it. If another module uses this weight (tied embeddings, custom code), convert the layer "
            "with fsdp_fp8_all_gather=False or exclude it with convert(filter=...); for an input, use "
            "the stock ColwiseParallel on layers whose input other code also reads."
        )

    def __tensor_flatten__(self):
        # Kept until the casts change: a compiled function's guards flatten every input of this
        # type twice at every call.
        if self._flat is None:
            names = [f"_{name}_{part}" for name in self._casts for part in ("data", "scale")]
            ctx = tuple((name, q.meta) for name, q in self._casts.items())
            self._flat = (names, (ctx, tuple(self.shape), self.dtype, self._valid))
        names, ctx = self._flat
        return list(names), ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        metas, shape, dtype, valid = ctx
        casts = {name: Fp8Tensor(inner[f"_{name}_data"], inner[f"_{name}_scale"], meta) for name, meta in metas}
        return Fp8GatheredWeight(casts, shape, dtype, valid)

    def __repr__(self):
        return (f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, casts={list(self._casts)}, "
                f"valid={list(self._valid)})")


