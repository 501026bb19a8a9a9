"""Triton kernels for amax, cast (+ transpose) and fused quantize; twins in ``_reference``.

Imported lazily by the dispatcher, only where Triton is installed. Five kernels:

- ``_amax_flat_kernel``: tensorwise amax, a grid-stride loop and one atomic max per program.
- ``_amax_2d_kernel``: row and/or column amax of ``[M, K]`` (atomic max per row / column).
- ``_cast_kernel``: cast with given scales (or scales made from amax in the same program),
  optionally also writing the transposed copy from the same tile, and optionally each tile's
  amax (delayed scaling: the cast and the next step's amax from one read of ``x``).
- ``_quant_kernel``: one pass where a scale group fits in one program: whole rows
  (AxisWise(-1)), 1x128 blocks (and their 128x1 transposed blocks), 128x128 blocks.
- ``_quant_t_kernel``: the block groups with the transposed copy, one ``128 x 128`` tile per
  program walked twice in slabs (the second walk re-reads ``x`` from cache), so that no thread
  holds the whole tile: 1.05-1.1x (1x128) and 1.3x (128x128) faster than ``_quant_kernel``'s
  (docs/kernels.md, session 8); 1x128 walks as loops in 2 warps, another 1.07x (session 9: 3x
  less shared-memory traffic under ncu; still latency-bound at 12.5% occupancy).

Numerics mirror ``fp8func.quantize`` exactly (see ``fp8func/_scaling.py``): amax is a max over
the int32 bit patterns of ``|x|`` (monotonic for non-negative floats, NaN above inf, exact and
associative, so atomics are safe); ``scale = max(amax, EPS) * (1/fp8_max)`` with NaN
propagated; the power-of-two round-up by the same bit trick; ``1/scale`` as a correctly rounded
fp32 division (what the twin's fp64 quotient rounds to); ``clamp(x * recip, ±max)`` cast to fp8
with round-to-nearest-even.
Each public function is a ``torch.library.triton_op``, so ``torch.compile`` traces into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from fp8func._formats import fp8_max
from fp8func._scaling import EPS, AxisWise, CastSpec, Granularity, TensorWise, compute_scale

__all__ = ["Config", "CONFIGS", "amax", "cast", "cast_amax", "quantize"]

MAX_ROW_K = 16384  # widest row the one-pass row-wise kernel keeps in registers
EPS_F32 = tl.constexpr(EPS)  # rounded to fp32 where used, as torch's clamp(min=EPS) does


@dataclass(frozen=True)
class Config:
    """Launch parameters of one kernel route (chosen by the sweep in ``_sweep.py``).

    ``bm, bk``: tile rows and columns (row-wise one pass: ``bm`` is the target elements per
    program and ``bk`` is the padded row). ``programs``: grid cap of the flat amax.
    ``m_chunk``: rows per program of the 2-D amax. ``amax_out``: how the cast with amax
    (``cast_amax``) leaves its partial maxima: 1 one per tile, 2 one per tile row, 3 one per
    tile column (the reductions a tile needs differ in cost beside the transposed store).
    ``chunk`` (the block routes with a transposed copy): 0 keeps the whole ``128 x 128`` tile in
    registers (``_quant_kernel``); else ``_quant_t_kernel`` walks the tile twice in ``[128, chunk]``
    column slabs (the second walk re-reads them from cache), ``order`` 1 walks the second time in
    ``[chunk, 128]`` row slabs instead, ``evict`` marks the first walk's loads evict-last and the
    second's evict-first. ``unroll``: 0 unrolls the walks (``tl.static_range``), else they are
    ``tl.range`` loops unrolled ``unroll`` times (1x128+T under ncu: the same registers and
    occupancy, 3x fewer shared-memory stores and 4x fewer bank conflicts, 1.07x faster).
    ``raw_t``: the transposed copy is cast from the loaded tile transposed in the input dtype and
    upcast afterwards (bf16 crosses shared memory in 2 bytes, not 4; the upcast is exact, so the
    bits are the same), instead of from the transposed fp32 tile.
    """

    bm: int
    bk: int
    warps: int
    stages: int = 1
    programs: int = 0
    m_chunk: int = 0
    amax_out: int = 1
    chunk: int = 0
    order: int = 0
    evict: bool = False
    unroll: int = 0
    raw_t: bool = False


CONFIGS: dict[str, Config] = {  # winners of the sweep on an H200 (docs/kernels.md)
    "amax_flat": Config(bm=1, bk=16384, warps=16, stages=1, programs=528),
    "amax_2d": Config(bm=8, bk=1024, warps=4, stages=1, m_chunk=128),
    "cast": Config(bm=8, bk=1024, warps=8),
    "cast_t": Config(bm=64, bk=256, warps=8),
    "cast_amax": Config(bm=32, bk=256, warps=8, amax_out=1),
    "cast_amax_t": Config(bm=64, bk=128, warps=4, amax_out=1, raw_t=True),
    "cast_block": Config(bm=16, bk=128, warps=4),
    "cast_block_t": Config(bm=64, bk=64, warps=4, raw_t=True),
    "rowwise": Config(bm=4096, bk=0, warps=4),
    "block_1x128": Config(bm=16, bk=128, warps=4),
    "block_1x128_t": Config(bm=128, bk=128, warps=2, chunk=64, order=1, evict=True, unroll=1),
    "block_128": Config(bm=128, bk=128, warps=16),
    "block_128_t": Config(bm=128, bk=128, warps=4, chunk=64, order=1, evict=True),
}


# ---------------------------------------------------------------------------------------------
# Device helpers: the scalar math of fp8func._scaling, element for element.


@triton.jit
def _abs_bits(x):
    """``|x|`` as int32 bits: ordered like the floats, NaN above inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _canonical_nan(bits):
    """``|x|`` bits with every NaN as the standard quiet NaN 0x7FC00000 (see ``_reference.amax``)."""
    return tl.where(bits > 0x7F800000, 0x7FC00000, bits)


@triton.jit
def _amax_bits(x):
    """``_abs_bits`` with every NaN canonical."""
    return _canonical_nan(_abs_bits(x))


@triton.jit
def _scale_of(amax, INV_MAX: tl.constexpr, POW2: tl.constexpr):
    """``max(amax, EPS) * (1/fp8_max)``, NaN propagated; rounded up to 2**k if ``POW2``."""
    s = tl.maximum(amax, EPS_F32, propagate_nan=tl.PropagateNan.ALL) * INV_MAX
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        up = ((bits + 0x7FFFFF) & -0x800000).to(tl.float32, bitcast=True)
        s = tl.where((bits & 0x7F800000) != 0x7F800000, up, s)  # non-finite passes through
    return s


@triton.jit
def _recip(scale):
    """The correctly rounded fp32 ``1 / scale`` (IEEE ``div.rn``; Triton's ``/`` is approximate).

    Equal to ``_ops._reciprocal``'s fp64 quotient rounded to fp32: double rounding is harmless
    for a quotient when 53 >= 2 * 24 + 2.
    """
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _saturate(x, recip, FP8_MAX: tl.constexpr):
    """``clamp(x * recip, ±max)`` in fp32, NaN kept; the caller's ``.to(fp8)`` rounds to nearest even."""
    return tl.clamp(x * recip, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _transposed(x, x_raw, RAW_T: tl.constexpr):
    """``x.T`` in fp32: the fp32 tile transposed, or with ``RAW_T`` the raw (input dtype) tile
    transposed and then upcast (the same values: the upcast is exact; ``Config.raw_t``)."""
    if RAW_T:
        x_t = tl.trans(x_raw).to(tl.float32)
    else:
        x_t = tl.trans(x)
    return x_t


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _amax_flat_kernel(x_ptr, out_ptr, N, STEP, BLOCK: tl.constexpr, PARTIAL: tl.constexpr):
    # Grid-stride loop (STEP = programs * BLOCK): one atomic max per program into out[0] (zeroed
    # by the caller), or with PARTIAL one plain store per program into out[pid] (no zeroing: the
    # consumer reduces the partial maxima itself, see _cast_kernel's NPART).
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, N, STEP):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        acc = tl.maximum(acc, _amax_bits(x))
    if PARTIAL:
        tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + tl.program_id(0), tl.max(acc, 0))
    else:
        tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), tl.max(acc, 0), sem="relaxed")


@triton.jit
def _amax_2d_kernel(x_ptr, rows_ptr, cols_ptr, M, K, M_CHUNK: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
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
        bits = _amax_bits(x)
        if ROWS:
            tl.atomic_max(rows_ptr.to(tl.pointer_type(tl.int32)) + rows, tl.max(bits, 1),
                          mask=rmask, sem="relaxed")
        if COLS:
            cacc = tl.maximum(cacc, tl.max(bits, 0))
    if COLS:
        tl.atomic_max(cols_ptr.to(tl.pointer_type(tl.int32)) + cols, cacc, mask=cmask, sem="relaxed")


@triton.jit
def _cast_kernel(x_ptr, data_ptr, sa_ptr, sa_out_ptr, data_t_ptr, sb_ptr, sb_out_ptr,
                 M, K, sa0, sa1, sb0, sb1,
                 A_M: tl.constexpr, A_K: tl.constexpr, B_K: tl.constexpr, B_M: tl.constexpr,
                 FROM_AMAX: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                 POW2: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                 NPART: tl.constexpr = 0, NPART_P2: tl.constexpr = 1, amax_ptr=0,
                 AMAX_OUT: tl.constexpr = 0, RAW_T: tl.constexpr = False):
    # data[m, k] uses sa[(m // A_M) * sa0 + (k // A_K) * sa1], one value per tile row (the
    # launcher keeps a tile inside one K group); data_t[k, m] uses sb[(k // B_K) * sb0 +
    # (m // B_M) * sb1], one value per tile column. Whole-dimension groups have stride 0.
    # FROM_AMAX: sa / sb hold amax; the first program along the other axis writes the scales.
    # NPART (tensorwise, FROM_AMAX): sa holds the NPART per-program partial maxima (int32 bits)
    # of _amax_flat_kernel(PARTIAL); every program reduces them (a few KB, from L2).
    # AMAX_OUT: each program also stores max |x| of its tile (int32 bits, NaN canonical) for the
    # caller to reduce: 1 one value at amax_ptr[p], 2 one per tile row at amax_ptr[p * BM + r],
    # 3 one per tile column at amax_ptr[p * BK + c], with p = pid_m * num_programs(1) + pid_k.
    # RAW_T: the transposed copy from the raw tile transposed, then upcast (Config.raw_t).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    if AMAX_OUT > 0:
        out = amax_ptr.to(tl.pointer_type(tl.int32))
        p = (pid_m * tl.num_programs(1) + pid_k).to(tl.int64)
        # max over |x|'s bits, then NaN made canonical: the same as canonical bits' max (any NaN's
        # bits exceed inf's), one select per stored value instead of per element
        bits = _abs_bits(x)
        if AMAX_OUT == 1:
            tl.store(out + p, _canonical_nan(tl.max(tl.max(bits, 1), 0)))
        elif AMAX_OUT == 2:
            tl.store(out + p * BM + tl.arange(0, BM), _canonical_nan(tl.max(bits, 1)))
        else:
            tl.store(out + p * BK + tl.arange(0, BK), _canonical_nan(tl.max(bits, 0)))
    a_idx = (rows // A_M) * sa0 + (pid_k * BK // A_K) * sa1
    if NPART > 0:
        # The scalar maximum raised into a loaded vector (every partial is <= it), not broadcast
        # from a scalar: a broadcast scalar scale made Triton 3.6 miscompile the transposed fp8
        # store for fp32 inputs (the 128x128 path in _quant_kernel works around the same).
        part_ptr = sa_ptr.to(tl.pointer_type(tl.int32))
        parts = tl.arange(0, NPART_P2)
        amax_bits = tl.max(tl.load(part_ptr + parts, mask=parts < NPART, other=0), 0)
        sa = tl.maximum(tl.load(part_ptr + rows % NPART), amax_bits).to(tl.float32, bitcast=True)
    else:
        sa = tl.load(sa_ptr + a_idx, mask=rmask, other=1.0)
    if FROM_AMAX:
        sa = _scale_of(sa, INV_MAX, POW2)
        if pid_k == 0:
            tl.store(sa_out_ptr + a_idx, sa, mask=rmask)
    y = _saturate(x, _recip(sa)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TRANSPOSE:
        b_idx = (cols // B_K) * sb0 + (pid_m * BM // B_M) * sb1
        if NPART > 0:
            sb = tl.maximum(tl.load(part_ptr + cols % NPART), amax_bits).to(tl.float32, bitcast=True)
        else:
            sb = tl.load(sb_ptr + b_idx, mask=cmask, other=1.0)
        if FROM_AMAX:
            sb = _scale_of(sb, INV_MAX, POW2)
            if pid_m == 0:
                tl.store(sb_out_ptr + b_idx, sb, mask=cmask)
        # cast from the transposed tile, never by transposing the fp8 one (see _quant_t_kernel)
        y_t = _saturate(_transposed(x, x_raw, RAW_T), _recip(sb)[:, None], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])


@triton.jit
def _quant_kernel(x_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, K, s0, s1, t0, t1,
                  TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                  POW2: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  RAW_T: tl.constexpr = False):
    # TILE_GROUP: the tile is one group (128x128): scale[pid_m, pid_k] (and scale_t[pid_k, pid_m]).
    # Else each tile row is one group (a whole row, or 1x128): scale[m, pid_k]; with TRANSPOSE
    # (BM == 128) each tile column is one group of x.T too: scale_t[k, pid_m].
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    bits = _abs_bits(x)
    # 128x128 takes the row-group code with every row's (and column's) amax raised to the tile's:
    # a scale computed as a scalar and broadcast made Triton 3.6 miscompile the transposed fp8
    # store for fp32 inputs (3/8 of the bytes wrong on an H200); this form is the tested 1x128 one.
    row_bits = tl.max(bits, 1)
    if TILE_GROUP:
        tile_bits = tl.max(row_bits, 0)
        row_bits = tl.maximum(row_bits, tile_bits)
    s = _scale_of(row_bits.to(tl.float32, bitcast=True), INV_MAX, POW2)
    if TILE_GROUP:  # all rows hold the tile's scale: the first row writes it
        tl.store(scale_ptr + pid_m * s0 + pid_k * s1 + rows * 0, s, mask=rows == pid_m * BM)
    else:
        tl.store(scale_ptr + rows * s0 + pid_k * s1, s, mask=rmask)
    y = _saturate(x, _recip(s)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TRANSPOSE:
        col_bits = tl.max(bits, 0)
        if TILE_GROUP:
            col_bits = tl.maximum(col_bits, tile_bits)
        st = _scale_of(col_bits.to(tl.float32, bitcast=True), INV_MAX, POW2)
        if TILE_GROUP:
            tl.store(scale_t_ptr + pid_k * t0 + pid_m * t1 + cols * 0, st, mask=cols == pid_k * BK)
        else:
            tl.store(scale_t_ptr + cols * t0 + pid_m * t1, st, mask=cmask)
        y_t = _saturate(_transposed(x, x_raw, RAW_T), _recip(st)[:, None], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])


@triton.jit
def _load_x(ptrs, mask, EVICT: tl.constexpr):
    """``x`` in its own dtype (masked-off elements 0), with an L2 eviction hint: 1 evict-last,
    2 evict-first."""
    if EVICT == 1:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    elif EVICT == 2:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr, M, K, t0, t1,
                  TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                  B: tl.constexpr, CH: tl.constexpr, EVICT: tl.constexpr, RAW_T: tl.constexpr):
    """``_quant_t_kernel``'s first walk, one ``[B, CH]`` column slab: the rows' running maxima,
    and for 1x128 groups the slab's column scales and its transposed cast (the columns' groups)."""
    cols = pid_k * B + c0 + tl.arange(0, CH)
    cmask = cols < K
    x_raw = _load_x(x_rows + cols[None, :], rmask[:, None] & cmask[None, :], EVICT)
    x = x_raw.to(tl.float32)
    bits = _abs_bits(x)
    row_bits = tl.maximum(row_bits, tl.max(bits, 1))
    if not TILE_GROUP:
        st = _scale_of(tl.max(bits, 0).to(tl.float32, bitcast=True), INV_MAX, POW2)
        tl.store(scale_t_ptr + cols * t0 + pid_m * t1, st, mask=cmask)
        y_t = _saturate(_transposed(x, x_raw, RAW_T), _recip(st)[:, None], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])
    return row_bits


@triton.jit
def _t_second_col_slab(x_rows, rows, rmask, s, c0, pid_k, data_ptr, data_t_ptr, M, K,
                       TILE_GROUP: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                       EVICT: tl.constexpr, RAW_T: tl.constexpr):
    """The second walk by a ``[B, CH]`` column slab (order 0): the rows' cast (and 128x128's transposed one)."""
    cols = pid_k * B + c0 + tl.arange(0, CH)
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x_raw = _load_x(x_rows + cols[None, :], mask, EVICT)
    x = x_raw.to(tl.float32)
    y = _saturate(x, _recip(s)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TILE_GROUP:
        y_t = _saturate(_transposed(x, x_raw, RAW_T), _recip(s)[None, :], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])


@triton.jit
def _t_second_row_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K, s0, s1,
                       TILE_GROUP: tl.constexpr, FP8_MAX: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                       EVICT: tl.constexpr, RAW_T: tl.constexpr):
    """The second walk by a ``[CH, B]`` row slab (order 1), with the row scales read back."""
    rs = pid_m * B + r0 + tl.arange(0, CH)
    rsmask = rs < M
    mask = rsmask[:, None] & cmask[None, :]
    if TILE_GROUP:
        sc = tl.load(scale_ptr + pid_m * s0 + pid_k * s1 + rs * 0)
    else:
        sc = tl.load(scale_ptr + rs * s0 + pid_k * s1, mask=rsmask, other=1.0)
    x_raw = _load_x(x_ptr + rs.to(tl.int64)[:, None] * K + cols[None, :], mask, EVICT)
    x = x_raw.to(tl.float32)
    y = _saturate(x, _recip(sc)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rs.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TILE_GROUP:
        y_t = _saturate(_transposed(x, x_raw, RAW_T), _recip(sc)[None, :], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rs[None, :], y_t,
                 mask=cmask[:, None] & rsmask[None, :])


@triton.jit
def _quant_t_kernel(x_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, K, s0, s1, t0, t1,
                    TILE_GROUP: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                    POW2: tl.constexpr, B: tl.constexpr, CH: tl.constexpr, ORDER: tl.constexpr,
                    EVICT: tl.constexpr, UNROLL: tl.constexpr = 0, RAW_T: tl.constexpr = False):
    # One B x B tile (B = 128, the group length along both axes) in two walks of [B, CH] column
    # slabs, so no thread holds the whole tile. 1x128 (not TILE_GROUP): a slab holds whole
    # columns, so the first walk casts x.T (the columns' 128x1 groups) and stores it, while the
    # rows' maxima accumulate; the second walk (x again, from cache) casts the rows. 128x128:
    # the first walk only reduces; the second casts once and stores the bytes both ways.
    # ORDER 1: the second walk goes by [CH, B] row slabs, reading the row scales it just stored
    # (the only order the launcher allows with TILE_GROUP, see launch_quant_t).
    # UNROLL 0: the walks unrolled (static_range); else tl.range loops unrolled UNROLL times,
    # which Triton lowers with less shared-memory traffic (Config.unroll).
    # The transposed copy is always cast from the transposed fp32 slab: transposing the fp8 slab
    # (tl.trans of the cast) came out wrong for 3/8 of the bytes in several launch layouts on an
    # H200 (Triton 3.6; docs/kernels.md), while every transposed-first layout tested passed.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * B + tl.arange(0, B)
    rmask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    row_bits = tl.zeros([B], dtype=tl.int32)
    if UNROLL == 0:
        for c0 in tl.static_range(0, B, CH):
            row_bits = _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr,
                                     M, K, t0, t1, TILE_GROUP, INV_MAX, FP8_MAX, POW2, B, CH, EVICT, RAW_T)
    else:
        for c0 in tl.range(0, B, CH, loop_unroll_factor=UNROLL):
            row_bits = _t_first_slab(x_rows, rows, rmask, row_bits, c0, pid_m, pid_k, data_t_ptr, scale_t_ptr,
                                     M, K, t0, t1, TILE_GROUP, INV_MAX, FP8_MAX, POW2, B, CH, EVICT, RAW_T)
    if TILE_GROUP:  # every row holds the tile's maximum (the vector form, see _quant_kernel)
        row_bits = tl.maximum(row_bits, tl.max(row_bits, 0))
    s = _scale_of(row_bits.to(tl.float32, bitcast=True), INV_MAX, POW2)
    if TILE_GROUP:
        first = rows == pid_m * B
        tl.store(scale_ptr + pid_m * s0 + pid_k * s1 + rows * 0, s, mask=first)
        tl.store(scale_t_ptr + pid_k * t0 + pid_m * t1 + rows * 0, s, mask=first)
    else:
        tl.store(scale_ptr + rows * s0 + pid_k * s1, s, mask=rmask)
    if ORDER == 0:
        if UNROLL == 0:
            for c0 in tl.static_range(0, B, CH):
                _t_second_col_slab(x_rows, rows, rmask, s, c0, pid_k, data_ptr, data_t_ptr, M, K,
                                   TILE_GROUP, FP8_MAX, B, CH, EVICT * 2, RAW_T)
        else:
            for c0 in tl.range(0, B, CH, loop_unroll_factor=UNROLL):
                _t_second_col_slab(x_rows, rows, rmask, s, c0, pid_k, data_ptr, data_t_ptr, M, K,
                                   TILE_GROUP, FP8_MAX, B, CH, EVICT * 2, RAW_T)
    else:
        tl.debug_barrier()  # the scales stored above, visible to every thread of the program
        cols = pid_k * B + tl.arange(0, B)
        cmask = cols < K
        if UNROLL == 0:
            for r0 in tl.static_range(0, B, CH):
                _t_second_row_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K,
                                   s0, s1, TILE_GROUP, FP8_MAX, B, CH, EVICT * 2, RAW_T)
        else:
            for r0 in tl.range(0, B, CH, loop_unroll_factor=UNROLL):
                _t_second_row_slab(x_ptr, r0, pid_m, pid_k, cols, cmask, data_ptr, scale_ptr, data_t_ptr, M, K,
                                   s0, s1, TILE_GROUP, FP8_MAX, B, CH, EVICT * 2, RAW_T)


# ---------------------------------------------------------------------------------------------
# Launchers: plain functions (the sweep calls them with other configs), kernels via wrap_triton.


def _consts(dtype: torch.dtype, pow2: bool) -> dict:
    return {"INV_MAX": 1.0 / fp8_max(dtype), "FP8_MAX": fp8_max(dtype), "POW2": pow2}


def amax_programs(n: int, cfg: Config) -> int:
    """Programs of the flat amax over ``n`` elements (the length of its partial-maxima output)."""
    return max(1, min(triton.cdiv(n, cfg.bk), cfg.programs))


def launch_amax_flat(x: torch.Tensor, out: torch.Tensor, cfg: Config, partial: bool = False) -> None:
    """``out`` (fp32, zero) <- max |x| over all elements; with ``partial``, ``out``
    (``amax_programs`` fp32 slots, any contents) <- each program's maximum, as int32 bits."""
    n = x.numel()
    if n:
        programs = amax_programs(n, cfg)
        wrap_triton(_amax_flat_kernel)[(programs,)](x, out, n, programs * cfg.bk, BLOCK=cfg.bk, PARTIAL=partial,
                                                    num_warps=cfg.warps, num_stages=cfg.stages)


def launch_amax_2d(x: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, cfg: Config) -> None:
    """``rows`` [M] / ``cols`` [K] (fp32, zero) <- row / column max |x|."""
    m, k = x.shape
    if x.numel():
        chunk = max(cfg.bm, cfg.m_chunk // cfg.bm * cfg.bm)
        grid = (triton.cdiv(k, cfg.bk), triton.cdiv(m, chunk))
        dummy = rows if rows is not None else cols
        wrap_triton(_amax_2d_kernel)[grid](
            x, dummy if rows is None else rows, dummy if cols is None else cols, m, k,
            M_CHUNK=chunk, ROWS=rows is not None, COLS=cols is not None, BM=cfg.bm, BK=cfg.bk,
            num_warps=cfg.warps, num_stages=cfg.stages)


def _group_strides(scale: torch.Tensor, g0: int, g1: int) -> tuple[int, int, int, int]:
    """(group0, stride0, group1, stride1) for indexing ``scale``; group 0 = whole dim (stride 0)."""
    return (g0 or 1, scale.stride(0) if g0 else 0, g1 or 1, scale.stride(1) if g1 else 0)


def launch_cast(x: torch.Tensor, data: torch.Tensor, sa: torch.Tensor, data_t: torch.Tensor | None,
                sb: torch.Tensor | None, groups: tuple[int, int], pow2: bool, cfg: Config,
                sa_out: torch.Tensor | None = None, sb_out: torch.Tensor | None = None, partials: int = 0,
                amax_out: torch.Tensor | None = None) -> None:
    """Cast ``x`` with scales ``sa`` (and ``x.T`` with ``sb``); from amax if ``sa_out`` is given.

    ``groups``: the spec's group lengths along (M, K), 0 for a whole dimension. ``partials``
    (tensorwise, from amax): ``sa`` holds that many partial maxima of ``launch_amax_flat(partial=True)``.
    ``amax_out`` (``cast_programs`` int32 slots): each program's max ``|x|`` as int32 bits.
    """
    m, k = x.shape
    if not x.numel():
        return
    gm, gk = groups
    a_m, sa0, a_k, sa1 = _group_strides(sa, gm, gk)
    transpose = data_t is not None
    b_k, sb0, b_m, sb1 = _group_strides(sb, gm, gk) if transpose else (1, 0, 1, 0)
    if (gk and gk % cfg.bk) or (transpose and gk and gk % cfg.bm):
        raise ValueError(f"launch_cast: tile {cfg.bm}x{cfg.bk} straddles a group of {groups}; "
                         "use tiles that divide the group.")
    from_amax = sa_out is not None
    grid = (triton.cdiv(m, cfg.bm), triton.cdiv(k, cfg.bk))
    wrap_triton(_cast_kernel)[grid](
        x, data, sa, sa_out if from_amax else sa, data_t if transpose else data,
        sb if transpose else sa, sb_out if (from_amax and transpose) else sa,
        m, k, sa0, sa1, sb0, sb1, A_M=a_m, A_K=a_k, B_K=b_k, B_M=b_m, FROM_AMAX=from_amax,
        **_consts(data.dtype, pow2), TRANSPOSE=transpose, BM=cfg.bm, BK=cfg.bk,
        NPART=partials, NPART_P2=triton.next_power_of_2(max(partials, 1)),
        amax_ptr=sa if amax_out is None else amax_out, AMAX_OUT=0 if amax_out is None else cfg.amax_out,
        RAW_T=cfg.raw_t and transpose, num_warps=cfg.warps, num_stages=cfg.stages)


def cast_partials(x: torch.Tensor, cfg: Config) -> int:
    """The length of ``launch_cast``'s ``amax_out`` on ``x`` with ``cfg`` (see ``Config.amax_out``)."""
    m, k = x.shape
    per_program = {1: 1, 2: cfg.bm, 3: cfg.bk}[cfg.amax_out]
    return triton.cdiv(m, cfg.bm) * triton.cdiv(k, cfg.bk) * per_program


def launch_quant(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor | None,
                 scale_t: torch.Tensor | None, tile_group: bool, pow2: bool, bm: int, bk: int,
                 cfg: Config) -> None:
    """One-pass amax + cast with ``bm x bk`` tiles, each tile row (or the tile) one group."""
    m, k = x.shape
    if not x.numel():
        return
    transpose = data_t is not None
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    t = scale_t if transpose else scale
    wrap_triton(_quant_kernel)[grid](
        x, data, scale, data_t if transpose else data, t, m, k,
        scale.stride(0), scale.stride(1), t.stride(0), t.stride(1), TILE_GROUP=tile_group,
        **_consts(data.dtype, pow2), TRANSPOSE=transpose, BM=bm, BK=bk, RAW_T=cfg.raw_t and transpose,
        num_warps=cfg.warps, num_stages=cfg.stages)


def launch_quant_t(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor,
                   scale_t: torch.Tensor, tile_group: bool, pow2: bool, cfg: Config, block: int = 128) -> None:
    """One-pass block quantize of ``x`` and ``x.T`` by ``_quant_t_kernel`` (``cfg.chunk`` > 0)."""
    m, k = x.shape
    if not x.numel():
        return
    if block % cfg.chunk:
        raise ValueError(f"launch_quant_t: chunk={cfg.chunk} does not divide the block {block}; "
                         "use a power of two up to it.")
    if tile_group and cfg.order == 0:
        # Every [128, chunk] column-slab second walk of a 128x128 tile came out wrong on an H200
        # (Triton 3.6, bf16 and fp32 inputs, 3/8 of the transposed bytes; the interpreter agrees
        # with the twin): refused, not risked.
        raise ValueError(f"launch_quant_t: {cfg} with 128x128 groups: order=0 is miscompiled by the "
                         "Triton this was measured with; use order=1.")
    grid = (triton.cdiv(m, block), triton.cdiv(k, block))
    wrap_triton(_quant_t_kernel)[grid](
        x, data, scale, data_t, scale_t, m, k, scale.stride(0), scale.stride(1), scale_t.stride(0),
        scale_t.stride(1), TILE_GROUP=tile_group, **_consts(data.dtype, pow2), B=block, CH=cfg.chunk,
        ORDER=cfg.order, EVICT=int(cfg.evict), UNROLL=cfg.unroll, RAW_T=cfg.raw_t, num_warps=cfg.warps,
        num_stages=cfg.stages)


def rowwise_tile(k: int, cfg: Config) -> tuple[int, int]:
    """(rows per program, padded row) of the one-pass row-wise kernel for rows of ``k``."""
    bk = triton.next_power_of_2(k)
    return max(1, cfg.bm // bk), bk


# ---------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces into them) and the twin-compatible entry points.


def _groups(g: Granularity) -> tuple[int, int]:
    """A granularity on ``[M, K]`` as group lengths along (M, K), 0 for a whole dimension."""
    if isinstance(g, TensorWise):
        return 0, 0
    if isinstance(g, AxisWise):
        return (1, 0) if g.axis in (-1, 1) else (0, 1)
    return g.block[0], g.block[1]


@triton_op("fp8func::kernels_amax", mutates_args=())
def _amax_op(x: torch.Tensor, gm: int, gk: int) -> torch.Tensor:
    m, k = x.shape
    out = torch.zeros((m if gm else 1, k if gk else 1), device=x.device, dtype=torch.float32)
    if not gm and not gk:
        launch_amax_flat(x, out, CONFIGS["amax_flat"])
    else:
        launch_amax_2d(x, out if gm else None, out if gk else None, CONFIGS["amax_2d"])
    return out


@triton_op("fp8func::kernels_cast", mutates_args=())
def _cast_op(x: torch.Tensor, scale: torch.Tensor, scale_t: torch.Tensor | None, dtype: torch.dtype,
             gm: int, gk: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    data = torch.empty((m, k), device=x.device, dtype=dtype)
    data_t = torch.empty((k, m) if scale_t is not None else (0, 0), device=x.device, dtype=dtype)
    name = ("cast_block" if gk else "cast") + ("_t" if scale_t is not None else "")
    launch_cast(x, data, scale, data_t if scale_t is not None else None, scale_t, (gm, gk), False,
                CONFIGS[name])
    return data, data_t


@triton_op("fp8func::kernels_cast_amax", mutates_args=())
def _cast_amax_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Tensorwise: one pass writes the cast (and its transpose) and one max |x| per program; the
    # maximum of those int32 bit patterns is the amax (exact, NaN canonical, as _reference.amax).
    m, k = x.shape
    data = torch.empty((m, k), device=x.device, dtype=dtype)
    data_t = torch.empty((k, m) if transpose else (0, 0), device=x.device, dtype=dtype)
    cfg = CONFIGS["cast_amax_t" if transpose else "cast_amax"]
    if not x.numel():
        return data, data_t, torch.zeros((1, 1), device=x.device, dtype=torch.float32)
    # Masked-off rows / columns of edge tiles store 0 (their loads' other=0.0): no effect on the max.
    parts = torch.empty((cast_partials(x, cfg),), device=x.device, dtype=torch.int32)
    launch_cast(x, data, scale, data_t if transpose else None, scale if transpose else None, (0, 0), False, cfg,
                amax_out=parts)
    return data, data_t, parts.max().view(torch.float32).reshape(1, 1)


@triton_op("fp8func::kernels_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, dtype: torch.dtype, pow2: bool, gm: int, gk: int,
                 transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    dev = x.device
    data = torch.empty((m, k), device=dev, dtype=dtype)
    scale = torch.empty((m // gm if gm else 1, k // gk if gk else 1), device=dev, dtype=torch.float32)
    data_t = torch.empty((k, m) if transpose else (0, 0), device=dev, dtype=dtype)
    # Groups (gm, gk) of [M, K] applied to x.T [K, M]: gm along K, gk along M.
    scale_t = torch.empty((k // gm if gm else 1, m // gk if gk else 1) if transpose else (0, 0),
                          device=dev, dtype=torch.float32)
    dt, st = (data_t, scale_t) if transpose else (None, None)
    if not x.numel():  # no kernel runs: the scales of empty groups, as the twin makes them (amax 0)
        scale.copy_(compute_scale(torch.zeros_like(scale), dtype, pow2))
        scale_t.copy_(compute_scale(torch.zeros_like(scale_t), dtype, pow2))
    elif gm == 0 and gk == 0:
        # Tensorwise: amax pass (per-program partial maxima: no zeroed buffer, so no fill kernel
        # and launch before it), then the cast reduces them and makes the scale.
        parts = amax_programs(x.numel(), CONFIGS["amax_flat"])
        amax = torch.empty((parts,), device=dev, dtype=torch.float32)
        launch_amax_flat(x, amax, CONFIGS["amax_flat"], partial=True)
        launch_cast(x, data, amax, dt, amax if transpose else None, (0, 0), pow2,
                    CONFIGS["cast_t" if transpose else "cast"], sa_out=scale, sb_out=st, partials=parts)
    elif gk == 0 and (transpose or k > MAX_ROW_K):  # row-wise needing a second read of x
        amax = torch.zeros((m,), device=dev, dtype=torch.float32)
        amax_t = torch.zeros((k,), device=dev, dtype=torch.float32) if transpose else None
        launch_amax_2d(x, amax, amax_t, CONFIGS["amax_2d"])
        launch_cast(x, data, amax, dt, amax_t, (1, 0), pow2,
                    CONFIGS["cast_t" if transpose else "cast"], sa_out=scale, sb_out=st)
    elif gk == 0:  # row-wise, one pass
        cfg = CONFIGS["rowwise"]
        launch_quant(x, data, scale, None, None, False, pow2, *rowwise_tile(k, cfg), cfg)
    else:  # 1x128 or 128x128 blocks, one pass
        name = ("block_128" if gm == gk else "block_1x128") + ("_t" if transpose else "")
        cfg = CONFIGS[name]
        if transpose and cfg.chunk:
            launch_quant_t(x, data, scale, data_t, scale_t, gm == gk, pow2, cfg, block=gk)
        else:
            bm = gk if (transpose or gm == gk) else cfg.bm
            launch_quant(x, data, scale, dt, st, gm == gk, pow2, bm, gk, cfg)
    return data, scale, data_t, scale_t


def amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-group ``max(|x|)`` in fp32, shaped like the scale (TensorWise or AxisWise); NaN is 0x7FC00000."""
    return _amax_op(x, *_groups(granularity))


def cast(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, scale_t: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` cast with ``scale``; with ``scale_t`` also ``x.T`` (contiguous ``[K, M]``) cast with it."""
    data, data_t = _cast_op(x, scale, scale_t, spec.dtype, *_groups(spec.granularity))
    return data, (data_t if scale_t is not None else None)


def cast_amax(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Tensorwise ``cast(x, scale, spec, scale if transpose else None)`` and ``amax(x)`` ``(1, 1)``, one read."""
    data, data_t, amax = _cast_amax_op(x, scale, spec.dtype, transpose)
    return data, (data_t if transpose else None), amax


def quantize(
    x: torch.Tensor, spec: CastSpec, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(data, scale, data_t, scale_t)`` of ``quantize(x)`` and, if asked, ``quantize(x.T.contiguous())``."""
    data, scale, data_t, scale_t = _quantize_op(x, spec.dtype, spec.pow2_scales, *_groups(spec.granularity),
                                                transpose)
    return (data, scale, data_t, scale_t) if transpose else (data, scale, None, None)

