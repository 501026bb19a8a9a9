"""``Fp8Tensor``: an explicit pytree of (data, scale) with static metadata.

Not a tensor subclass: nothing is dispatched behind the user's back. Leaves are ``data`` (fp8)
and ``scale`` (fp32, same rank as data); ``meta`` is static aux data, so transforms
(``torch.func``, ``torch.compile``, FSDP2's pytree walks) see two tensors and a constant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import optree
import torch
import torch.utils._pytree as pytree

from ._formats import FP8_DTYPES
from ._scaling import (
    MX,
    AxisWise,
    BlockWise,
    CastSpec,
    DelayedScaling,
    TensorWise,
    block_lengths,
    raw_block_lengths,
    transpose_granularity,
)
from ._sharding import Sharding

__all__ = ["Fp8Meta", "Fp8Tensor", "trusted_fp8_tensor"]


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

    def __post_init__(self):
        if not isinstance(self.spec, CastSpec):
            raise TypeError(f"Fp8Meta(spec={self.spec!r}): expected a CastSpec.")
        if not isinstance(self.orig_dtype, torch.dtype):
            raise TypeError(f"Fp8Meta(orig_dtype={self.orig_dtype!r}): expected a torch.dtype such as torch.bfloat16.")
        if self.sharding is not None and not isinstance(self.sharding, Sharding):
            raise TypeError(f"Fp8Meta(sharding={self.sharding!r}): expected a fp8func.Sharding or None.")


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

    def __post_init__(self):
        if not isinstance(self.meta, Fp8Meta):
            raise TypeError(f"Fp8Tensor(meta={self.meta!r}): expected an Fp8Meta.")
        # Pytree code (vmap's in_dims, tree_map with placeholders) builds nodes whose leaves are not
        # tensors; only tensors are checked.
        if isinstance(self.data, torch.Tensor) and isinstance(self.scale, torch.Tensor):
            _check_leaves(self.data, self.scale, self.meta)

    def __reduce__(self):
        # fp8 storages do not pickle (torch 2.13); the payload travels as its bytes.
        return _rebuild, (self.data.view(torch.uint8), str(self.data.dtype).removeprefix("torch."), self.scale,
                          self.meta)

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


def _check_leaves(data: torch.Tensor, scale: torch.Tensor, meta: Fp8Meta) -> None:
    """Raises unless ``data`` is the spec's fp8 dtype and ``scale`` fp32 scales of the right shape."""
    spec = meta.spec
    if data.dtype not in FP8_DTYPES or data.dtype != spec.dtype:
        raise TypeError(f"Fp8Tensor: data has dtype {data.dtype}; its meta's spec casts to {spec.dtype}. Build "
                        "Fp8Tensors with fp8func.quantize, or view raw bytes as the spec's dtype "
                        "(data.view(spec.dtype)).")
    if scale.dtype != torch.float32 or scale.ndim != data.ndim:
        raise TypeError(f"Fp8Tensor: scale has dtype {scale.dtype} and {scale.ndim} dims; expected float32 with the "
                        f"data's {data.ndim} dims.")
    # A DTensor payload may carry a scale that is local or global: the shapes agree only when the
    # two are the same kind of tensor.
    if type(data) is type(scale) or not (hasattr(data, "device_mesh") or hasattr(scale, "device_mesh")):
        blocks = raw_block_lengths(spec.granularity, tuple(data.shape))
        want = tuple(1 if b is None else d // b for d, b in zip(data.shape, blocks))
        if tuple(scale.shape) != want:
            raise ValueError(f"Fp8Tensor: data of shape {tuple(data.shape)} with {spec.granularity} takes scales of "
                             f"shape {want}; got {tuple(scale.shape)}.")


def _rebuild(data_bytes: torch.Tensor, dtype_name: str, scale: torch.Tensor, meta: Fp8Meta) -> Fp8Tensor:
    dtype = getattr(torch, dtype_name, None)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"Fp8Tensor: saved payload dtype {dtype_name!r} is not an fp8 dtype.")
    return Fp8Tensor(data_bytes.view(dtype), scale, meta)


def _flatten(q: Fp8Tensor):
    return (q.data, q.scale), q.meta


def _unflatten(children, meta: Fp8Meta) -> Fp8Tensor:
    # Not validated: pytree code rebuilds nodes from transformed leaves (vmap adds a batch dim to
    # data and scale, tree_map may change dtypes); the constructor validates what users build.
    return trusted_fp8_tensor(*children, meta)


def trusted_fp8_tensor(data: torch.Tensor, scale: torch.Tensor, meta: Fp8Meta) -> Fp8Tensor:
    """An ``Fp8Tensor`` of leaves the caller knows to be valid (views of a validated cast's
    payload and scale), built without the constructor's checks: for hot paths that rebuild the
    same casts every step (FSDP2's unsharded weight). Build anything else with ``Fp8Tensor``."""
    q = object.__new__(Fp8Tensor)
    object.__setattr__(q, "data", data)
    object.__setattr__(q, "scale", scale)
    object.__setattr__(q, "meta", meta)
    return q


def _flatten_with_keys(q: Fp8Tensor):
    return [(pytree.GetAttrKey("data"), q.data), (pytree.GetAttrKey("scale"), q.scale)], q.meta


def _dumpable(meta: Fp8Meta) -> str:
    """The treespec context as JSON text (``torch.export.save`` writes treespecs so)."""
    if meta.sharding is not None:
        raise ValueError("Fp8Tensor: a treespec holding a Sharding (a DeviceMesh) cannot be serialized; "
                         "export the local tensors.")
    spec = meta.spec
    return json.dumps({"dtype": str(spec.dtype).removeprefix("torch."), "power_of_2": spec.power_of_2,
                       "granularity": _granularity_json(spec.granularity),
                       "orig_dtype": str(meta.orig_dtype).removeprefix("torch.")})


def _granularity_json(g) -> dict:
    fields = {TensorWise: (), AxisWise: ("axis",), BlockWise: ("block",), MX: ("block", "axis")}[type(g)]
    return {"type": type(g).__name__, **{f: getattr(g, f) for f in fields}}


def _from_dumpable(text: str) -> Fp8Meta:
    d = json.loads(text)
    kinds = {"TensorWise": TensorWise, "AxisWise": AxisWise, "BlockWise": BlockWise, "MX": MX}
    g = dict(d["granularity"])
    cls = kinds[g.pop("type")]
    if "block" in g and isinstance(g["block"], list):
        g["block"] = tuple(g["block"])
    spec = CastSpec(getattr(torch, d["dtype"]), cls(**g), d["power_of_2"])
    return Fp8Meta(spec, getattr(torch, d["orig_dtype"]), None)


# Registered once, here, for torch.utils._pytree (torch.func, dynamo, FSDP2, torch.export read it)
# and optree; and as safe globals, so torch.load(weights_only=True) loads Fp8Tensors.
pytree.register_pytree_node(
    Fp8Tensor,
    _flatten,
    _unflatten,
    serialized_type_name="fp8func.Fp8Tensor",
    flatten_with_keys_fn=_flatten_with_keys,
    to_dumpable_context=_dumpable,
    from_dumpable_context=_from_dumpable,
)
optree.register_pytree_node(
    Fp8Tensor,
    lambda q: ((q.data, q.scale), q.meta, ("data", "scale")),
    lambda meta, children: _unflatten(children, meta),
    namespace="fp8func",
)

torch.serialization.add_safe_globals([Fp8Tensor, Fp8Meta, CastSpec, TensorWise, AxisWise, BlockWise, MX,
                                      DelayedScaling, _rebuild])
