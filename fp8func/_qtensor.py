"""``Fp8Tensor``: an explicit pytree of (data, scale) with static metadata.

Not a tensor subclass: nothing is dispatched behind the user's back. Leaves are ``data`` (fp8)
and ``scale`` (fp32, same rank as data); ``meta`` is static aux data, so transforms
(``torch.func``, ``torch.compile``, FSDP2's pytree walks) see two tensors and a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import optree
import torch
import torch.utils._pytree as pytree

from ._scaling import CastSpec, block_lengths, transpose_granularity
from ._sharding import Sharding

__all__ = ["Fp8Meta", "Fp8Tensor"]


@dataclass(frozen=True)
class Fp8Meta:
    """Static metadata of an ``Fp8Tensor``.

    Attributes:
        spec: the cast that produced it (dtype, granularity, power-of-two scales).
        orig_dtype: dtype of the high-precision tensor it was quantized from.
        sharding: how ``data`` relates to the logical tensor (None: it is the whole tensor).

    Code that torch.compile traces passes ``sharding`` explicitly, even as None: a meta built
    with the field's default made torch 2.11's dynamo guard on ``dataclasses.fields(Fp8Meta)``
    with a Python-level guard evaluated at every call of the compiled function.
    """

    spec: CastSpec
    orig_dtype: torch.dtype
    sharding: Sharding | None = None


@dataclass(frozen=True)
class Fp8Tensor:
    """Quantized tensor: ``x ≈ data.float() * scale`` (scale broadcast per granularity).

    Attributes:
        data: the FP8 payload, in the logical shape of the tensor.
        scale: fp32 dequantization scales; same rank as ``data``, ``scale.shape[i]`` is the
            number of scale groups along dim ``i`` (1 for a dimension a scale spans entirely).
        meta: static ``Fp8Meta``.

    Example:
        >>> import torch, fp8func as f8
        >>> q = f8.quantize(torch.randn(4, 32), f8.CastSpec(granularity=f8.AxisWise(-1)))
        >>> q.data.dtype, q.scale.shape
        (torch.float8_e4m3fn, torch.Size([4, 1]))
    """

    data: torch.Tensor
    scale: torch.Tensor
    meta: Fp8Meta

    @property
    def spec(self) -> CastSpec:
        return self.meta.spec

    @property
    def granularity(self):
        return self.meta.spec.granularity

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def blocks(self) -> tuple[int | None, ...]:
        """Per-dimension block lengths (``None``: the whole dimension)."""
        return block_lengths(self.granularity, tuple(self.data.shape))

    def transpose(self, dim0: int, dim1: int) -> "Fp8Tensor":
        """The same quantized values, transposed (a view of data and scale; no re-cast)."""
        g = transpose_granularity(self.granularity, self.ndim, dim0, dim1)
        sharding = self.meta.sharding
        if sharding is not None:
            sharding = sharding.transpose(self.ndim, dim0, dim1)
        meta = Fp8Meta(self.meta.spec.with_granularity(g), self.meta.orig_dtype, sharding)
        return Fp8Tensor(self.data.transpose(dim0, dim1), self.scale.transpose(dim0, dim1), meta)

    def t(self) -> "Fp8Tensor":
        """Transpose of a 2-D ``Fp8Tensor``."""
        if self.ndim != 2:
            raise ValueError(f"Fp8Tensor.t() needs 2 dims, got shape {tuple(self.shape)}; use transpose(d0, d1).")
        return self.transpose(0, 1)

    def __repr__(self) -> str:
        return (
            f"Fp8Tensor(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, "
            f"scale_shape={tuple(self.scale.shape)}, spec={self.meta.spec}, "
            f"orig_dtype={self.meta.orig_dtype}, device={self.data.device})"
        )


def _flatten(q: Fp8Tensor):
    return (q.data, q.scale), q.meta


def _unflatten(children, meta: Fp8Meta) -> Fp8Tensor:
    data, scale = children
    return Fp8Tensor(data, scale, meta)


def _flatten_with_keys(q: Fp8Tensor):
    return [(pytree.GetAttrKey("data"), q.data), (pytree.GetAttrKey("scale"), q.scale)], q.meta


# Registered once, here, for torch.utils._pytree (torch.func, dynamo, FSDP2 read it) and optree.
pytree.register_pytree_node(
    Fp8Tensor,
    _flatten,
    _unflatten,
    serialized_type_name="fp8func.Fp8Tensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
optree.register_pytree_node(
    Fp8Tensor,
    lambda q: ((q.data, q.scale), q.meta, ("data", "scale")),
    lambda meta, children: _unflatten(children, meta),
    namespace="fp8func",
)
