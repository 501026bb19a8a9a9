"""Collectives over ``Fp8Tensor``: fp8 payloads travel as uint8 bytes (gloo and NCCL alike)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ._qtensor import Fp8Tensor
from ._scaling import block_lengths
from ._sharding import Sharding

__all__ = ["all_gather", "gather_sizes"]


# torch 2.13 deprecates all_gather_tensor for all_gather_single, which torch 2.11 does not have.
_all_gather_dim0 = getattr(funcol, "all_gather_single", None)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """Functional all-gather along dim 0, on every torch this supports (traceable by dynamo)."""
    if _all_gather_dim0 is not None:
        return _all_gather_dim0(t, 0, group)
    return funcol.all_gather_tensor(t, 0, group)


def gather_rows(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """All-gather ``t`` along dim 0 over ``mesh_dim`` (equal shards, more than one rank) as one
    ``all_gather_into_tensor`` and one ``wait_tensor``, nothing between: the graph inductor's
    micro-pipeline TP pass (async TP) splits into chunks that overlap with the GEMMs reading it.

    An fp8 ``t`` travels as itself where the backend moves fp8 dtypes (``moves_fp8``: NCCL), which
    the fused all-gather-matmul needs (it hands the shard it gathers to ``_scaled_mm``), and as
    uint8 bytes elsewhere (gloo has no fp8 dtypes)."""
    payload = t if t.element_size() != 1 or moves_fp8(t) else t.view(torch.uint8)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(payload.contiguous(), mesh.size(mesh_dim),
                                                                 mesh.get_group(mesh_dim).group_name)
    out = torch.ops._c10d_functional.wait_tensor(gathered)
    return out if payload is t else out.view(t.dtype)


def moves_fp8(t: torch.Tensor) -> bool:
    """Whether the collectives of ``t``'s device move fp8 dtypes: CUDA's NCCL does (as bytes);
    gloo, the CPU's backend, has no fp8 dtypes."""
    return t.device.type == "cuda"


def gather_sizes(local: int, mesh: DeviceMesh, mesh_dim: int) -> list[int]:
    """Every rank's local size along a dim (one tiny all-gather; eager only; none on a one-rank mesh dim)."""
    if mesh.size(mesh_dim) == 1:
        return [local]
    t = torch.tensor([local], dtype=torch.int64, device=mesh.device_type)
    return [int(s) for s in funcol.wait_tensor(_all_gather(t, (mesh, mesh_dim))).tolist()]


def gather_padded(t: torch.Tensor, dim: int, sizes: list[int], mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """All-gather ``t`` along ``dim`` where rank r holds ``sizes[r]`` rows: pad, gather, trim. A
    one-rank mesh dim runs no collective: its gather is ``t`` itself."""
    if mesh.size(mesh_dim) == 1:
        if list(sizes) != [t.shape[dim]]:
            raise ValueError(f"gather over one rank: sizes {sizes} must be [{t.shape[dim]}], this rank's length "
                             f"along dim {dim}.")
        return t
    t = t.movedim(dim, 0)
    pad = max(sizes) - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    out = funcol.wait_tensor(_all_gather(t.contiguous(), (mesh, mesh_dim)))
    if any(s != sizes[0] for s in sizes):
        out = torch.cat([c[:s] for c, s in zip(out.split(max(sizes)), sizes)])
    return out.movedim(0, dim)


def all_gather(
    q: Fp8Tensor,
    mesh: DeviceMesh,
    mesh_dim: int = 0,
    dim: int = 0,
    *,
    sizes: list[int] | None = None,
) -> Fp8Tensor:
    """Gathers the shards of ``q`` along tensor dim ``dim`` over mesh dim ``mesh_dim``.

    The payload moves as uint8. Scales that are split along ``dim`` (one per row, per block)
    are gathered with it; a scale that spans ``dim`` must already be the logical tensor's
    (quantize the shard with ``sharding=``) and is kept. Uneven and empty shards work: ``sizes``
    gives each rank's length along ``dim`` (exchanged with a tiny all-gather when omitted).

    Example:
        >>> shard_q = f8.quantize(shard, spec, sharding=f8.Sharding(mesh, (Shard(0),)))
        >>> full_q = f8.all_gather(shard_q, mesh, mesh_dim=0, dim=0)   # == f8.quantize(full, spec)
    """
    if not isinstance(q, Fp8Tensor):
        raise TypeError(f"all_gather: expected an Fp8Tensor, got {type(q).__name__}.")
    dim = dim % q.ndim
    b = block_lengths(q.granularity, tuple(q.shape))[dim]
    sharding = q.meta.sharding
    if b is None and (sharding is None or sharding.mesh != mesh
                      or sharding.placements[mesh_dim] != Shard(dim)):
        raise ValueError(
            f"all_gather: one {q.granularity!r} scale spans dim {dim}, so every shard must carry the "
            f"logical tensor's scale, but this Fp8Tensor's sharding is {sharding}. Quantize the shard "
            f"with sharding=fp8func.Sharding(mesh, placements) where mesh dim {mesh_dim} is Shard({dim})."
        )
    if sizes is None:
        sizes = gather_sizes(q.shape[dim], mesh, mesh_dim)
    data = gather_padded(q.data.view(torch.uint8), dim, sizes, mesh, mesh_dim).view(q.dtype)
    if b is None:
        scale = q.scale
    else:
        if any(s % b for s in sizes):
            raise ValueError(f"all_gather: shard sizes {sizes} along dim {dim} are not multiples of block {b}.")
        scale = gather_padded(q.scale, dim, [s // b for s in sizes], mesh, mesh_dim)
    meta = dataclasses.replace(q.meta, sharding=_gathered(sharding, mesh, mesh_dim))
    return Fp8Tensor(data, scale, meta)


def _gathered(sharding: Sharding | None, mesh: DeviceMesh, mesh_dim: int) -> Sharding | None:
    if sharding is None:
        return None
    placements = list(sharding.placements)
    placements[mesh_dim] = Replicate()
    if all(isinstance(p, Replicate) for p in placements):
        return None
    return Sharding(mesh, tuple(placements))
