"""Expert parallel: each rank of a mesh dimension owns ``E / P`` experts; tokens travel to them.

Per MoE layer and rank (tokens already sorted by global expert):

    counts [E]  --all-to-all-->  counts this rank's experts receive from each rank  (int64)
    tokens      --quantize row-wise, all-to-all as uint8 rows [fp8 payload | fp32 scale bytes]-->
                dequantize, reorder to expert-major  -->  local experts (grouped GEMMs)
    outputs     --reorder back, all-to-all in the activation dtype (bf16)-->  the sending rank

The dispatch cast is the forward GEMM's own input cast (one scale per token along H), and with
power-of-two scales the dequantized values re-quantize to themselves: the experts' forward is
bitwise what a high-precision dispatch would give, for half the bytes (plus 4 per token). The
backward moves gradients in the activation dtype, treating the cast as the identity, like every
FP8 cast of the library. Split sizes are exchanged first and read on the host (eager only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._ops import dequantize, quantize
from .._qtensor import Fp8Meta, Fp8Tensor
from .._scaling import AxisWise, CastSpec

__all__ = ["ExpertParallel", "DispatchPlan", "dispatch", "combine", "parallelize_experts"]


@dataclass(frozen=True)
class ExpertParallel:
    """Experts split evenly over ``mesh_dim`` of ``mesh``: rank ``r`` owns experts ``[r*E/P, (r+1)*E/P)``."""

    mesh: DeviceMesh
    mesh_dim: int = 0

    @property
    def size(self) -> int:
        return self.mesh.size(self.mesh_dim)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank(self.mesh_dim)

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor, spec: "CastSpec | None"):
        """``dispatch(x, counts, self, spec)``: what an expert-parallel MoE layer calls (the shell
        holds this object and never imports the distributed layer)."""
        return dispatch(x, counts, self, spec)

    def combine(self, y: torch.Tensor, plan: "DispatchPlan") -> torch.Tensor:
        """``combine(y, plan, self)``."""
        return combine(y, plan, self)


@dataclass(frozen=True)
class DispatchPlan:
    """How one dispatch moved rows, so that ``combine`` sends every output back where it came from.

    Attributes:
        send_splits: rows this rank sent to each rank. recv_splits: rows it received from each.
        order: received-row index of each row of the expert-major local layout.
        inverse: local-layout index of each received row.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    order: torch.Tensor
    inverse: torch.Tensor


def _all_to_all(t: torch.Tensor, out_splits, in_splits, ep: ExpertParallel) -> torch.Tensor:
    out = funcol.all_to_all_single(t.contiguous(), list(out_splits), list(in_splits), (ep.mesh, ep.mesh_dim))
    return funcol.wait_tensor(out)


class _AllToAllFn(torch.autograd.Function):
    """Rows moved between ranks; the backward moves the gradients back the same way."""

    @staticmethod
    def forward(x, out_splits, in_splits, ep):
        return _all_to_all(x, out_splits, in_splits, ep)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.out_splits, ctx.in_splits, ctx.ep = inputs

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.in_splits, ctx.out_splits, ctx.ep), None, None, None


class _Fp8AllToAllFn(torch.autograd.Function):
    """Rows cast row-wise to FP8 and moved as bytes ``[H payload | 4 scale]``, dequantized on arrival.

    Backward: the gradient travels back in its own dtype (the cast's gradient is the identity).
    """

    @staticmethod
    def forward(x, spec, out_splits, in_splits, ep):
        q = quantize(x, spec)  # [n, H], scale [n, 1]
        h = x.shape[1]
        rows = torch.cat([q.data.view(torch.uint8), q.scale.contiguous().view(torch.uint8)], dim=1)
        got = _all_to_all(rows, out_splits, in_splits, ep)
        data = got[:, :h].contiguous().view(spec.dtype)
        scale = got[:, h:].contiguous().view(torch.float32)
        return dequantize(Fp8Tensor(data, scale, Fp8Meta(spec, x.dtype, None)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.out_splits, ctx.in_splits, ctx.ep = inputs

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.in_splits, ctx.out_splits, ctx.ep), None, None, None, None


def _exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """``[P, E/P]``: how many rows each rank sends to each of this rank's experts."""
    e, p = counts.numel(), ep.size
    if e % p:
        raise ValueError(f"expert parallel: {e} experts do not split over {p} ranks; use E divisible by the EP degree.")
    got = _all_to_all(counts.to(torch.int64), [e // p] * p, [e // p] * p, ep)
    return got.view(p, e // p)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Received-row index of each row once rows are reordered from (rank, expert) to (expert, rank)."""
    lengths = recv.flatten()  # arrival order: rank-major
    starts = (torch.cumsum(lengths, 0) - lengths).view_as(recv)
    seg_len, seg_start = recv.t().flatten(), starts.t().flatten()  # wanted order: expert-major
    total = int(lengths.sum())
    seg_offset = torch.cumsum(seg_len, 0) - seg_len
    within = torch.arange(total, device=recv.device) - torch.repeat_interleave(seg_offset, seg_len, output_size=total)
    return torch.repeat_interleave(seg_start, seg_len, output_size=total) + within


def dispatch(
    x: torch.Tensor, counts: torch.Tensor, ep: ExpertParallel, spec: CastSpec | None
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Sends rows of ``x`` (sorted by global expert, ``counts[e]`` rows each) to the experts' owners.

    With ``spec`` (row-wise, ``AxisWise(-1)``) rows travel as FP8 bytes plus one fp32 scale each;
    with None in ``x``'s dtype. Returns ``(x_local, offs_local, plan)``: the rows this rank's
    experts process, expert-major, in ``x``'s dtype; their int32 group ends; the plan for ``combine``.
    """
    if spec is not None and (not isinstance(spec, CastSpec) or spec.granularity not in (AxisWise(-1), AxisWise(1))):
        raise ValueError(f"dispatch: spec={spec!r}; the FP8 dispatch casts one scale per token: AxisWise(-1).")
    recv = _exchange_counts(counts, ep)
    send_splits = tuple(int(s) for s in counts.view(ep.size, -1).sum(1).tolist())
    recv_splits = tuple(int(s) for s in recv.sum(1).tolist())
    if spec is None:
        got = _AllToAllFn.apply(x, recv_splits, send_splits, ep)
    else:
        got = _Fp8AllToAllFn.apply(x, spec, recv_splits, send_splits, ep)
    order = _expert_major(recv)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offs = torch.cumsum(recv.sum(0), 0, dtype=torch.int32)
    return got[order], offs, DispatchPlan(send_splits, recv_splits, order, inverse)


def combine(y: torch.Tensor, plan: DispatchPlan, ep: ExpertParallel) -> torch.Tensor:
    """Returns the experts' outputs ``y`` (local, expert-major) to the ranks that sent the tokens,
    in ``y``'s dtype: the inverse of ``dispatch`` on rows."""
    return _AllToAllFn.apply(y[plan.inverse], plan.send_splits, plan.recv_splits, ep)


EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def parallelize_experts(moe: nn.Module, mesh: DeviceMesh, mesh_dim: int = 0) -> nn.Module:
    """Keeps this rank's ``E / P`` experts of ``moe`` (``fp8func.nn.MoE`` / ``Fp8MoE``); returns it.

    The expert weights become this rank's slice along dim 0; the router and every other
    parameter stay replicated, and their gradients must be summed over ``mesh_dim`` like data
    parallel ones (ranks see different tokens). Call before building the optimizer.

    Example:
        >>> mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("ep",))
        >>> parallelize_experts(model.layers[0].mlp, mesh)
    """
    if not all(isinstance(getattr(moe, n, None), torch.Tensor) for n in EXPERT_PARAMS) or not hasattr(moe, "ep"):
        raise TypeError(f"parallelize_experts: {type(moe).__name__} is not an fp8func.nn.MoE / Fp8MoE.")
    if moe.ep is not None:
        raise ValueError("parallelize_experts: this MoE is already expert-parallel; call it once per module.")
    ep = ExpertParallel(mesh, mesh_dim)
    e = moe.w_gate.shape[0]
    if e % ep.size:
        raise ValueError(f"parallelize_experts: {e} experts do not split over {ep.size} ranks of mesh dim {mesh_dim}.")
    lo, hi = ep.rank * e // ep.size, (ep.rank + 1) * e // ep.size
    for name in EXPERT_PARAMS:
        p = getattr(moe, name)
        setattr(moe, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
    moe.ep = ep
    return moe
