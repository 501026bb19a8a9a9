"""DTensor operands of the core FP8 op: the answers this layer registers with ``fp8func._hooks``.

The core op imports nothing of DTensor or FSDP2; it asks ``fp8func._hooks`` whether a tensor is
distributed, for its full values, for an eager cast of its local shard, and how the backward
reads a cast made elsewhere. ``DTENSOR_HOOKS`` answers for DTensor (and for the casts FSDP2
refills before the backward); ``fp8func.distributed`` registers it when imported.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import kernels
from .._casts import cast, use_kernels
from .._formats import tracing
from .._hooks import DistributedHooks
from .._qtensor import Fp8Meta, Fp8Tensor
from .._scaling import CastSpec, TensorWise, raw_block_lengths, scale_shape
from .._sharding import Sharding

__all__ = ["DTENSOR_HOOKS", "cast_dtensor", "full_tensor", "is_dtensor", "read_given"]


def is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's values (a state or an amax is the same on every rank), or ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dtensor_kernels(t, spec: CastSpec, transpose: bool, kernels: str) -> bool:
    """Whether an eager cast of DTensor ``t`` runs the kernels on its local shard (``_cast_dtensor``).

    Eager only: compiled, inductor fuses the DTensor casts into the graph around them. Shard /
    Replicate placements (a Partial tensor's amax says nothing about the sum's); a transposed
    copy for tensorwise only (the other granularities take other groups for ``t.T``)."""
    if not isinstance(t, DTensor) or tracing() or (transpose and not isinstance(
            spec.granularity, TensorWise)):
        return False
    if not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
        return False
    return use_kernels(t.to_local(), spec, kernels)


def _cast_dtensor(t, spec: CastSpec, transpose: bool, kernels: str) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """``cast`` of a DTensor: its local shard through the kernels with the amax reduced over the
    mesh dims that split a scale group, rewrapped with the placements ``quantize`` gives (data as
    ``t``; a scale split like the data where its groups lie within shards, else replicated)."""
    local, mesh = t.to_local(), t.device_mesh
    sharding = Sharding(mesh, tuple(t.placements))  # amax_mesh_dims raises for a block straddling shards
    q, q_t = cast(local, spec, transpose, sharding=(sharding,), kernels=kernels)

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


def cast_dtensor(t, spec: CastSpec, transpose: bool, kernels: str) -> tuple[Fp8Tensor, Fp8Tensor | None] | None:
    """``fp8func._casts.cast`` of DTensor ``t`` through the kernels on its local shard, or None
    where the generic path casts it (not a DTensor, compiled, no kernel for it)."""
    if not _dtensor_kernels(t, spec, transpose, kernels):
        return None
    return _cast_dtensor(t, spec, transpose, kernels)


@torch.library.custom_op("fp8func::read_in_backward", mutates_args=())
def _read_in_backward(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A copy of the 2-D ``t`` made once ``grad`` exists: in the backward, never hoisted into the
    forward. Column-major, the layout in which the grad_input GEMM reads it as ``b`` (scaled_mm
    would copy a row-major one again); transposed by tiles (``kernels.transpose``) where it can."""
    if t.is_contiguous() and t.element_size() in (1, 2, 4):
        return kernels.transpose(t).t()
    return t.t().contiguous().t()


@_read_in_backward.register_fake
def _(t, grad):
    return t.new_empty_strided(tuple(t.shape), (1, t.shape[0]))


def read_given(t: torch.Tensor, grad_scale: torch.Tensor) -> torch.Tensor:
    """A weight cast FSDP2 fills only before the backward (row-wise ``w_t`` under
    ``reshard_after_forward``: the forward's all-gather carried ``w``; FSDP2 refills the buffer,
    which the autograd context holds, in its pre-backward hook), read no earlier than that.

    Eager, the backward reads the saved tensor when it runs, after the refill. Compiled,
    AOTAutograd's partitioner may compute an op that depends only on forward inputs in the
    forward graph and save its result, since nothing in the graph says the buffer changes in
    between; it would then read the forward's ``w`` bytes with ``w_t``'s scales. An opaque op
    that also takes something of the gradient cannot run before the gradient exists. It takes the
    grad_output cast's scale, an fp32 tensor the GEMM reads anyway (given ``dy`` itself, inductor
    would store the bf16 ``dy`` that it otherwise fuses unrounded into the cast).
    """
    if not tracing():
        return t
    dep = grad_scale.to_local() if isinstance(grad_scale, DTensor) else grad_scale
    if isinstance(t, DTensor):
        # shape and stride given: computing them is a graph break (torch._C's global tensor info)
        return DTensor.from_local(_read_in_backward(t.to_local(), dep), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=(1, t.shape[0]))
    return _read_in_backward(t, dep)


DTENSOR_HOOKS = DistributedHooks(is_distributed=is_dtensor, full_tensor=full_tensor, cast=cast_dtensor,
                                 read_given=read_given)
