"""Pure-PyTorch twins of the Triton kernels: the same signatures, obviously right.

Each one is a call into ``fp8func``'s own quantization (``compute_amax``, ``quantize``,
``quantize_with_scale``); the Triton kernels in ``_triton_quant`` must match them bitwise.
Inputs are validated by the dispatcher (``fp8func.kernels``) before either is called.
"""

from __future__ import annotations

import torch

from .._ops import quantize as _quantize
from .._ops import quantize_with_scale as _quantize_with_scale
from .._scaling import AxisWise, CastSpec, Granularity, TensorWise, compute_amax

__all__ = ["amax", "amax_rows_cols", "cast", "cast_amax", "cast_rows_cols", "quantize"]


def amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-group ``max(|x|)`` in fp32, shaped like the scale; a NaN group gives 0x7FC00000.

    The payload of a NaN that torch's reductions return is unspecified (CUDA gives 0x7FFFFFFF for
    fp32 inputs, 0x7FC00000 for bf16), so both implementations return the standard quiet NaN.
    """
    a = compute_amax(x, granularity)
    return torch.where(a.isnan(), 0x7FC00000, a.view(torch.int32)).view(torch.float32)


def cast(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, scale_t: torch.Tensor | None, round_to=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` cast with ``scale``; with ``scale_t`` also ``x.T`` (contiguous ``[K, M]``) cast with it.
    ``round_to``: ``x.to(round_to)`` is what is cast."""
    if round_to is not None:
        x = x.to(round_to)
    data = _quantize_with_scale(x, scale, spec).data
    if scale_t is None:
        return data, None
    return data, _quantize_with_scale(x.t().contiguous(), scale_t, spec).data


def amax_rows_cols(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:M]`` <- ``amax(x, AxisWise(-1))``, ``out[M:]`` <- ``amax(x, AxisWise(0))`` (float32 ``[M + K]``)."""
    m = x.shape[0]
    out[:m].copy_(amax(x, AxisWise(-1)).reshape(-1))
    out[m:].copy_(amax(x, AxisWise(0)).reshape(-1))


def cast_rows_cols(x: torch.Tensor, row_scale: torch.Tensor, row_spec: CastSpec, col_scale: torch.Tensor,
                   col_spec: CastSpec, round_to=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast with its row scales and, into a second ``[M, K]`` payload, with its column scales.
    ``round_to``: ``x.to(round_to)`` is what is cast."""
    if round_to is not None:
        x = x.to(round_to)
    return _quantize_with_scale(x, row_scale, row_spec).data, _quantize_with_scale(x, col_scale, col_spec).data


def transpose(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()``."""
    return x.t().contiguous()


def cast_many(xs: list[torch.Tensor], scales: torch.Tensor, spec: CastSpec, round_to=None,
              out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[cast(x, scales[i:i + 1, :1], spec, None, round_to)[0] for i, x in enumerate(xs)]``, written
    into consecutive pieces of ``out`` where given."""
    casts = [cast(x, scales[i:i + 1, :1], spec, None, round_to)[0] for i, x in enumerate(xs)]
    if out is None:
        return casts
    views, at = [], 0
    for q in casts:
        views.append(out[at:at + q.numel()].view(q.shape).copy_(q))
        at += q.numel()
    return views


def cast_amax(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Tensorwise ``cast(x, scale, spec, scale if transpose else None)`` and ``amax(x)`` ``(1, 1)``."""
    data, data_t = cast(x, scale, spec, scale if transpose else None)
    return data, data_t, amax(x, TensorWise())


def quantize(
    x: torch.Tensor, spec: CastSpec, transpose: bool, fuse_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(data, scale, data_t, scale_t)`` of ``quantize(x)`` and, if asked, ``quantize(x.T.contiguous())``.
    ``fuse_amax`` (where the amax runs) changes no bit."""
    q = _quantize(x, spec)
    if not transpose:
        return q.data, q.scale, None, None
    q_t = _quantize(x.t().contiguous(), spec)
    return q.data, q.scale, q_t.data, q_t.scale
