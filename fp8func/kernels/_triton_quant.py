"""The Triton backend of ``fp8func.kernels``: custom ops over the kernels, twins in ``_reference``.

Imported lazily by the dispatcher, only where Triton is installed. Each entry point below has
the signature of its twin in ``_reference`` and returns the same bits. Each is a
``torch.library.triton_op`` (kernels launched through ``wrap_triton``), so ``torch.compile``
traces into it. Eagerly, on plain tensors with no mode, transform or autograd in play, the entry
points call the op's function directly: the same launch, without the custom-op dispatch (about
a third of the host time of an eager cast, which FSDP2's pre-all-gather hooks pay per weight).
The kernels, by family: ``_triton_amax`` (tensorwise and per row / column amax),
``_triton_cast`` (cast with given or amax-made scales, optional transposed copy and amax),
``_triton_block`` (one-pass quantize where a group fits one program: rows, 1x128 and 128x128
blocks, with the transposed copy for the blocks); the scalar math they share is in
``_triton_device``, their launch configurations in ``_configs``.
"""

from __future__ import annotations

import contextlib

import torch
from torch._library import triton as _library_triton
from torch.library import triton_op

from .._formats import tracing
from .._scaling import AxisWise, CastSpec, Granularity, TensorWise, compute_scale
from ._configs import config, static_launches
from ._dispatch import QUANTIZE_OP, plain_eager
from ._triton_amax import amax_programs, launch_amax_2d, launch_amax_flat
from ._triton_block import MAX_ROW_K, launch_quant, launch_quant_t, rowwise_tile
from ._triton_cast import cast_partials, launch_cast, launch_cast_many, launch_cast_rows_cols, launch_transpose

__all__ = ["amax", "amax_rows_cols", "cast", "cast_amax", "cast_many", "cast_rows_cols", "quantize", "transpose"]


def _groups(g: Granularity) -> tuple[int, int]:
    """A granularity on ``[M, K]`` as group lengths along (M, K), 0 for a whole dimension."""
    if isinstance(g, TensorWise):
        return 0, 0
    if isinstance(g, AxisWise):
        return (1, 0) if g.axis in (-1, 1) else (0, 1)
    return g.block[0], g.block[1]


def _amax_op_fn(x: torch.Tensor, gm: int, gk: int) -> torch.Tensor:
    m, k = x.shape
    out = torch.zeros((m if gm else 1, k if gk else 1), device=x.device, dtype=torch.float32)
    if not gm and not gk:
        launch_amax_flat(x, out, config("amax_flat"))
    else:
        launch_amax_2d(x, out if gm else None, out if gk else None, config("amax_2d"))
    return out


def _cast_op_fn(x: torch.Tensor, scale: torch.Tensor, scale_t: torch.Tensor | None, dtype: torch.dtype,
                gm: int, gk: int, round_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    data = torch.empty((m, k), device=x.device, dtype=dtype)
    data_t = torch.empty((k, m) if scale_t is not None else (0, 0), device=x.device, dtype=dtype)
    route = ("cast_block" if gk else "cast") + ("_t" if scale_t is not None else "")
    launch_cast(x, data, scale, data_t if scale_t is not None else None, scale_t, (gm, gk), False, config(route),
                round_bf16=round_bf16)
    return data, data_t


def _cast_amax_op_fn(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Tensorwise: one pass writes the cast (and its transpose) and one max |x| per program; the
    # maximum of those int32 bit patterns is the amax (exact, NaN canonical, as _reference.amax).
    m, k = x.shape
    data = torch.empty((m, k), device=x.device, dtype=dtype)
    data_t = torch.empty((k, m) if transpose else (0, 0), device=x.device, dtype=dtype)
    cfg = config("cast_amax_t" if transpose else "cast_amax")
    if not x.numel():
        return data, data_t, torch.zeros((1, 1), device=x.device, dtype=torch.float32)
    # Masked-off rows / columns of edge tiles load 0 (other=0.0): no effect on the max.
    parts = torch.empty((cast_partials(x, cfg),), device=x.device, dtype=torch.int32)
    launch_cast(x, data, scale, data_t if transpose else None, scale if transpose else None, (0, 0), False, cfg,
                amax_out=parts)
    return data, data_t, parts.max().view(torch.float32).reshape(1, 1)


FOLD_ROWS = 4096
"""The most rows of an input whose fused amax the cast kernel reduces itself (``_amax_in_graph``)."""


def _amax_in_graph(x: torch.Tensor) -> torch.Tensor | None:
    """``max |x|`` as int32 bit patterns of fp32 values (NaN: 0x7FC00000), by graph ops that
    inductor fuses into the kernel producing ``x``: the row maxima where ``x`` has at most
    ``FOLD_ROWS`` rows (static), else their maximum (one element). None where the kernel computes
    it (eager, or an input other than bf16 / fp32).

    The maximum is taken over the magnitude bits, not the values: inductor computes a fused
    producer in fp32 and would compare its unrounded results, where the kernel reads the stored
    ones; a bit view makes it round first. The bits order like the magnitudes, NaNs above inf, so
    their maximum, its NaN made canonical, is ``amax_bits``' (for bf16, shifted to fp32's place).
    Row maxima first: a reduction over rows fuses into a pointwise producer (SiLU-mul and its
    gradient) as well as into a row-wise one (RMSNorm), where inductor's split of one flat
    reduction fuses into the latter only. The cast kernel takes the row maxima as partials and
    reduces them in every program (a few KB, from L2): the maximum of the maxima is the same
    bits, and no launch of its own for it (on a host-bound step, each launch costs the host more
    than the GPU time it takes). Past ``FOLD_ROWS`` rows the programs' reads of the maxima would
    grow with the tensor, so inductor reduces them once, in a kernel of its own."""
    if not tracing() or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    if x.dtype == torch.bfloat16:
        bits = (x.view(torch.int16) & 0x7FFF).amax(dim=-1).to(torch.int32) << 16
    else:
        bits = (x.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)
    if not (isinstance(x.shape[0], int) and x.shape[0] <= FOLD_ROWS):  # a symbolic or long M: one value
        bits = bits.amax().reshape(1)
    return torch.where(bits > 0x7F800000, 0x7FC00000, bits)


def _quantize_tensorwise(x, data, scale, dt, st, pow2: bool, fuse_amax: bool) -> None:
    # An amax pass storing per-program partial maxima (no zeroed buffer, so no fill launch
    # before it), or the amax as graph ops (row maxima, or their maximum), then the cast reduces
    # them in every program and makes the scale.
    bits = _amax_in_graph(x) if fuse_amax else None
    if bits is not None:
        parts, amax = bits.numel(), bits.view(torch.float32)
    else:
        cfg = config("amax_flat")
        parts = amax_programs(x.numel(), cfg)
        amax = torch.empty((parts,), device=x.device, dtype=torch.float32)
        launch_amax_flat(x, amax, cfg, partial=True)
    launch_cast(x, data, amax, dt, amax if dt is not None else None, (0, 0), pow2,
                config("cast_t" if dt is not None else "cast"), sa_out=scale, sb_out=st, partials=parts)


def _quantize_rowwise_2pass(x, data, scale, dt, st, pow2: bool) -> None:
    # Row-wise with a transposed copy (the column scales need every row first) or rows too wide
    # for registers: row (and column) maxima in one read, then the cast that makes the scales.
    m, k = x.shape
    amax = torch.zeros((m,), device=x.device, dtype=torch.float32)
    amax_t = torch.zeros((k,), device=x.device, dtype=torch.float32) if dt is not None else None
    launch_amax_2d(x, amax, amax_t, config("amax_2d"))
    launch_cast(x, data, amax, dt, amax_t, (1, 0), pow2, config("cast_t" if dt is not None else "cast"),
                sa_out=scale, sb_out=st)


def _quantize_op_fn(x: torch.Tensor, dtype: torch.dtype, pow2: bool, gm: int, gk: int, transpose: bool,
                    fuse_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        _quantize_tensorwise(x, data, scale, dt, st, pow2, fuse_amax)
    elif gk == 0 and (transpose or k > MAX_ROW_K):
        _quantize_rowwise_2pass(x, data, scale, dt, st, pow2)
    elif gk == 0:  # row-wise, one pass
        cfg = config("rowwise")
        launch_quant(x, data, scale, False, pow2, *rowwise_tile(k, cfg), cfg)
    elif transpose:  # 1x128 or 128x128 blocks and their transposes, one pass
        cfg = config("block_128_t" if gm == gk else "block_1x128_t")
        launch_quant_t(x, data, scale, data_t, scale_t, gm == gk, pow2, cfg, block=gk)
    else:  # 1x128 or 128x128 blocks, one pass
        cfg = config("block_128" if gm == gk else "block_1x128")
        launch_quant(x, data, scale, gm == gk, pow2, gk if gm == gk else cfg.bm, gk, cfg)
    return data, scale, data_t, scale_t


static_launches()  # as at the package import: inductor launches these kernels as its own, unless set otherwise

_amax_op = triton_op("fp8func::kernels_amax", mutates_args=())(_amax_op_fn)
_cast_op = triton_op("fp8func::kernels_cast", mutates_args=())(_cast_op_fn)
_cast_amax_op = triton_op("fp8func::kernels_cast_amax", mutates_args=())(_cast_amax_op_fn)
_quantize_op = triton_op(QUANTIZE_OP, mutates_args=())(_quantize_op_fn)


_plain_launches = getattr(_library_triton, "set_wrap_triton_enabled", None)  # as triton_op's eager kernel runs


def _eager_launches():
    """A context in which ``wrap_triton`` launches the kernel itself (no higher-order op), where
    this torch can say so."""
    return _plain_launches(False) if _plain_launches is not None else contextlib.nullcontext()


def _call(op, fn, x: torch.Tensor, *args):
    """``op(x, *args)``; its function ``fn`` itself where nothing needs the dispatcher: eager
    (not traced), no dispatch mode or torch.func transform active, ``x`` a plain tensor that
    needs no autograd (the ops have no autograd formula: their outputs never require grad).
    ``fn`` then launches the kernels as the op's eager kernel does (``wrap_triton`` off)."""
    if (_plain_launches is not None and plain_eager((x,))
            and not (x.requires_grad and torch.is_grad_enabled())):
        with _plain_launches(False):
            return fn(x, *args)
    return op(x, *args)


def amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-group ``max(|x|)`` in fp32, shaped like the scale (TensorWise or AxisWise); NaN is 0x7FC00000."""
    return _call(_amax_op, _amax_op_fn, x, *_groups(granularity))


def cast(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, scale_t: torch.Tensor | None, round_to=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` cast with ``scale``; with ``scale_t`` also ``x.T`` (contiguous ``[K, M]``) cast with it.
    ``round_to=torch.bfloat16``: fp32 ``x`` rounded to bf16 first, in the same pass."""
    data, data_t = _call(_cast_op, _cast_op_fn, x, scale, scale_t, spec.dtype, *_groups(spec.granularity),
                         round_to is not None)
    return data, (data_t if scale_t is not None else None)


def cast_many(xs: list[torch.Tensor], scales: torch.Tensor, spec: CastSpec, round_to=None,
              out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each of ``xs`` cast with ``scales[i, 0]`` (tensorwise), in one launch (eager only), into ``out``
    where given."""
    return launch_cast_many(xs, scales, spec.dtype, round_to is not None, out)


def amax_rows_cols(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:M]`` / ``out[M:]`` (zeros) <- the row / column maxima of ``x``, one read (eager only)."""
    m = x.shape[0]
    with _eager_launches(), torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch_amax_2d(x, out[:m], out[m:], config("amax_2d"))


def cast_rows_cols(x: torch.Tensor, row_scale: torch.Tensor, row_spec: CastSpec, col_scale: torch.Tensor,
                   col_spec: CastSpec, round_to=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast with its row scales and with its column scales, two ``[M, K]`` payloads from one
    read (eager only). The tile walk of the ``cast`` route (its configuration)."""
    data = torch.empty(x.shape, device=x.device, dtype=row_spec.dtype)
    data_c = torch.empty(x.shape, device=x.device, dtype=col_spec.dtype)
    launch_cast_rows_cols(x, data, row_scale, data_c, col_scale, round_to is not None, config("cast"))
    return data, data_c


def transpose(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` by tiles (eager only)."""
    y = torch.empty((x.shape[1], x.shape[0]), device=x.device, dtype=x.dtype)
    launch_transpose(x, y)
    return y


def cast_amax(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Tensorwise ``cast(x, scale, spec, scale if transpose else None)`` and ``amax(x)`` ``(1, 1)``, one read."""
    data, data_t, amax = _call(_cast_amax_op, _cast_amax_op_fn, x, scale, spec.dtype, transpose)
    return data, (data_t if transpose else None), amax


def quantize(
    x: torch.Tensor, spec: CastSpec, transpose: bool, fuse_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(data, scale, data_t, scale_t)`` of ``quantize(x)`` and, if asked, ``quantize(x.T.contiguous())``;
    ``fuse_amax``: a tensorwise amax as graph ops under torch.compile (``_amax_in_graph``)."""
    data, scale, data_t, scale_t = _call(_quantize_op, _quantize_op_fn, x, spec.dtype, spec.pow2_scales,
                                         *_groups(spec.granularity), transpose, fuse_amax)
    return (data, scale, data_t, scale_t) if transpose else (data, scale, None, None)
