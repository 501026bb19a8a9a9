"""Scalar device helpers shared by the Triton kernels: the math of ``fp8func._scaling``.

Element for element what ``fp8func.quantize`` computes: amax is a max over the int32 bit
patterns of ``|x|`` (monotonic for non-negative floats, NaN above inf, exact and associative,
so atomics are safe); ``scale = max(amax, EPS) * (1/fp8_max)`` with NaN propagated; the
power-of-two round-up by the same bit trick; ``1/scale`` as a correctly rounded fp32 division
(what the twin's fp64 quotient rounds to); ``clamp(x * recip, ±max)`` cast to fp8 with
round-to-nearest-even. Two host helpers go with every launch: ``consts`` (the cast's
constexprs) and ``anchor`` (what the launch passes as ``anchor_ptr``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._formats import fp8_max, tracing
from .._scaling import EPS

__all__ = ["abs_bits", "amax_bits", "anchor", "canonical_nan", "consts", "recip", "saturate", "scale_of", "transposed"]

EPS_F32 = tl.constexpr(EPS)  # rounded to fp32 where used, as torch's clamp(min=EPS) does


def consts(dtype: torch.dtype, pow2: bool) -> dict:
    """The ``INV_MAX``, ``FP8_MAX`` and ``POW2`` constexprs of a cast to ``dtype``."""
    return {"INV_MAX": 1.0 / fp8_max(dtype), "FP8_MAX": fp8_max(dtype), "POW2": pow2}


def anchor(x: torch.Tensor) -> torch.Tensor:
    """The kernels' ``anchor_ptr`` argument for input ``x``: never read; under torch.compile a
    one-element ``as_strided`` view of ``x``, eagerly ``x`` itself.

    Inductor gives a Triton kernel that reads a tensor not yet written to memory (the output of
    an RMSNorm, a SiLU-mul, a gradient) its own copy of it, fused into the producing kernel as one
    more store: a tensor read by an amax and a cast kernel, or by the casts of q, k and v, was
    written two to six times. ``as_strided`` makes inductor write the tensor's buffer once, before
    the first kernel that reads it, and each kernel then reads that buffer in place. Where the
    buffer's layout is not the one the kernel reads (inductor padded its rows), inductor still
    copies it to the strides the kernel was traced with: the view only ever saves a copy.
    """
    if type(x) is torch.Tensor or not x.numel() or not tracing():
        return x
    return x.as_strided((1,), (1,))


@triton.jit
def abs_bits(x):
    """``|x|`` as int32 bits: ordered like the floats, NaN above inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def canonical_nan(bits):
    """``|x|`` bits with every NaN as the standard quiet NaN 0x7FC00000 (see ``_reference.amax``)."""
    return tl.where(bits > 0x7F800000, 0x7FC00000, bits)


@triton.jit
def amax_bits(x):
    """``abs_bits`` with every NaN canonical."""
    return canonical_nan(abs_bits(x))


@triton.jit
def scale_of(amax, INV_MAX: tl.constexpr, POW2: tl.constexpr):
    """``max(amax, EPS) * (1/fp8_max)``, NaN propagated; rounded up to 2**k if ``POW2``."""
    s = tl.maximum(amax, EPS_F32, propagate_nan=tl.PropagateNan.ALL) * INV_MAX
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        up = ((bits + 0x7FFFFF) & -0x800000).to(tl.float32, bitcast=True)
        s = tl.where((bits & 0x7F800000) != 0x7F800000, up, s)  # non-finite passes through
    return s


@triton.jit
def recip(scale):
    """The correctly rounded fp32 ``1 / scale`` (IEEE ``div.rn``; Triton's ``/`` is approximate).

    Equal to ``_ops.reciprocal``'s fp64 quotient rounded to fp32: double rounding is harmless
    for a quotient when 53 >= 2 * 24 + 2.
    """
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def saturate(x, inv, FP8_MAX: tl.constexpr):
    """``clamp(x * inv, ±max)`` in fp32, NaN kept; the caller's ``.to(fp8)`` rounds to nearest even."""
    return tl.clamp(x * inv, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def transposed(x, x_raw, RAW_T: tl.constexpr):
    """``x.T`` in fp32: the fp32 tile transposed, or with ``RAW_T`` the raw (input dtype) tile
    transposed and then upcast (the same values: the upcast is exact; ``Config.raw_t``).

    Every transposed copy is cast from a transposed high-precision tile, never by transposing
    the fp8 tile: Triton 3.6 miscompiles some layouts of a transposed 8-bit tensor (a share of
    the bytes come out wrong), while every transposed-first layout tested is right.
    """
    if RAW_T:
        x_t = tl.trans(x_raw).to(tl.float32)
    else:
        x_t = tl.trans(x)
    return x_t
