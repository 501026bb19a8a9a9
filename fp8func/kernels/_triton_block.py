"""The one-pass quantize kernels, where a scale group fits one program: amax, scale and cast.

- ``_quant_kernel``: ``[BM, BK]`` tiles, each tile row one group (whole rows for AxisWise(-1),
  1x128 blocks) or the tile one group (128x128 blocks).
- ``_quant_t_kernel``: the block groups with the transposed copy. One ``128 x 128`` tile per
  program, walked twice in slabs so that no thread holds the whole tile: first by ``[128, CH]``
  column slabs (the rows' maxima; for 1x128 groups also the columns' scales and the transposed
  cast, since a column slab holds whole 128x1 groups), then by ``[CH, 128]`` row slabs re-read
  from cache (evict-last loads, then evict-first) with the row scales read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._configs import Config
from ._triton_device import abs_bits, anchor, consts, recip, saturate, scale_of, transposed

__all__ = ["MAX_ROW_K", "launch_quant", "launch_quant_t", "rowwise_tile"]

MAX_ROW_K = 16384  # widest row the one-pass row-wise kernel keeps in registers


@triton.jit
def _quant_kernel(x_ptr, anchor_ptr, data_ptr, scale_ptr, M, K, s0, s1, TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr,
                  FP8_MAX: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # TILE_GROUP: the tile is one group (128x128): scale[pid_m, pid_k]. Else each tile row is one
    # group (a whole row, or 1x128): scale[m, pid_k].
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    row_bits = tl.max(abs_bits(x), 1)
    if TILE_GROUP:  # every row's amax raised to the tile's: the tile's scale as a vector, one per row
        row_bits = tl.maximum(row_bits, tl.max(row_bits, 0))
    s = scale_of(row_bits.to(tl.float32, bitcast=True), INV_MAX, POW2)
    if TILE_GROUP:  # all rows hold the tile's scale: the first row writes it
        tl.store(scale_ptr + pid_m * s0 + pid_k * s1 + rows * 0, s, mask=rows == pid_m * BM)
    else:
        tl.store(scale_ptr + rows * s0 + pid_k * s1, s, mask=rmask)
    y = saturate(x, recip(s)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)


@triton.jit
def _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr, M, K, t0, t1,
                  TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                  B: tl.constexpr, CH: tl.constexpr, RAW_T: tl.constexpr):
    """``_quant_t_kernel``'s first walk, one ``[B, CH]`` column slab: the rows' running maxima,
    and for 1x128 groups the slab's column scales and its transposed cast (the columns' groups)."""
    cols = pid_k * B + c0 + tl.arange(0, CH)
    cmask = cols < K
    x_raw = tl.load(x_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0,
                    eviction_policy="evict_last")
    x = x_raw.to(tl.float32)
    bits = abs_bits(x)
    row_bits = tl.maximum(row_bits, tl.max(bits, 1))
    if not TILE_GROUP:
        st = scale_of(tl.max(bits, 0).to(tl.float32, bitcast=True), INV_MAX, POW2)
        tl.store(scale_t_ptr + cols * t0 + pid_m * t1, st, mask=cmask)
        y_t = saturate(transposed(x, x_raw, RAW_T), recip(st)[:, None], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])
    return row_bits


@triton.jit
def _t_second_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K, s0, s1,
                   TILE_GROUP: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                   RAW_T: tl.constexpr):
    """The second walk, one ``[CH, B]`` row slab: the row-major cast with the row scales read
    back (and for 128x128 groups the transposed cast too)."""
    rs = pid_m * B + r0 + tl.arange(0, CH)
    rsmask = rs < M
    mask = rsmask[:, None] & cmask[None, :]
    if TILE_GROUP:
        sc = tl.load(scale_ptr + pid_m * s0 + pid_k * s1 + rs * 0)
    else:
        sc = tl.load(scale_ptr + rs * s0 + pid_k * s1, mask=rsmask, other=1.0)
    x_raw = tl.load(x_ptr + rs.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first")
    x = x_raw.to(tl.float32)
    y = saturate(x, recip(sc)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rs.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TILE_GROUP:
        y_t = saturate(transposed(x, x_raw, RAW_T), recip(sc)[None, :], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rs[None, :], y_t,
                 mask=cmask[:, None] & rsmask[None, :])


@triton.jit
def _quant_t_kernel(x_ptr, anchor_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, K, s0, s1, t0, t1,
                    TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                    POW2: tl.constexpr, B: tl.constexpr, CH: tl.constexpr, UNROLL: tl.constexpr = 0,
                    RAW_T: tl.constexpr = False):
    # One B x B tile (B = 128, the group length along both axes) in two walks. 1x128 (not
    # TILE_GROUP): the first walk casts x.T (a column slab holds whole 128x1 groups) while the
    # rows' maxima accumulate; the second casts the rows. 128x128: the first walk only reduces;
    # the second casts once and stores the bytes both ways.
    # UNROLL 0: the walks unrolled (static_range); else tl.range loops unrolled UNROLL times,
    # which Triton lowers with less shared-memory traffic (Config.unroll).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * B + tl.arange(0, B)
    rmask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    row_bits = tl.zeros([B], dtype=tl.int32)
    if UNROLL == 0:
        for c0 in tl.static_range(0, B, CH):
            row_bits = _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr,
                                     M, K, t0, t1, TILE_GROUP, INV_MAX, FP8_MAX, POW2, B, CH, RAW_T)
    else:
        for c0 in tl.range(0, B, CH, loop_unroll_factor=UNROLL):
            row_bits = _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr,
                                     M, K, t0, t1, TILE_GROUP, INV_MAX, FP8_MAX, POW2, B, CH, RAW_T)
    if TILE_GROUP:  # every row holds the tile's maximum (a vector, as in _quant_kernel)
        row_bits = tl.maximum(row_bits, tl.max(row_bits, 0))
    s = scale_of(row_bits.to(tl.float32, bitcast=True), INV_MAX, POW2)
    if TILE_GROUP:
        first = rows == pid_m * B
        tl.store(scale_ptr + pid_m * s0 + pid_k * s1 + rows * 0, s, mask=first)
        tl.store(scale_t_ptr + pid_k * t0 + pid_m * t1 + rows * 0, s, mask=first)
    else:
        tl.store(scale_ptr + rows * s0 + pid_k * s1, s, mask=rmask)
    tl.debug_barrier()  # the scales stored above, visible to every thread of the program
    cols = pid_k * B + tl.arange(0, B)
    cmask = cols < K
    if UNROLL == 0:
        for r0 in tl.static_range(0, B, CH):
            _t_second_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K,
                           s0, s1, TILE_GROUP, FP8_MAX, B, CH, RAW_T)
    else:
        for r0 in tl.range(0, B, CH, loop_unroll_factor=UNROLL):
            _t_second_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K,
                           s0, s1, TILE_GROUP, FP8_MAX, B, CH, RAW_T)


def launch_quant(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, tile_group: bool, pow2: bool,
                 bm: int, bk: int, cfg: Config) -> None:
    """One-pass amax + cast with ``bm x bk`` tiles, each tile row (or the tile) one group."""
    m, k = x.shape
    if not x.numel():
        return
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    wrap_triton(_quant_kernel)[grid](
        x, anchor(x), data, scale, m, k, scale.stride(0), scale.stride(1), TILE_GROUP=tile_group,
        **consts(data.dtype, pow2), BM=bm, BK=bk, num_warps=cfg.warps, num_stages=cfg.stages)


def launch_quant_t(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor,
                   scale_t: torch.Tensor, tile_group: bool, pow2: bool, cfg: Config, block: int = 128) -> None:
    """One-pass block quantize of ``x`` and ``x.T``, the ``block x block`` tile walked in
    ``cfg.bk``-wide slabs."""
    m, k = x.shape
    if not x.numel():
        return
    if (cfg.bm, block % cfg.bk) != (block, 0):
        raise ValueError(f"launch_quant_t: {cfg} on {block}x{block} tiles; use bm={block} and a bk dividing it.")
    grid = (triton.cdiv(m, block), triton.cdiv(k, block))
    wrap_triton(_quant_t_kernel)[grid](
        x, anchor(x), data, scale, data_t, scale_t, m, k, scale.stride(0), scale.stride(1), scale_t.stride(0),
        scale_t.stride(1), TILE_GROUP=tile_group, **consts(data.dtype, pow2), B=block, CH=cfg.bk,
        UNROLL=cfg.unroll, RAW_T=cfg.raw_t, num_warps=cfg.warps, num_stages=cfg.stages)


def rowwise_tile(k: int, cfg: Config) -> tuple[int, int]:
    """(rows per program, padded row) of the one-pass row-wise kernel for rows of ``k``."""
    bk = triton.next_power_of_2(k)
    return max(1, cfg.bm // bk), bk
