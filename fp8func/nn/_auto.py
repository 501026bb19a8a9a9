"""``convert(..., filter="auto")``: keep a layer in bf16 where FP8 would be slower.

A roofline model of one linear layer's training step (forward, input gradient, weight gradient)
at ``tokens`` rows, from rates measured on the GPU (``python -m fp8func.bench calibrate``) and
kept in ``_calibration.json`` with the device, torch version, date and commands:

* bf16: three GEMMs, each ``max(flops / bf16_peak, bytes / bandwidth)``;
* FP8: the same three GEMMs at the FP8 rate of the plan's kernel (high-precision GEMMs at the
  bf16 rate), plus the casts the plan makes: every operand read in high precision and written in
  fp8 once per copy (two copies when a backward GEMM needs the operand cast along its other
  axis), with the extra amax pass a tensor-wise or column-wise scale needs (none with delayed
  scaling, whose one pass also records the amax); plus a fixed cost per extra kernel.

``convert`` prices a layer as it runs inside a compiled model, where the host work of one layer
overlaps the GPU work of the others: GPU time only. ``estimate_ms(..., isolated=True)`` adds
what an isolated, synchronized layer also pays, as ``python -m fp8func.bench auto`` measures it:
a host floor per step and the lead of a synchronized step over a back-to-back one.

FP8 is chosen where the modelled speedup is ``MARGIN`` or more. ``report(model)`` shows the
modelled figures per layer; ``python -m fp8func.bench model --configs ...,auto`` checks the
decisions on a whole model.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
from dataclasses import dataclass

import torch

from .._log import warn_once
from .._plan import LinearPlan, operand, plan
from .._scaling import AxisWise, BlockWise, Recipe, TensorWise

log = logging.getLogger("fp8func")

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


def _load_profiles() -> dict[str, DeviceProfile]:
    """The calibrated devices, from ``_calibration.json`` (package data)."""
    raw = json.loads(importlib.resources.files(__package__).joinpath("_calibration.json").read_text())
    fields = ("bf16_tflops", "fp8_tflops", "bandwidth_gbs", "kernel_us", "floor_ms", "lead_ms")
    return {key: DeviceProfile(key, *(d[f] for f in fields),
                               f"{d['device']}, torch {d['torch']}, {d['date']} ({'; '.join(d['commands'])})")
            for key, d in raw.items()}


PROFILES = _load_profiles()
_FALLBACK = "H200"


def profile_for(device: torch.device | str | None = None) -> DeviceProfile:
    """The profile of ``device`` (default: the current CUDA GPU). A device with no calibration
    gets the H200's, logged once: run ``python -m fp8func.bench calibrate`` there and add its
    rates to ``_calibration.json``."""
    name = "no CUDA GPU"
    if torch.cuda.is_available():
        cuda = device is not None and torch.device(device).type == "cuda"
        name = torch.cuda.get_device_name(device if cuda else None)
        for key in PROFILES:
            if key in name:
                return PROFILES[key]
    warn_once(("no calibration", name), "fp8func: convert(filter='auto') has no calibration for %s; using the %s's "
              "(%s).", name, _FALLBACK, PROFILES[_FALLBACK].source)
    return PROFILES[_FALLBACK]


def recipe_kind(recipe: Recipe | LinearPlan) -> str:
    """The floor key of ``recipe``: "delayed" for delayed scaling, else its GEMM kind."""
    p = plan(recipe)
    return "delayed" if p.delayed is not None else _gemm_kind(p)


def _gemm_kind(p: LinearPlan) -> str:
    g = p.output.a.granularity
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


def estimate_ms(m: int, k: int, n: int, recipe: Recipe | LinearPlan | None, profile: DeviceProfile,
                hp_bytes: int = 2, isolated: bool = False) -> float:
    """Modelled fwd+bwd time (ms) of a ``[m, k] x [n, k]`` linear; ``recipe=None``: bf16. GPU
    time, as inside a compiled model; ``isolated``: an isolated layer's synchronized step,
    ``max(gpu, floor) (+ lead for FP8)``."""
    flops = 2.0 * m * k * n
    bw = profile.bandwidth_gbs * 1e9
    shapes = ((m, k, n), (m, n, k), (n, m, k))  # y, dx, dw: (rows, contraction, cols)
    bf16_rate = profile.bf16_tflops * 1e12
    if recipe is None:
        gpu = 1e3 * sum(max(flops / bf16_rate, hp_bytes * (r * c + c * o + r * o) / bw) for r, c, o in shapes)
        return max(gpu, profile.floor_ms["bf16"]) if isolated else gpu
    p = plan(recipe)
    kind = _gemm_kind(p)
    rate = profile.fp8_tflops[kind] * 1e12
    rates = (rate, rate, profile.fp8_tflops.get(kind + "_dw", profile.fp8_tflops[kind]) * 1e12)  # y, dx, dw
    gemms = 0.0
    for g, (r, c, o), fp8_rate in zip((p.output, p.grad_input, p.grad_weight), shapes, rates):
        if g.hp:
            gemms += max(flops / bf16_rate, hp_bytes * (r * c + c * o + r * o) / bw)
        else:
            gemms += max(flops / fp8_rate, (r * c + c * o + hp_bytes * r * o) / bw)
    casts, kernels = 0.0, 0
    for role, numel in (("x", m * k), ("w", n * k), ("dy", m * n)):
        ops = operand(p, role)
        # the backward GEMM reads a second copy (a transposed layout or other groups) where it is FP8
        two = ops.second is not None
        b, kk = _cast_bytes_and_kernels(ops.first, numel, hp_bytes, two_copies=two, delayed=p.delayed is not None)
        casts, kernels = casts + b, kernels + kk
    gpu = 1e3 * (gemms + casts / bw) + kernels * profile.kernel_us * 1e-3
    if not isolated:
        return gpu
    kind = recipe_kind(p)
    return max(gpu, profile.floor_ms[kind]) + profile.lead_ms[kind]
