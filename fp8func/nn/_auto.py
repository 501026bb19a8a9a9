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
  measured on an isolated compiled layer, per recipe. Small layers are host-bound, and the FP8
  step, with more kernels and an autograd.Function, has the higher floor (delayed scaling and
  the block-scaled recipes the highest);
* plus, for FP8, the lead: the host time a synchronized step pays before (and between) its
  kernels on top of the back-to-back step, the largest measured per recipe. With it the model
  estimates the slower of the two timings of ``python -m fp8func.bench linear``, so a layer it
  converts is not slower than bf16 in either (bf16's lead measured ~0: its median difference is
  -0.01 ms). Without it, layers modelled at 1.06-1.17x measured 0.71-0.99x synchronized.

FP8 is chosen where the modelled speedup is ``MARGIN`` or more: the synchronized timing of one
case moved by up to 15% between runs (a layer modelled at 1.03x measured 1.16x in one run and
0.95x in another). ``report(model)`` shows the modelled figures per layer; ``python -m fp8func.bench
auto`` checks every decision against measurement (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._scaling import AxisWise, BlockWise, Recipe, TensorWise

__all__ = ["DeviceProfile", "MARGIN", "PROFILES", "estimate_ms", "profile_for", "recipe_kind"]

MARGIN = 1.05  # the modelled bf16 / fp8 time a layer needs to be converted


@dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one GPU kind (see ``python -m fp8func.bench calibrate``)."""

    name: str
    bf16_tflops: float  # dense bf16 GEMM, large square
    fp8_tflops: dict  # scaled_mm kind -> TFLOP/s, large square ("blockwise_dw": the 1x128 x 128x1 GEMM)
    bandwidth_gbs: float  # device copy bandwidth (read + write bytes / s)
    kernel_us: float  # fixed cost of one extra kernel (launch and tail)
    floor_ms: dict  # "bf16" / recipe_kind -> host-bound time of one layer's fwd+bwd (small shapes)
    lead_ms: dict  # recipe_kind -> synchronized minus back-to-back step time, the largest measured
    source: str


# H200, torch 2.11: the rates by `python -m fp8func.bench calibrate` (2026-11-23 09:13 UTC;
# "blockwise_dw": the 1x128 x 128x1 grad-weight GEMM); floors and leads by
# `python -m fp8func.bench auto` (2026-11-23 09:05-09:07 UTC):
# the floor per recipe is the median over the host-bound shapes (4096x4096x1024 twice,
# 8192x4096x1024, 2048x4096x1024, 4096x2048x2048) of the slower of the synchronized and
# back-to-back step times; the lead the largest synchronized minus back-to-back time over the
# nine shapes with M * K * N >= 8192 * 4096 * 4096.
PROFILES = {
    "H200": DeviceProfile("H200", 770.2, {"tensorwise": 1368.2, "rowwise": 1320.4, "blockwise": 1119.8,
                                          "blockwise_dw": 853.3},
                          4116.4, 6.9, {"bf16": 0.55, "tensorwise": 1.14, "rowwise": 1.41, "blockwise": 1.51,
                                        "delayed": 1.49},
                          {"tensorwise": 0.32, "rowwise": 0.40, "blockwise": 0.46, "delayed": 0.49},
                          "measured on an H200, torch 2.11, 2026-11-23"),
}
PROFILES["H100"] = DeviceProfile(  # not measured yet: the H200's rates at the H100's nominal 3.35 TB/s
    "H100", PROFILES["H200"].bf16_tflops, dict(PROFILES["H200"].fp8_tflops), PROFILES["H200"].bandwidth_gbs * 3.35 / 4.8,
    PROFILES["H200"].kernel_us, dict(PROFILES["H200"].floor_ms), dict(PROFILES["H200"].lead_ms),
    "H200 rates scaled to the H100's bandwidth (not measured)")


def profile_for(device: torch.device | str | None = None) -> DeviceProfile:
    """The profile of ``device`` (default: the current CUDA GPU), else the H200's."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device if device is not None and torch.device(device).type == "cuda" else None)
        for key in PROFILES:
            if key in name:
                return PROFILES[key]
    return PROFILES["H200"]


def recipe_kind(recipe: Recipe) -> str:
    """The floor key of ``recipe``: "delayed" for delayed scaling, else its GEMM kind."""
    return "delayed" if recipe.delayed is not None else _gemm_kind(recipe)


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
    if isinstance(g, BlockWise):  # one pass writes both copies (the +T block kernels)
        return numel * (hp_bytes + (2 if two_copies else 1)), 1
    if isinstance(g, AxisWise):  # one fused pass per copy; a column amax for the other axis
        extra = numel * (2 * hp_bytes + 1) if two_copies else 0
        return numel * (hp_bytes + 1) + extra, 3 if two_copies else 1
    return numel * (2 * hp_bytes + 1), 2


def estimate_ms(m: int, k: int, n: int, recipe: Recipe | None, profile: DeviceProfile,
                hp_bytes: int = 2) -> float:
    """Modelled fwd+bwd time (ms) of a ``[m, k] x [n, k]`` linear; ``recipe=None``: bf16. For FP8
    the slower of a synchronized and a back-to-back step: ``max(gpu, floor) + lead``."""
    flops = 2.0 * m * k * n
    bw = profile.bandwidth_gbs * 1e9
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # y, dx, dw: (rows, contraction, cols)
    if recipe is None:
        gpu = 1e3 * sum(max(flops / (profile.bf16_tflops * 1e12),
                            hp_bytes * (r * c + c * o + r * o) / bw) for r, c, o in shapes)
        return max(gpu, profile.floor_ms["bf16"])
    gemm_kind = _gemm_kind(recipe)
    rate = profile.fp8_tflops[gemm_kind] * 1e12
    rates = (rate, rate, profile.fp8_tflops.get(gemm_kind + "_dw", profile.fp8_tflops[gemm_kind]) * 1e12)  # y, dx, dw
    gemms = sum(max(flops / rate, (r * c + c * o + hp_bytes * r * o) / bw) for (r, c, o), rate in zip(shapes, rates))
    casts, kernels = 0.0, 0
    for spec, numel, hp_only in ((recipe.input, m * k, recipe.grad_weight_hp), (recipe.weight, n * k, False),
                                 (recipe.grad_output, m * n, recipe.grad_weight_hp)):
        b, kk = _cast_bytes_and_kernels(spec, numel, hp_bytes, two_copies=not hp_only,
                                        delayed=recipe.delayed is not None)
        casts, kernels = casts + b, kernels + kk
    if recipe.grad_weight_hp:  # a bf16 grad_weight GEMM instead of an FP8 one
        gemms += flops / (profile.bf16_tflops * 1e12) - flops / rates[2]
    gpu = 1e3 * (gemms + casts / bw) + kernels * profile.kernel_us * 1e-3
    kind = recipe_kind(recipe)
    return max(gpu, profile.floor_ms[kind]) + profile.lead_ms[kind]
