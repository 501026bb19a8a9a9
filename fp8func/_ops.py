"""Pure quantize / dequantize: the obviously-right twins every fast kernel is tested against.

Gradients: the FP8 payload of a cast is not differentiable. ``quantize`` returns an
``Fp8Tensor`` whose data and scale are detached, so ``dequantize(quantize(x))`` has no gradient
path to ``x`` (differentiating through a rounding to FP8 would give neither the true derivative,
which is zero almost everywhere, nor a useful estimate). ``fake_quantize`` is the differentiable
form for quantization-aware code: its value is ``dequantize(quantize(x))``, bitwise, and its
gradient is the straight-through estimator (the identity). ``linear``'s gradients are its own
FP8 backward, independent of this rule.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ._formats import saturate_cast
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import (
    CastSpec,
    block_lengths,
    compute_amax,
    compute_scale,
    expand_scale,
    merge_groups,
    scale_shape,
    split_groups,
)
from ._sharding import Sharding, check_blocks_within_shards, reduce_amax

__all__ = ["quantize", "quantize_with_scale", "dequantize", "fake_quantize"]


def check_hp(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(
            f"{what}: expected a high-precision floating tensor (fp32/bf16/fp16), got dtype={x.dtype}."
        )


def _check_finite(x: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "quantize(..., check_finite=True) reads the tensor on the host and cannot run under "
            "torch.compile; call it eagerly (it is a debugging aid) or drop check_finite."
        )
    if x.dtype == torch.float64:
        # The scales and the cast are fp32: a float64 value beyond fp32's range becomes inf there.
        big = x.abs() > torch.finfo(torch.float32).max
        if bool(big.any()):
            first = tuple(int(i) for i in big.nonzero()[0])
            raise ValueError(
                f"quantize: float64 input of shape {tuple(x.shape)} has {int(big.sum())} value(s) beyond the float32 "
                f"range, first {x[first].item()} at index {first}; fp8func computes scales in float32, where "
                "they overflow to inf. Rescale the tensor into float32's range first."
            )
    bad = ~torch.isfinite(x)
    n_bad = int(bad.sum())
    if n_bad:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"quantize: input of shape {tuple(x.shape)} has {n_bad} non-finite value(s), first "
            f"{x[first].item()} at index {first}. A NaN/inf makes its scale group NaN. Find where "
            "it comes from (e.g. torch.autograd.detect_anomaly), or quantize with check_finite=False "
            "to let it propagate."
        )


def apply_scale(x: torch.Tensor, factor: torch.Tensor, blocks) -> torch.Tensor:
    """``x * factor`` with ``factor`` broadcast over its groups, in fp32."""
    x = x.float()
    if all(b is None or b == 1 for b in blocks):
        return x * factor  # scale has the data's rank with 1s where it spans: plain broadcast
    return merge_groups(split_groups(x, blocks) * expand_scale(factor))


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 ``1 / scale``, on every backend.

    Computed in fp64 and rounded to fp32: double rounding is harmless for a quotient when the
    wider format has at least 2p+2 bits (53 >= 2*24+2), so this equals the IEEE fp32 reciprocal.
    Inductor's generated GPU code computes an fp32 ``1 / x`` with an approximate division, which
    differs from eager in the last bit for many scales; an fp64 one exactly.
    """
    return torch.reciprocal(scale.double()).float()


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, spec: CastSpec, *, sharding: Sharding | None = None
) -> Fp8Tensor:
    """Casts ``x`` to FP8 with given dequantization scales (e.g. a mesh-reduced or delayed scale).

    ``data = saturate(x * (1 / scale))``; see ``fp8func._scaling`` for why the reciprocal.
    """
    check_hp(x, "quantize_with_scale")
    blocks = block_lengths(spec.granularity, tuple(x.shape))
    want = scale_shape(spec.granularity, tuple(x.shape))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(
            f"quantize_with_scale: scale has shape {tuple(scale.shape)} and dtype {scale.dtype}; "
            f"{spec.granularity!r} on shape {tuple(x.shape)} needs float32 scales of shape {want}."
        )
    data = saturate_cast(apply_scale(x.detach(), reciprocal(scale.detach()), blocks), spec.dtype)
    return Fp8Tensor(data, scale.detach(), Fp8Meta(spec, x.dtype, sharding))


def quantize(
    x: torch.Tensor,
    spec: CastSpec,
    *,
    sharding: Sharding | tuple[Sharding, ...] | None = None,
    check_finite: bool = False,
    state=None,
) -> Fp8Tensor:
    """Quantizes ``x`` to FP8 with scales computed from its own amax (dynamic scaling).

    Returns an ``Fp8Tensor``, always; its payload is not differentiable (module docstring).
    Delayed scaling, which threads a state, is ``quantize_delayed``.

    ``scale = max(amax, EPS) * (1 / fp8_max)`` per group (rounded up to a power of two when
    ``spec.pow2_scales``), ``data = saturate(x * (1 / scale))``. Values beyond the range saturate at
    ±fp8_max, never inf. A NaN or inf in a group makes that group's scale non-finite, so the
    whole group dequantizes to NaN: bad values are never hidden. ``check_finite=True`` raises
    instead (eager only).

    With ``sharding``, ``x`` is a local shard: the amax is reduced (MAX) over exactly the mesh
    dims that split a scale group (``Sharding.amax_mesh_dims``), so every shard is cast with the
    scale of the logical tensor and ``all_gather(quantize(shard))`` equals
    ``quantize(all_gather(shard))`` bitwise.

    Example:
        >>> import torch, fp8func as f8
        >>> q = f8.quantize(torch.tensor([[1.0, -2.0], [0.5, 448.0]]), f8.CastSpec())
        >>> f8.dequantize(q, dtype=torch.float32)
        tensor([[  1.,  -2.],
                [  0.5, 448.]])
    """
    check_hp(x, "quantize")
    if not isinstance(spec, CastSpec):
        raise TypeError(f"quantize: spec={spec!r} is not a CastSpec; e.g. fp8func.CastSpec(dtype=fp8func.E4M3).")
    if check_finite:
        _check_finite(x)
    if state is not None:
        raise TypeError("quantize returns an Fp8Tensor and scales dynamically; for delayed scaling call "
                        "fp8func.quantize_delayed(x, spec, state) -> (Fp8Tensor, new_state).")
    if isinstance(x, DTensor):  # DTensor ops reduce the amax globally; a block must not straddle shards
        check_blocks_within_shards(x, spec.granularity)
    amax = compute_amax(x.detach(), spec.granularity)
    shardings = () if sharding is None else (sharding,) if isinstance(sharding, Sharding) else tuple(sharding)
    for sh in shardings:  # nested shardings (FSDP over TP): reduce over each one's split dims
        amax = reduce_amax(amax, sh.mesh, sh.amax_mesh_dims(spec.granularity, tuple(x.shape)))
    scale = compute_scale(amax, spec.dtype, spec.pow2_scales)
    return quantize_with_scale(x, scale, spec, sharding=shardings[0] if len(shardings) == 1 else None)


def dequantize(q: Fp8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q.data.float() * q.scale`` (broadcast per granularity), cast to ``dtype``.

    ``dtype`` defaults to the dtype the tensor was quantized from.
    """
    if not isinstance(q, Fp8Tensor):
        raise TypeError(f"dequantize: expected an Fp8Tensor, got {type(q).__name__}.")
    out = apply_scale(q.data, q.scale, q.blocks)
    return out.to(q.meta.orig_dtype if dtype is None else dtype)


class _FakeQuantizeFn(torch.autograd.Function):
    """``dequantize(quantize(x))`` with the identity as its gradient (straight-through)."""

    @staticmethod
    def forward(x, spec: CastSpec):
        return dequantize(quantize(x, spec))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None

    @staticmethod
    def vmap(info, in_dims, x, spec):
        # each example its own scales, as quantize of one example
        outs = [_FakeQuantizeFn.apply(x.select(in_dims[0], i), spec) for i in range(info.batch_size)]
        return torch.stack(outs), 0


torch._dynamo.allow_in_graph(_FakeQuantizeFn)


def fake_quantize(x: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """``dequantize(quantize(x, spec))``, bitwise, with a straight-through gradient (the identity).

    The differentiable form of a round trip through FP8, for quantization-aware code; ``quantize``
    itself returns a non-differentiable payload. Works under ``torch.func`` transforms and
    ``torch.compile``.

    Example:
        >>> import torch, fp8func as f8
        >>> x = torch.randn(4, 32, requires_grad=True)
        >>> f8.fake_quantize(x, f8.CastSpec()).sum().backward()
        >>> bool((x.grad == 1).all())
        True
    """
    check_hp(x, "fake_quantize")
    if not isinstance(spec, CastSpec):
        raise TypeError(f"fake_quantize: spec={spec!r} is not a CastSpec; e.g. fp8func.CastSpec(dtype=fp8func.E4M3).")
    return _FakeQuantizeFn.apply(x, spec)
