"""Delayed scaling across data-parallel ranks: one scaling state for all of them."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from .._sharding import Sharding

__all__ = ["share_scaling_state"]


def share_scaling_state(model: nn.Module, mesh: DeviceMesh, mesh_dim: int = 0) -> int:
    """Makes every delayed-scaling ``Fp8Linear`` of ``model`` record the amaxes of its input and
    grad_output reduced (MAX) over ``mesh``'s dim ``mesh_dim`` (the data-parallel ranks, each
    with its own batch), so all ranks cast with the same scales and hold the same state (which a
    checkpoint stores once). Weights need no reduction: FSDP2 unshards them before the cast.
    Returns the number of layers set. Call it after ``convert``, with the mesh of ``fully_shard``.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"share_scaling_state: mesh={mesh!r}; expected a torch.distributed DeviceMesh.")
    placements = tuple(Shard(0) if d == mesh_dim else Replicate() for d in range(mesh.ndim))
    n = 0
    for m in model.modules():
        buffers = getattr(m, "scaling_buffers", None)  # a delayed-scaling Fp8Linear's
        if buffers is not None:
            buffers.set_amax_sharding(Sharding(mesh, placements))
            n += 1
    if n == 0:
        raise ValueError("share_scaling_state: no delayed-scaling Fp8Linear in the model; convert it with "
                         "recipe='delayed' first.")
    return n
