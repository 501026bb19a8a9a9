"""The amax kernels: tensorwise (flat) and per row / per column (2-D).

- ``_amax_flat_kernel``: a grid-stride loop over all elements, then one atomic max per program
  (``amax(x, TensorWise())``), or one stored maximum per program for a consumer that reduces
  them itself (the tensorwise quantize's cast: no zeroed buffer, so no fill launch).
- ``_amax_2d_kernel``: row and/or column maxima of ``[M, K]`` in one read, by atomics per row
  and per column (``amax(x, AxisWise(...))``, the row-wise quantize with a transposed copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._configs import Config
from ._triton_device import amax_bits, anchor

__all__ = ["amax_programs", "launch_amax_2d", "launch_amax_flat"]

AMAX_FLAT_PROGRAMS = 528  # grid cap of the flat amax: 4 programs per SM of an H100 / H200
AMAX_2D_ROWS = 128  # rows one program of the 2-D amax walks (and carries its column maxima over)


@triton.jit
def _amax_flat_kernel(x_ptr, anchor_ptr, out_ptr, N, STEP, BLOCK: tl.constexpr, PARTIAL: tl.constexpr):
    # Grid-stride loop (STEP = programs * BLOCK): one atomic max per program into out[0] (zeroed
    # by the caller), or with PARTIAL one plain store per program into out[pid] (no zeroing: the
    # consumer reduces the partial maxima itself, see _cast_kernel's NPART).
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, N, STEP):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        acc = tl.maximum(acc, amax_bits(x))
    if PARTIAL:
        tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + tl.program_id(0), tl.max(acc, 0))
    else:
        tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), tl.max(acc, 0), sem="relaxed")


@triton.jit
def _amax_2d_kernel(x_ptr, anchor_ptr, rows_ptr, cols_ptr, M, K, M_CHUNK: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # One program: BK columns of M_CHUNK rows, in [BM, BK] tiles. Each tile's row maxima go out
    # by atomics at once; the column maxima are carried over the chunk, one atomic per column.
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_k * BK + tl.arange(0, BK)
    cmask = cols < K
    cacc = tl.zeros([BK], dtype=tl.int32)
    for m0 in range(pid_m * M_CHUNK, pid_m * M_CHUNK + M_CHUNK, BM):
        rows = m0 + tl.arange(0, BM)
        rmask = rows < M
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0)
        bits = amax_bits(x)
        if ROWS:
            tl.atomic_max(rows_ptr.to(tl.pointer_type(tl.int32)) + rows, tl.max(bits, 1),
                          mask=rmask, sem="relaxed")
        if COLS:
            cacc = tl.maximum(cacc, tl.max(bits, 0))
    if COLS:
        tl.atomic_max(cols_ptr.to(tl.pointer_type(tl.int32)) + cols, cacc, mask=cmask, sem="relaxed")


def amax_programs(n: int, cfg: Config) -> int:
    """Programs of the flat amax over ``n`` elements (the length of its partial-maxima output)."""
    return max(1, min(triton.cdiv(n, cfg.bk), AMAX_FLAT_PROGRAMS))


def launch_amax_flat(x: torch.Tensor, out: torch.Tensor, cfg: Config, partial: bool = False) -> None:
    """``out`` (fp32, zero) <- max |x| over all elements; with ``partial``, ``out``
    (``amax_programs`` fp32 slots, any contents) <- each program's maximum, as int32 bits."""
    n = x.numel()
    if n:
        programs = amax_programs(n, cfg)
        wrap_triton(_amax_flat_kernel)[(programs,)](x, anchor(x), out, n, programs * cfg.bk, BLOCK=cfg.bk,
                                                    PARTIAL=partial, num_warps=cfg.warps, num_stages=cfg.stages)


def launch_amax_2d(x: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, cfg: Config) -> None:
    """``rows`` [M] / ``cols`` [K] (fp32, zero) <- row / column max |x|."""
    m, k = x.shape
    if x.numel():
        chunk = max(cfg.bm, AMAX_2D_ROWS // cfg.bm * cfg.bm)
        grid = (triton.cdiv(k, cfg.bk), triton.cdiv(m, chunk))
        dummy = rows if rows is not None else cols
        wrap_triton(_amax_2d_kernel)[grid](
            x, anchor(x), dummy if rows is None else rows, dummy if cols is None else cols, m, k,
            M_CHUNK=chunk, ROWS=rows is not None, COLS=cols is not None, BM=cfg.bm, BK=cfg.bk,
            num_warps=cfg.warps, num_stages=cfg.stages)
