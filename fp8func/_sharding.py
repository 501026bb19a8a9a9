"""``Sharding``: how a local tensor relates to the logical one, and which amaxes that couples.

A scale group that is split across ranks needs its amax reduced (MAX, exact: max is
associative) over exactly the mesh dimensions that split it, and no others. This is read from
an explicit ``Sharding``, never guessed from ``dist.is_initialized()`` or from whether a tensor
happens to be a DTensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ._scaling import Granularity, block_lengths, raw_block_lengths

__all__ = ["Sharding", "reduce_amax"]


@dataclass(frozen=True)
class Sharding:
    """A device mesh and one placement per mesh dimension (DTensor's vocabulary).

    ``Shard(d)`` on mesh dim ``i``: the logical tensor is split along its dim ``d`` over the
    ranks of mesh dim ``i`` (``torch.chunk`` sizes, as DTensor and FSDP2 use); ``Replicate()``:
    every rank holds the same values.

    Example:
        >>> mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("dp",))
        >>> q = f8.quantize(local_shard, spec, sharding=f8.Sharding(mesh, (Shard(0),)))
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self):
        if isinstance(self.mesh, torch.fx.Proxy):
            # torch.compile records a Sharding handed to fp8func's op as a graph node over its mesh
            # (a graph input); the compiled code builds it again from the real mesh, checked then.
            return
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"Sharding(mesh={self.mesh!r}): expected a torch.distributed DeviceMesh.")
        placements = tuple(self.placements)
        if len(placements) != self.mesh.ndim:
            raise ValueError(
                f"Sharding: {len(placements)} placements {placements} for a {self.mesh.ndim}-dim mesh; "
                "give exactly one placement (Shard(d) or Replicate()) per mesh dimension."
            )
        for p in placements:
            if isinstance(p, Partial):
                raise ValueError(
                    "Sharding: a Partial() placement holds partial sums, whose amax says nothing about "
                    "the sum's; reduce it first (DTensor.redistribute to Replicate/Shard), then quantize."
                )
            if not isinstance(p, (Shard, Replicate)):
                raise TypeError(f"Sharding: placement {p!r} is not Shard(d) or Replicate().")
        object.__setattr__(self, "placements", placements)

    @staticmethod
    def of(dtensor: DTensor) -> "Sharding":
        """The sharding of a DTensor (its mesh and placements)."""
        if not isinstance(dtensor, DTensor):
            raise TypeError(f"Sharding.of: expected a DTensor, got {type(dtensor).__name__}.")
        return Sharding(dtensor.device_mesh, tuple(dtensor.placements))

    def transpose(self, ndim: int, dim0: int, dim1: int) -> "Sharding":
        """The sharding of the transposed tensor (Shard dims swapped)."""
        swap = {dim0 % ndim: dim1 % ndim, dim1 % ndim: dim0 % ndim}
        placements = tuple(
            Shard(swap.get(p.dim % ndim, p.dim % ndim)) if isinstance(p, Shard) else p for p in self.placements
        )
        return Sharding(self.mesh, placements)

    def sharded_dims(self, ndim: int) -> dict[int, int]:
        """``{mesh_dim: tensor_dim}`` for every mesh dimension that shards the tensor."""
        return {i: p.dim % ndim for i, p in enumerate(self.placements) if isinstance(p, Shard)}

    def amax_mesh_dims(self, granularity: Granularity, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Mesh dims over which an amax of ``granularity`` must be reduced, for this local shard.

        A mesh dim needs the reduction when it splits a tensor dim along which one scale spans the
        whole dimension (tensorwise; the reduced axis of AxisWise). A block that lies wholly
        inside each shard needs none; a block that would straddle shards is an error.
        """
        blocks = raw_block_lengths(granularity, local_shape)
        dims = []
        for mesh_dim, tdim in self.sharded_dims(len(local_shape)).items():
            b = blocks[tdim]
            if b is None:
                dims.append(mesh_dim)
            elif local_shape[tdim] % b:
                raise ValueError(
                    f"{granularity!r} on a tensor sharded along dim {tdim} over mesh dim {mesh_dim}: "
                    f"the local size {local_shape[tdim]} is not a multiple of block {b}, so a block "
                    "straddles two ranks. Shard in multiples of the block (tensor parallel: a degree that "
                    "leaves each shard a multiple of it; FSDP2: shard_placement_fn), or use a recipe "
                    "without blocks along this dim (e.g. 'rowwise')."
                )
        block_lengths(granularity, local_shape)  # the unsharded dims must tile too
        return tuple(dims)


def check_blocks_within_shards(x: DTensor, granularity: Granularity) -> None:
    """Raises if a scale block of ``granularity`` would straddle two shards of DTensor ``x``."""
    placements = tuple(p if isinstance(p, Shard) else Replicate() for p in x.placements)
    Sharding(x.device_mesh, placements).amax_mesh_dims(granularity, tuple(x.to_local().shape))


def reduce_amax(amax: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
    """All-reduce (MAX) ``amax`` over ``mesh_dims`` of ``mesh``; traceable by dynamo. A mesh dim
    of one rank needs no collective (e.g. FSDP2 over a one-rank dp dim under TP)."""
    mesh_dims = tuple(d for d in mesh_dims if mesh.size(d) > 1)
    for mesh_dim in mesh_dims:
        amax = funcol.all_reduce(amax, "max", (mesh, mesh_dim))
    if mesh_dims:
        amax = funcol.wait_tensor(amax)
    return amax
