"""FP8 formats: dtypes, their ranges, saturating casts and power-of-two scale rounding.

Everything here is a pure function of tensors and dtypes. The one scale convention of the
library is stated in ``fp8func/_scaling.py``: ``x ≈ data.float() * scale``.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "FP8_DTYPES",
    "fp8_max",
    "check_fp8_dtype",
    "saturate_cast",
    "round_up_to_pow2",
    "to_e8m0",
    "fp8_ulp",
    "tracing",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
FP8_DTYPES = (E4M3, E5M2)

# Exponent bias and mantissa bits of the two element formats (OCP FP8).
_MANTISSA_BITS = {E4M3: 3, E5M2: 2}
_MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}


def tracing() -> bool:
    """Whether this code is being traced by torch.compile: dynamo, or AOTAutograd tracing the
    body of an ``allow_in_graph`` function (the casts and GEMMs of ``linear``), where
    ``torch.compiler.is_compiling()`` is False but tensors are fake."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def check_fp8_dtype(dtype: torch.dtype) -> torch.dtype:
    """Returns ``dtype`` if it is one of the supported FP8 element types, else raises."""
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"dtype={dtype} is not an FP8 element type; expected one of "
            f"{[str(d) for d in FP8_DTYPES]} (fp8func.E4M3 or fp8func.E5M2)."
        )
    return dtype


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(check_fp8_dtype(dtype)).max)


def saturate_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Casts fp32 ``x`` to ``dtype``, clamping to ±max first.

    Plain casts disagree across devices (E5M2 overflows to inf, E4M3 to NaN or max); the clamp
    makes every device saturate. ``clamp`` propagates NaN, so NaN stays NaN.
    """
    m = fp8_max(dtype)
    return x.clamp(min=-m, max=m).to(dtype)


def round_up_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Rounds positive fp32 values up to the next power of two, exactly, by bit manipulation.

    ``(bits + 0x7FFFFF) & 0xFF800000`` keeps the exponent of an exact power of two and bumps it
    otherwise; log2/exp2 would depend on the libm. Non-finite values pass through unchanged.
    """
    if scale.dtype != torch.float32:
        raise ValueError(f"round_up_to_pow2 takes float32 scales, got dtype={scale.dtype}.")
    bits = scale.view(torch.int32)
    rounded = ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)  # -0x800000 == 0xFF800000
    return torch.where(torch.isfinite(scale), rounded, scale)


def to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Converts power-of-two fp32 scales (MX) to the OCP e8m0 scale type, exactly.

    Raises if a scale is not a power of two within e8m0's range [2**-127, 2**127].
    """
    exp = torch.frexp(scale.float()).exponent - 1
    bad = (scale <= 0) | (scale != torch.ldexp(torch.ones_like(scale), exp)) | (exp < -127) | (exp > 127)
    if bool(bad.any()):
        raise ValueError(
            "to_e8m0 needs positive power-of-two scales in [2**-127, 2**127]; got "
            f"{scale[bad].flatten()[:4].tolist()}. Quantize with an MX granularity or power_of_2=True."
        )
    return (exp + 127).to(torch.uint8).view(E8M0)


def fp8_ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of the FP8 grid at magnitude ``|v|`` (the subnormal spacing below the normal range)."""
    mant = _MANTISSA_BITS[check_fp8_dtype(dtype)]
    exp = torch.frexp(v.abs().float()).exponent - 1  # |v| in [2**exp, 2**(exp+1))
    exp = exp.clamp(min=_MIN_NORMAL_EXP[dtype])
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exp - mant)
