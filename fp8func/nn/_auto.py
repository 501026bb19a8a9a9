"""``convert(..., filter="auto")``: keep a layer in bf16 where FP8 would be slower.

A roofline model of one linear layer's training step (forward, input gradient, weight gradient)
at ``tokens`` rows, calibrated on the GPU (``python -m fp8func.bench calibrate``):

* bf16: three GEMMs, each ``max(flops / bf16_peak, bytes / bandwidth)``;
* FP8: the same three GEMMs at the FP8 rate of the recipe's kernel, plus the casts: every
  operand (input, weight, grad_output) read in high precision and written in fp8 once per copy
  (two copies when the backward needs the operand cast along the other axis), with the extra
  amax pass a tensor-wise or column-wise scale needs (none with delayed scaling, whose one pass
  also records the amax); plus a fixed cost per extra kernel;
* a floor per step: the host time to launch the step (autograd, the compiled graphs' launch),
  measured on an isolated compiled layer. Small layers are host-bound, and the FP8 step, with
  more kernels and an autograd.Function, has the higher floor.

The model only ranks the two options; ``report(model)`` shows its figures per layer, and
``python -m fp8func.bench linear`` measures the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._scaling import AxisWise, BlockWise, Recipe, TensorWise

__all__ = ["DeviceProfile", "PROFILES", "estimate_ms", "profile_for"]


@dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one GPU kind (see ``python -m fp8func.bench calibrate``)."""

    name: str
    bf16_tflops: float  # dense bf16 GEMM, large square
    fp8_tflops: dict  # scaled_mm kind -> TFLOP/s, large square
    bandwidth_gbs: float  # device copy bandwidth (read + write bytes / s)
    kernel_us: float  # fixed cost of one extra kernel (launch and tail)
    floor_ms: dict  # "bf16" / "fp8" -> host time of one layer's fwd+bwd (small shapes)
    source: str


# H200: `python -m fp8func.bench calibrate` and the small shapes of `... bench linear`
# (docs/benchmarks.md), torch 2.11, 2026-11-22.
PROFILES = {
    "H200": DeviceProfile("H200", 778.5, {"tensorwise": 1229.4, "rowwise": 1290.7, "blockwise": 1085.9},
                          4101.3, 7.1, {"bf16": 0.55, "fp8": 1.0}, "measured on an H200, torch 2.11, 2026-11-22"),
}
PROFILES["H100"] = DeviceProfile(  # not measured yet: the H200's rates at the H100's nominal 3.35 TB/s
    "H100", 778.5, dict(PROFILES["H200"].fp8_tflops), 4101.3 * 3.35 / 4.8, 7.1, dict(PROFILES["H200"].floor_ms),
    "H200 rates scaled to the H100's bandwidth (not measured)")


def profile_for(device: torch.device | str | None = None) -> DeviceProfile:
    """The profile of ``device`` (default: the current CUDA GPU), else the H200's."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device if device is not None and torch.device(device).type == "cuda" else None)
        for key in PROFILES:
            if key in name:
                return PROFILES[key]
    return PROFILES["H200"]


def _gemm_kind(recipe: Recipe) -> str:
    g = recipe.input.granularity
    if isinstance(g, TensorWise):
        return "tensorwise"
    if isinstance(g, AxisWise):
        return "rowwise"
    return "blockwise"


def _cast_bytes_and_kernels(spec, numel: int, hp_bytes: int, two_copies: bool,
                            delayed: bool = False) -> tuple[float, int]:
    """Bytes moved (and kernels launched) to cast one operand of ``numel`` elements."""
    g = spec.granularity
    if delayed:  # the scale is known: one pass writes every copy and the amax; a state update after
        return numel * (hp_bytes + (2 if two_copies else 1)), 2
    if isinstance(g, TensorWise):  # an amax pass, then one cast pass writing every copy
        return numel * (2 * hp_bytes + (2 if two_copies else 1)), 2
    if isinstance(g, (AxisWise, BlockWise)):  # one fused pass per copy; a column amax for the other axis
        extra = numel * (2 * hp_bytes + 1) if two_copies else 0
        return numel * (hp_bytes + 1) + extra, 3 if two_copies else 1
    return numel * (2 * hp_bytes + 1), 2


def estimate_ms(m: int, k: int, n: int, recipe: Recipe | None, profile: DeviceProfile,
                hp_bytes: int = 2) -> float:
    """Modelled fwd+bwd time (ms) of a ``[m, k] x [n, k]`` linear; ``recipe=None``: bf16."""
    flops = 2.0 * m * k * n
    bw = profile.bandwidth_gbs * 1e9
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # y, dx, dw: (rows, contraction, cols)
    if recipe is None:
        gpu = 1e3 * sum(max(flops / (profile.bf16_tflops * 1e12),
                            hp_bytes * (r * c + c * o + r * o) / bw) for r, c, o in shapes)
        return max(gpu, profile.floor_ms["bf16"])
    rate = profile.fp8_tflops[_gemm_kind(recipe)] * 1e12
    gemms = sum(max(flops / rate, (r * c + c * o + hp_bytes * r * o) / bw) for r, c, o in shapes)
    casts, kernels = 0.0, 0
    for spec, numel, hp_only in ((recipe.input, m * k, recipe.grad_weight_hp), (recipe.weight, n * k, False),
                                 (recipe.grad_output, m * n, recipe.grad_weight_hp)):
        b, kk = _cast_bytes_and_kernels(spec, numel, hp_bytes, two_copies=not hp_only,
                                        delayed=recipe.delayed is not None)
        casts, kernels = casts + b, kernels + kk
    if recipe.grad_weight_hp:  # a bf16 grad_weight GEMM instead of an FP8 one
        gemms += flops / (profile.bf16_tflops * 1e12) - flops / rate
    gpu = 1e3 * (gemms + casts / bw) + kernels * profile.kernel_us * 1e-3
    return max(gpu, profile.floor_ms["fp8"])
