"""The cast kernel: given scales (or scales made from amax), optional transposed copy and amax.

``_cast_kernel`` casts one ``[BM, BK]`` tile per program. With ``TRANSPOSE`` it also writes
``x.T``'s cast from the same tile; with ``FROM_AMAX`` it turns given amaxes into the scales
(the second pass of the tensorwise and row-wise-with-transpose quantize); with ``AMAX_OUT`` it
also stores its tile's ``max |x|`` (delayed scaling: the cast and the next step's amax from one
read of ``x``); with ``ROUND_BF16`` it casts fp32 ``x`` rounded to bf16 first (FSDP2's hook: an
fp32 master shard cast as its bf16 copy would be, without writing the copy).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._configs import Config
from ._triton_device import abs_bits, anchor, canonical_nan, consts, recip, saturate, scale_of, transposed

__all__ = ["cast_partials", "launch_cast", "launch_cast_many", "launch_cast_rows_cols", "launch_transpose"]


@triton.jit
def _cast_kernel(x_ptr, anchor_ptr, data_ptr, sa_ptr, sa_out_ptr, data_t_ptr, sb_ptr, sb_out_ptr,
                 M, K, sa0, sa1, sb0, sb1,
                 A_M: tl.constexpr, A_K: tl.constexpr, B_K: tl.constexpr, B_M: tl.constexpr,
                 FROM_AMAX: tl.constexpr, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                 POW2: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                 NPART: tl.constexpr = 0, NPART_P2: tl.constexpr = 1, amax_ptr=0,
                 AMAX_OUT: tl.constexpr = False, RAW_T: tl.constexpr = False, ROUND_BF16: tl.constexpr = False):
    # data[m, k] uses sa[(m // A_M) * sa0 + (k // A_K) * sa1], one value per tile row (the
    # launcher keeps a tile inside one K group); data_t[k, m] uses sb[(k // B_K) * sb0 +
    # (m // B_M) * sb1], one value per tile column. Whole-dimension groups have stride 0.
    # FROM_AMAX: sa / sb hold amax; the first program along the other axis writes the scales.
    # NPART (tensorwise, FROM_AMAX): sa holds NPART partial maxima (int32 bits, NaN canonical):
    # _amax_flat_kernel(PARTIAL)'s per-program ones, or the row maxima of a compiled fused amax
    # (up to _triton_quant.FOLD_ROWS); every program reduces them (a few KB, from L2).
    # AMAX_OUT: each program also stores max |x| of its tile (int32 bits, NaN canonical) at
    # amax_ptr[pid_m * num_programs(1) + pid_k], for the caller to reduce.
    # RAW_T: the transposed copy from the raw tile transposed, then upcast (Config.raw_t).
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x_raw = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    if ROUND_BF16:  # round to nearest even, as torch's .to(torch.bfloat16)
        x_raw = x_raw.to(tl.bfloat16, fp_downcast_rounding="rtne")
    x = x_raw.to(tl.float32)
    if AMAX_OUT:
        out = amax_ptr.to(tl.pointer_type(tl.int32))
        p = (pid_m * tl.num_programs(1) + pid_k).to(tl.int64)
        # max over |x|'s bits, then NaN made canonical: the same as canonical bits' max (any NaN's
        # bits exceed inf's), one select per stored value instead of per element
        tl.store(out + p, canonical_nan(tl.max(tl.max(abs_bits(x), 1), 0)))
    a_idx = (rows // A_M) * sa0 + (pid_k * BK // A_K) * sa1
    if NPART > 0:
        # The scalar maximum raised into a loaded vector (every partial is <= it), not broadcast
        # from a scalar: Triton 3.6 miscompiles the transposed fp8 store fed from a broadcast
        # scalar scale (fp32 inputs); the vector form compiles right.
        part_ptr = sa_ptr.to(tl.pointer_type(tl.int32))
        parts = tl.arange(0, NPART_P2)
        amax_bits = tl.max(tl.load(part_ptr + parts, mask=parts < NPART, other=0), 0)
        sa = tl.maximum(tl.load(part_ptr + rows % NPART), amax_bits).to(tl.float32, bitcast=True)
    else:
        sa = tl.load(sa_ptr + a_idx, mask=rmask, other=1.0)
    if FROM_AMAX:
        sa = scale_of(sa, INV_MAX, POW2)
        if pid_k == 0:
            tl.store(sa_out_ptr + a_idx, sa, mask=rmask)
    y = saturate(x, recip(sa)[:, None], FP8_MAX).to(data_ptr.dtype.element_ty)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=mask)
    if TRANSPOSE:
        b_idx = (cols // B_K) * sb0 + (pid_m * BM // B_M) * sb1
        if NPART > 0:
            sb = tl.maximum(tl.load(part_ptr + cols % NPART), amax_bits).to(tl.float32, bitcast=True)
        else:
            sb = tl.load(sb_ptr + b_idx, mask=cmask, other=1.0)
        if FROM_AMAX:
            sb = scale_of(sb, INV_MAX, POW2)
            if pid_m == 0:
                tl.store(sb_out_ptr + b_idx, sb, mask=cmask)
        y_t = saturate(transposed(x, x_raw, RAW_T), recip(sb)[:, None], FP8_MAX).to(data_t_ptr.dtype.element_ty)
        tl.store(data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], y_t,
                 mask=cmask[:, None] & rmask[None, :])


def _group_strides(scale: torch.Tensor, g0: int, g1: int) -> tuple[int, int, int, int]:
    """(group0, stride0, group1, stride1) for indexing ``scale``; group 0 = whole dim (stride 0)."""
    return (g0 or 1, scale.stride(0) if g0 else 0, g1 or 1, scale.stride(1) if g1 else 0)


def launch_cast(x: torch.Tensor, data: torch.Tensor, sa: torch.Tensor, data_t: torch.Tensor | None,
                sb: torch.Tensor | None, groups: tuple[int, int], pow2: bool, cfg: Config,
                sa_out: torch.Tensor | None = None, sb_out: torch.Tensor | None = None, partials: int = 0,
                amax_out: torch.Tensor | None = None, round_bf16: bool = False) -> None:
    """Cast ``x`` with scales ``sa`` (and ``x.T`` with ``sb``); from amax if ``sa_out`` is given.

    ``groups``: the spec's group lengths along (M, K), 0 for a whole dimension. ``partials``
    (tensorwise, from amax): ``sa`` holds that many partial maxima of ``launch_amax_flat(partial=True)``.
    ``amax_out`` (``cast_partials`` int32 slots): each program's max ``|x|`` as int32 bits.
    ``round_bf16``: fp32 ``x`` is rounded to bf16 before the cast.
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
        x, anchor(x), data, sa, sa_out if from_amax else sa, data_t if transpose else data,
        sb if transpose else sa, sb_out if (from_amax and transpose) else sa,
        m, k, sa0, sa1, sb0, sb1, A_M=a_m, A_K=a_k, B_K=b_k, B_M=b_m, FROM_AMAX=from_amax,
        **consts(data.dtype, pow2), TRANSPOSE=transpose, BM=cfg.bm, BK=cfg.bk,
        NPART=partials, NPART_P2=triton.next_power_of_2(max(partials, 1)),
        amax_ptr=sa if amax_out is None else amax_out, AMAX_OUT=amax_out is not None,
        RAW_T=cfg.raw_t and transpose, ROUND_BF16=round_bf16, num_warps=cfg.warps, num_stages=cfg.stages)


@triton.jit
def _cast_rows_cols_kernel(x_ptr, rows_ptr, cols_ptr, sr_ptr, sc_ptr, M, K, sr0, sc1,
                           MAX_R: tl.constexpr, MAX_C: tl.constexpr, ROUND_BF16: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr):
    # One [BM, BK] tile of x read once and cast twice, both payloads in x's layout: rows_ptr with
    # the row scales sr[m * sr0], cols_ptr with the column scales sc[k * sc1] (a row-wise weight's
    # forward cast and its grad_input cast). The arithmetic is _cast_kernel's, element for element.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ROUND_BF16:  # round to nearest even, as torch's .to(torch.bfloat16)
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    x = x.to(tl.float32)
    sr = tl.load(sr_ptr + rows.to(tl.int64) * sr0, mask=rmask, other=1.0)
    sc = tl.load(sc_ptr + cols.to(tl.int64) * sc1, mask=cmask, other=1.0)
    tl.store(rows_ptr + offs, saturate(x, recip(sr)[:, None], MAX_R).to(rows_ptr.dtype.element_ty), mask=mask)
    tl.store(cols_ptr + offs, saturate(x, recip(sc)[None, :], MAX_C).to(cols_ptr.dtype.element_ty), mask=mask)


def launch_cast_rows_cols(x: torch.Tensor, data: torch.Tensor, row_scale: torch.Tensor, data_c: torch.Tensor,
                          col_scale: torch.Tensor, round_bf16: bool, cfg: Config) -> None:
    """``data`` <- ``x`` cast with ``row_scale`` ``[M, 1]``, ``data_c`` <- ``x`` cast with ``col_scale``
    ``[1, K]``, both ``[M, K]``, from one read of ``x`` (eager: the kernel itself is launched).
    ``round_bf16``: fp32 ``x`` is rounded to bf16 before the casts."""
    m, k = x.shape
    if not x.numel():
        return
    grid = (triton.cdiv(m, cfg.bm), triton.cdiv(k, cfg.bk))
    # Triton launches on the current device
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _cast_rows_cols_kernel[grid](
            x, data, data_c, row_scale, col_scale, m, k, row_scale.stride(0), col_scale.stride(1),
            MAX_R=consts(data.dtype, False)["FP8_MAX"], MAX_C=consts(data_c.dtype, False)["FP8_MAX"],
            ROUND_BF16=round_bf16, BM=cfg.bm, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    # y[k, m] = x[m, k] for one [BM, BK] tile: read along x's rows, written along y's rows (Triton
    # gives the load and the store each a coalesced layout and moves the tile between them)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask)
    tl.store(y_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], tile, mask=mask)


def launch_transpose(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` (``[K, M]``, contiguous) <- ``x.T`` for contiguous ``x`` ``[M, K]`` of 1-, 2- or 4-byte
    elements (eager: the kernel itself is launched); the bits move unchanged."""
    m, k = x.shape
    if not x.numel():
        return
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    grid = (triton.cdiv(m, 64), triton.cdiv(k, 64))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _transpose_kernel[grid](x.view(ints), y.view(ints), m, k, BM=64, BK=64, num_warps=4)


def cast_partials(x: torch.Tensor, cfg: Config) -> int:
    """The length of ``launch_cast``'s ``amax_out`` on ``x`` with ``cfg``: one slot per program."""
    m, k = x.shape
    return triton.cdiv(m, cfg.bm) * triton.cdiv(k, cfg.bk)


@triton.jit
def _cast_many_kernel(src_ptrs, dst_ptr, dst_offsets, numels, block_tensor, block_start, scale_ptr, scale_stride,
                      SRC: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
    # Program p casts BLOCK elements of tensor t = block_tensor[p], from element block_start[p]:
    # src = the tensor's address (src_ptrs[t]), its scale scale_ptr[t * scale_stride], its output
    # at dst_ptr + dst_offsets[t]. The arithmetic is _cast_kernel's, element for element.
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    idx = tl.load(block_start + pid) + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < tl.load(numels + t)
    src = tl.load(src_ptrs + t).to(tl.pointer_type(SRC))
    x = tl.load(src + idx, mask=mask, other=0.0)
    if ROUND_BF16:  # round to nearest even, as torch's .to(torch.bfloat16)
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    # the scale loaded as a vector (see _cast_kernel's NPART note on broadcast scalar scales)
    s = tl.load(scale_ptr + t * scale_stride + tl.zeros([BLOCK], dtype=tl.int64))
    y = saturate(x.to(tl.float32), recip(s), FP8_MAX).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + tl.load(dst_offsets + t) + idx, y, mask=mask)


_MANY_BLOCK = 4096
_MANY_TABLES: dict = {}  # (addresses, sizes, dtype, device) -> the launch's tables, for the last few lists


def _many_tables(xs: list[torch.Tensor]) -> tuple:
    """The device tables of a ``launch_cast_many`` over ``xs``: kept for the last few lists (the
    same weights, stepped in place, are cast every step: their addresses do not change)."""
    key = (tuple(x.data_ptr() for x in xs), tuple(x.numel() for x in xs), xs[0].dtype, xs[0].device)
    tables = _MANY_TABLES.get(key)
    if tables is None:
        sizes = [x.numel() for x in xs]
        starts, owners, offsets, total = [], [], [], 0
        for i, n in enumerate(sizes):
            offsets.append(total)
            starts += range(0, n, _MANY_BLOCK)
            owners += [i] * triton.cdiv(n, _MANY_BLOCK)
            total += n
        dev = xs[0].device

        def table(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        tables = (table([x.data_ptr() for x in xs], torch.int64), table(offsets, torch.int64),
                  table(sizes, torch.int64), table(owners, torch.int32), table(starts, torch.int64),
                  offsets, total, len(owners))
        if len(_MANY_TABLES) >= 8:
            _MANY_TABLES.pop(next(iter(_MANY_TABLES)))
        _MANY_TABLES[key] = tables
    return tables


def launch_cast_many(xs: list[torch.Tensor], scales: torch.Tensor, dtype: torch.dtype,
                     round_bf16: bool, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each of ``xs`` cast with ``scales[i, 0]`` to ``dtype``, in one launch: fp8 tensors shaped
    like ``xs``, views of one buffer (``out`` where given: contiguous, 1-D, of the total size).
    ``xs``: contiguous, one dtype and device (not empty)."""
    src_ptrs, dst_offsets, numels, owners, starts, offsets, total, programs = _many_tables(xs)
    if out is None:
        out = torch.empty(total, dtype=dtype, device=xs[0].device)
    if programs:
        src = tl.float32 if xs[0].dtype == torch.float32 else tl.bfloat16
        on_device = torch.cuda.device(xs[0].device) if xs[0].is_cuda else contextlib.nullcontext()
        with on_device:  # Triton launches on the current device
            _cast_many_kernel[(programs,)](
                src_ptrs, out, dst_offsets, numels, owners, starts, scales, scales.stride(0),
                SRC=src, FP8_MAX=consts(dtype, False)["FP8_MAX"], ROUND_BF16=round_bf16, BLOCK=_MANY_BLOCK,
                num_warps=8)
    return [out[o:o + x.numel()].view(x.shape) for o, x in zip(offsets, xs)]
