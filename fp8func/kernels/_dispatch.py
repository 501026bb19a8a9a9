"""Public entry points: validate, pick the Triton kernel or its twin, wrap the result.

``impl="auto"`` runs the Triton kernel on CUDA tensors where Triton is installed and the
pure-PyTorch twin otherwise; ``"triton"`` / ``"reference"`` force one. Both compute the same
bits (tests/test_kernels.py), so the choice only changes speed.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from .._log import warn_once
from .._qtensor import Fp8Meta, Fp8Tensor
from .._scaling import (
    AxisWise,
    BlockWise,
    CastSpec,
    Granularity,
    TensorWise,
    block_lengths,
    scale_shape,
)
from . import _reference

# The fused quantize op (registered with the Triton backend) and the position of its ``fuse_amax``
# argument in (x, dtype, pow2, gm, gk, transpose, fuse_amax): True for a tensor computed in the
# region being compiled (an activation, a gradient), False for one handed to it (a weight).
QUANTIZE_OP = "fp8func::kernels_quantize"
QUANTIZE_FUSE_AMAX_ARG = 6

__all__ = ["IMPLS", "amax", "amax_rows_cols", "cast", "cast_amax", "cast_many", "cast_rows_cols", "quantize",
           "transpose", "triton_available"]

IMPLS = ("auto", "triton", "reference")
_HP_DTYPES = (torch.bfloat16, torch.float32)
_BLOCKS = (BlockWise((1, 128)), BlockWise((128, 128)))
_log = logging.getLogger("fp8func.kernels")


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """True when the ``triton`` package is installed (no import, no hardware probe)."""
    return importlib.util.find_spec("triton") is not None


def _log_fallback_once() -> None:
    if not torch.compiler.is_compiling():
        warn_once("no triton", "fp8func.kernels: triton is not installed; CUDA tensors run the PyTorch twins "
                  "(same bits, slower). Install triton for the fused kernels.", logger="fp8func.kernels")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _backend(impl: str, x: torch.Tensor):
    """The module (``_triton_quant`` or ``_reference``) that runs ``x`` for ``impl``."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}.")
    if impl == "auto" and x.is_cuda and not triton_available():
        _log_fallback_once()
    if impl == "reference" or (impl == "auto" and not (x.is_cuda and triton_available())):
        return _reference
    if not triton_available():
        raise RuntimeError("impl='triton' needs the triton package, which is not installed; "
                           "install triton or pass impl='reference' (or 'auto').")
    if not x.is_cuda and not _interpreting():
        raise ValueError(f"impl='triton' needs a CUDA tensor, got device={x.device}; move it with "
                         "x.cuda(), pass impl='reference', or set TRITON_INTERPRET=1 to debug on the CPU.")
    from . import _triton_quant

    return _triton_quant


def _check_x(x: torch.Tensor, what: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}.")
    if x.ndim != 2 or x.dtype not in _HP_DTYPES or not x.is_contiguous():
        raise ValueError(
            f"{what}: x has shape {tuple(x.shape)}, dtype {x.dtype}, contiguous={x.is_contiguous()}; "
            "the kernels take contiguous 2-D bf16 or fp32 tensors. Use x.reshape(-1, x.shape[-1]) "
            "and x.contiguous(), or fp8func.quantize for other layouts."
        )
    return x.shape[0], x.shape[1]


def _check_granularity(g: Granularity, what: str, *, amax: bool = False) -> None:
    rowwise = isinstance(g, AxisWise) and g.axis in ((-2, -1, 0, 1) if amax else (-1, 1))
    if not (isinstance(g, TensorWise) or rowwise or (not amax and g in _BLOCKS)):
        supported = ("TensorWise(), AxisWise(-1), AxisWise(0)" if amax else
                     "TensorWise(), AxisWise(-1), BlockWise((1, 128)), BlockWise((128, 128))")
        raise ValueError(f"{what}: granularity {g!r} has no kernel; supported: {supported}. "
                         "Use fp8func.quantize / fp8func.compute_amax for the others.")


def _check_spec(x: torch.Tensor, spec: CastSpec, transpose: bool, what: str) -> None:
    if not isinstance(spec, CastSpec):
        raise TypeError(f"{what}: spec={spec!r} is not a CastSpec; e.g. fp8func.CastSpec(fp8func.E4M3).")
    _check_granularity(spec.granularity, what)
    block_lengths(spec.granularity, tuple(x.shape))  # raises if the blocks do not tile x
    if transpose:
        block_lengths(spec.granularity, tuple(x.shape[::-1]))  # ... or x.T


def _check_scale(s: torch.Tensor, want: tuple[int, ...], x: torch.Tensor, name: str) -> None:
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != want or s.dtype != torch.float32 or s.device != x.device:
        got = (tuple(s.shape), s.dtype, s.device) if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"cast: {name} is {got}; expected float32 of shape {want} on {x.device}.")


def amax(x: torch.Tensor, granularity: Granularity, *, impl: str = "auto") -> torch.Tensor:
    """Per-group ``max(|x|)`` in fp32 shaped like the scale; NaN propagates into its group.

    Args:
        x: contiguous ``[M, K]``, bf16 or fp32.
        granularity: ``TensorWise()`` -> ``(1, 1)``, ``AxisWise(-1)`` -> ``(M, 1)``,
            ``AxisWise(0)`` -> ``(1, K)``.
        impl: ``"auto"``, ``"triton"`` or ``"reference"``.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> k.amax(torch.tensor([[1.0, -3.0], [2.0, 0.5]]), f8.AxisWise(-1)).flatten().tolist()
        [3.0, 2.0]
    """
    _check_x(x, "amax")
    _check_granularity(granularity, "amax", amax=True)
    return _backend(impl, x).amax(x, granularity)


def cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: CastSpec,
    *,
    transpose: bool = False,
    scale_t: torch.Tensor | None = None,
    round_to: torch.dtype | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quantize_with_scale(x, scale, spec).data`` and, with ``transpose``, the transposed copy.

    ``round_to=torch.bfloat16`` casts fp32 ``x`` as ``x.to(torch.bfloat16)`` would be cast,
    bitwise, without writing the bf16 copy (the Triton kernel rounds each element as it reads it).

    The transposed copy is contiguous ``[K, M]`` and equals
    ``quantize_with_scale(x.T.contiguous(), scale_t, spec).data``; it is written from the same
    tiles, in the same pass. ``scale_t`` defaults to ``scale`` (tensorwise) or ``scale.T``
    (128x128 blocks); row-wise and 1x128 casts need the scales of ``x.T`` passed.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> x = torch.randn(4, 8)
        >>> data, data_t = k.cast(x, torch.ones(1, 1), f8.CastSpec(), transpose=True)
        >>> torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
        True
    """
    m, k = _check_x(x, "cast")
    _check_spec(x, spec, transpose, "cast")
    g = spec.granularity
    _check_scale(scale, scale_shape(g, (m, k)), x, "scale")
    if not transpose:
        scale_t = None
    elif scale_t is None:
        if not (isinstance(g, TensorWise) or g == BlockWise((128, 128))):
            raise ValueError(f"cast(transpose=True): {g!r} scales x.T by other groups than x; pass "
                             f"scale_t of shape {scale_shape(g, (k, m))} (the scales of x.T).")
        scale_t = scale if isinstance(g, TensorWise) else scale.t()
    if scale_t is not None:
        _check_scale(scale_t, scale_shape(g, (k, m)), x, "scale_t")
    if round_to == x.dtype:
        round_to = None
    if round_to is not None and (round_to != torch.bfloat16 or x.dtype != torch.float32):
        raise ValueError(f"cast(round_to={round_to}) on a {x.dtype} tensor: rounding applies to float32 x "
                         "and torch.bfloat16; cast x.to(round_to) instead.")
    return _backend(impl, x).cast(x, scale, spec, scale_t, round_to)


def cast_many(
    xs: list[torch.Tensor], scales: torch.Tensor, spec: CastSpec, *, round_to: torch.dtype | None = None,
    out: torch.Tensor | None = None, impl: str = "auto",
) -> list[torch.Tensor]:
    """Tensorwise ``cast(xs[i], scales[i:i + 1, :1], spec, round_to=round_to)[0]`` of every tensor
    of ``xs``, bitwise, in one kernel launch (the casts of a model's weights after an optimizer
    step: one launch instead of one per weight). Eager only.

    ``xs``: contiguous 2-D tensors of one dtype (bf16 or fp32) on one device; ``scales``: float32
    ``[len(xs), s]``, tensor ``i`` cast with ``scales[i, 0]`` (rows may be padded, e.g. to keep
    each scale 16-byte aligned). Returns fp8 tensors shaped like ``xs`` (views of one buffer).
    ``out``: that buffer, a contiguous 1-D tensor of ``spec.dtype`` and ``sum(x.numel())``
    elements (the casts of the same weights written into the same memory at every step: views
    made once stay current); a new one where None.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> xs = [torch.randn(4, 8), torch.randn(2, 16)]
        >>> a, b = k.cast_many(xs, torch.tensor([[0.5], [2.0]]), f8.CastSpec())
        >>> torch.equal(b.view(torch.uint8), k.cast(xs[1], torch.tensor([[2.0]]), f8.CastSpec())[0].view(torch.uint8))
        True
    """
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"cast_many: xs={type(xs).__name__} of {len(xs) if isinstance(xs, (list, tuple)) else '?'} "
                         "tensors; expected a non-empty list of tensors.")
    for x in xs:
        _check_x(x, "cast_many")
    if len({(x.dtype, x.device) for x in xs}) != 1:
        raise ValueError(f"cast_many: xs mix dtypes / devices {sorted({(str(x.dtype), str(x.device)) for x in xs})}; "
                         "call it once per dtype and device.")
    if not isinstance(spec, CastSpec) or not isinstance(spec.granularity, TensorWise):
        raise ValueError(f"cast_many: spec={spec!r}; expected a CastSpec with TensorWise() (one scale per tensor).")
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.ndim != 2
            or scales.shape[0] != len(xs) or scales.shape[1] < 1 or scales.device != xs[0].device
            or scales.stride(1) != 1):
        got = (tuple(scales.shape), scales.dtype, scales.device) if isinstance(scales, torch.Tensor) else type(scales)
        raise ValueError(f"cast_many: scales is {got}; expected float32 [{len(xs)}, s] (row-major) on {xs[0].device}.")
    if round_to == xs[0].dtype:
        round_to = None
    if round_to is not None and (round_to != torch.bfloat16 or xs[0].dtype != torch.float32):
        raise ValueError(f"cast_many(round_to={round_to}) on {xs[0].dtype} tensors: rounding applies to float32 "
                         "and torch.bfloat16.")
    if out is not None:
        total = sum(x.numel() for x in xs)
        if (not isinstance(out, torch.Tensor) or out.dtype != spec.dtype or out.ndim != 1 or out.numel() != total
                or not out.is_contiguous() or out.device != xs[0].device):
            got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out)
            raise ValueError(f"cast_many: out is {got}; expected a contiguous 1-D {spec.dtype} tensor of {total} "
                             f"elements (the inputs' total) on {xs[0].device}, or out=None.")
    backend = _backend(impl, xs[0])
    if backend is not _reference and not plain_eager(xs if out is None else [*xs, out]):
        backend = _reference  # one launch over raw addresses: for plain tensors outside any tracing or mode
    return backend.cast_many(list(xs), scales, spec, round_to, out)


def amax_rows_cols(x: torch.Tensor, *, out: torch.Tensor | None = None,
                   impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``amax(x, AxisWise(-1))`` and ``amax(x, AxisWise(0))``, bitwise, from one read of ``x`` (the
    scales of a row-wise weight's two casts: per row for the forward, per column for grad_input).
    Eager only.

    ``out``: float32 ``[M + K]`` of zeros that receives them, rows first (a slice of one buffer
    zeroed once for many tensors: one fill, not one per tensor); a new one where None. Returns
    views of it: the row maxima ``(M, 1)`` and the column maxima ``(1, K)``.

    Example:
        >>> import torch, fp8func.kernels as k
        >>> rows, cols = k.amax_rows_cols(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))
        >>> rows.flatten().tolist(), cols.flatten().tolist()
        ([3.0, 2.0], [2.0, 3.0])
    """
    m, k = _check_x(x, "amax_rows_cols")
    if out is None:
        out = torch.zeros(m + k, device=x.device, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (m + k,)
          or out.device != x.device or not out.is_contiguous()):
        got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"amax_rows_cols: out is {got}; expected contiguous float32 zeros of shape ({m + k},) "
                         f"on {x.device} (M + K for x of shape {(m, k)}).")
    backend = _backend(impl, x)
    if backend is not _reference and not plain_eager([x, out]):
        backend = _reference  # launched directly: for plain tensors outside any tracing or mode
    backend.amax_rows_cols(x, out)
    return out[:m].view(m, 1), out[m:].view(1, k)


def cast_rows_cols(
    x: torch.Tensor, row_scale: torch.Tensor, row_spec: CastSpec, col_scale: torch.Tensor, col_spec: CastSpec, *,
    round_to: torch.dtype | None = None, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_with_scale(x, row_scale, row_spec).data`` and ``quantize_with_scale(x, col_scale,
    col_spec).data``, bitwise, from one read of ``x``: a row-wise weight ``[N, K]``'s forward cast
    (one scale per row) and its grad_input cast (one scale per column), both payloads ``[M, K]``
    row-major. Eager only.

    ``row_spec``: ``AxisWise(-1)``, ``row_scale`` ``(M, 1)``; ``col_spec``: ``AxisWise(0)``,
    ``col_scale`` ``(1, K)``. ``round_to=torch.bfloat16``: fp32 ``x`` is cast as ``x.to(torch.bfloat16)``
    would be, without writing that copy.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> x = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
        >>> rows, cols = k.cast_rows_cols(x, torch.tensor([[0.5], [0.25]]), f8.CastSpec(granularity=f8.AxisWise(-1)),
        ...                               torch.tensor([[0.25, 2.0]]), f8.CastSpec(granularity=f8.AxisWise(0)))
        >>> rows.float().tolist(), cols.float().tolist()
        ([[2.0, -8.0], [8.0, 2.0]], [[4.0, -2.0], [8.0, 0.25]])
    """
    m, k = _check_x(x, "cast_rows_cols")
    for spec, axes, name in ((row_spec, (-1, 1), "row_spec"), (col_spec, (0, -2), "col_spec")):
        g = spec.granularity if isinstance(spec, CastSpec) else None
        if not (isinstance(g, AxisWise) and g.axis in axes):
            raise ValueError(f"cast_rows_cols: {name}={spec!r}; expected a CastSpec with AxisWise({axes[0]}).")
    _check_scale(row_scale, (m, 1), x, "row_scale")
    _check_scale(col_scale, (1, k), x, "col_scale")
    if round_to == x.dtype:
        round_to = None
    if round_to is not None and (round_to != torch.bfloat16 or x.dtype != torch.float32):
        raise ValueError(f"cast_rows_cols(round_to={round_to}) on a {x.dtype} tensor: rounding applies to float32 x "
                         "and torch.bfloat16; cast x.to(round_to) instead.")
    backend = _backend(impl, x)
    if backend is not _reference and not plain_eager([x, row_scale, col_scale]):
        backend = _reference  # launched directly: for plain tensors outside any tracing or mode
    return backend.cast_rows_cols(x, row_scale, row_spec, col_scale, col_spec, round_to)


def transpose(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``x.t().contiguous()``, bitwise, for a contiguous 2-D ``x`` of 1-, 2- or 4-byte elements (an
    fp8 payload laid out for the other GEMM operand): one tiled pass, where torch's strided copy of
    1-byte elements runs element by element. Eager only (traced or under a mode: torch's copy).

    Example:
        >>> import torch, fp8func.kernels as k
        >>> k.transpose(torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8)).tolist()
        [[1, 4], [2, 5], [3, 6]]
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_contiguous() or x.element_size() not in (1, 2, 4):
        got = (tuple(x.shape), x.dtype, x.is_contiguous()) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"transpose: x is {got} (shape, dtype, contiguous); expected a contiguous 2-D tensor of "
                         "1-, 2- or 4-byte elements; call x.contiguous() first, or use x.t().contiguous().")
    backend = _backend(impl, x)
    if backend is not _reference and not plain_eager([x]):
        backend = _reference  # launched directly: for plain tensors outside any tracing or mode
    return backend.transpose(x)


def plain_eager(xs) -> bool:
    """Whether ``xs`` are plain tensors seen eagerly: not traced or compiled, no dispatch mode or
    torch.func transform active (what a launch that reads raw addresses needs)."""
    return (not torch.compiler.is_compiling() and all(type(x) is torch.Tensor for x in xs)
            and torch._C._len_torch_dispatch_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None)


def cast_amax(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, *, transpose: bool = False, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Delayed scaling's cast: ``cast(x, scale, spec, transpose=transpose)`` and ``amax(x,
    TensorWise())`` (the amax the next scale is made from), from one read of ``x``.

    Tensorwise only (delayed scaling keeps one scale per tensor). Returns ``(data, data_t or
    None, amax)``, ``amax`` float32 ``(1, 1)``; NaN in ``x`` gives the NaN ``amax`` returns.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> x = torch.tensor([[1.0, -6.0], [2.0, 0.5]])
        >>> data, data_t, amax = k.cast_amax(x, torch.full((1, 1), 0.5), f8.CastSpec(), transpose=True)
        >>> amax.item(), data.float().tolist()
        (6.0, [[2.0, -12.0], [4.0, 1.0]])
    """
    _check_x(x, "cast_amax")
    if not isinstance(spec, CastSpec) or not isinstance(spec.granularity, TensorWise):
        raise ValueError(f"cast_amax: spec={spec!r}; expected a CastSpec with TensorWise() (delayed scaling keeps one "
                         "scale per tensor). Use fp8func.kernels.cast and fp8func.kernels.amax for the others.")
    _check_scale(scale, (1, 1), x, "scale")
    return _backend(impl, x).cast_amax(x, scale, spec, transpose)


def quantize(
    x: torch.Tensor, spec: CastSpec, *, transpose: bool = False, impl: str = "auto", fuse_amax: bool = False
) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """``fp8func.quantize(x, spec)`` and, with ``transpose``, ``fp8func.quantize(x.T.contiguous(), spec)``.

    Fused where a scale group fits one program (row-wise, 1x128 and 128x128 blocks, with their
    transposes for the blocks): one read of ``x``. Tensorwise and row-wise-with-transpose read
    ``x`` twice (an amax pass, then one pass that writes both copies).

    ``fuse_amax`` (tensorwise, under ``torch.compile``): the amax pass as graph ops over the bits
    of ``x``, which inductor fuses into the kernel that produces ``x`` (an RMSNorm, a SiLU-mul, a
    gradient), so that ``x`` is read once more by the cast alone; the same bits as the amax kernel.
    Worth it for a tensor computed in the compiled region, not for one it is given (a weight),
    where the graph's reduction takes a launch of its own, as the amax kernel does (two past 4096
    rows, where inductor reduces the row maxima before the cast). Eagerly it changes nothing.

    Example:
        >>> import torch, fp8func as f8, fp8func.kernels as k
        >>> spec = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), power_of_2=True)
        >>> q, q_t = k.quantize(torch.randn(32, 64), spec, transpose=True)
        >>> q.scale.shape, q_t.scale.shape
        (torch.Size([32, 1]), torch.Size([64, 1]))
    """
    _check_x(x, "quantize")
    _check_spec(x, spec, transpose, "quantize")
    data, scale, data_t, scale_t = _backend(impl, x).quantize(x, spec, transpose, fuse_amax)
    meta = Fp8Meta(spec, x.dtype, None)
    return Fp8Tensor(data, scale, meta), (Fp8Tensor(data_t, scale_t, meta) if transpose else None)
