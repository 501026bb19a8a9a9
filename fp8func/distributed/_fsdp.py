"""FSDP2 all-gather extension: weights travel as fp8 bytes, bitwise what bf16 all-gather + cast gives.

Two tensor types, both thin:

* ``Fp8AllGatherWeight`` is the *sharded* weight (``DTensor._local_tensor`` under FSDP2). It is
  an ordinary high-precision tensor to everyone (optimizer, init, state_dict) and implements
  ``fsdp_pre_all_gather``: cast the shard to the param dtype exactly as FSDP2's default path
  does, quantize it with the amax reduced over the FSDP mesh (``quantize(..., sharding=)``),
  and hand FSDP2 the uint8 payload(s). Scales that are split by the sharding (one per row, per
  block) travel in the same all-gather, as uint8 inputs after the payloads (evenly sharded
  weights; uneven ones gather them separately); a scale that spans the rows is already the
  mesh-wide one and rides in the metadata.
* ``Fp8GatheredWeight`` is the *unsharded* weight FSDP2 builds in ``fsdp_post_all_gather``: it
  holds the gathered casts (``Fp8Tensor``s, views of FSDP's all-gather buffers) and is consumed
  by ``Fp8Linear`` alone; any other use raises.

Which casts travel: the forward's ``w`` cast, and the grad_input GEMM's ``w_t`` cast when the
recipe needs a different one (row-wise: column scales). With ``reshard_after_forward`` the
forward's gather moves ``w`` and the backward's ``w_t`` (one payload each, half of bf16's
bytes); without it the one gather moves both (as many bytes as bf16). Tensorwise and 128x128
block weights move one payload. Every gather of a weight has the same inputs, in the same
order (payloads, then row-split scales): FSDP2 sizes its buffers once (``_GatherHooks._slots``).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Shard

from .._casts import _cast, _cast_with_scale, _scale, weight_casts
from .._collectives import _gather_padded
from .._gathered import Fp8GatheredWeight
from .._qtensor import Fp8Meta, Fp8Tensor
from .._scaling import Recipe, TensorWise, block_lengths, compute_scale
from .._sharding import Sharding, reduce_amax

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "add_all_gather_input", "chunk_sizes",
           "finish_all_gather_inputs", "precompute_scales"]

aten = torch.ops.aten
log = logging.getLogger("fp8func")

# Ops FSDP2 / init / state_dict loading apply to the sharded weight whose result must stay an
# Fp8AllGatherWeight (sharding, padding, copying, moving). Everything else returns plain tensors.
_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor,
    aten.copy_.default, aten.view.default, aten.as_strided.default, aten._to_copy.default,
    aten._pin_memory.default, aten.split.Tensor, aten.split_with_sizes.default, aten.clone.default,
    aten.detach.default, aten.alias.default,
}


def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Rows per rank when FSDP2 (``torch.chunk``) shards ``n`` rows over ``world_size`` ranks."""
    c = math.ceil(n / world_size) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(world_size)]


class _GatherHooks:
    """What the FSDP2 fp8 weight types share: which casts travel, the TP sharding, and the
    unsharded ``Fp8GatheredWeight`` built after the all-gather. Needs ``_n_slots`` and
    ``_fsdp_group`` attributes (None until the first all-gather)."""

    def _gather_plan(self, mesh, outer_size, local_shape, fix: str):
        """(n, k, casts, row sizes per rank) of this all-gather; raises unless FSDP2 shards dim 0
        in row shards that no scale block straddles."""
        n, k = outer_size
        if len(local_shape) != 2 or local_shape[1] != k:
            raise NotImplementedError(
                f"fp8func: FSDP2 sharded this {tuple(outer_size)} weight along dim 1 (local "
                f"{tuple(local_shape)}); the fp8 all-gather supports dim-0 sharding only. Drop the "
                f"shard_placement_fn for this parameter or {fix}."
            )
        casts = weight_casts(self._recipe)
        sizes = chunk_sizes(n, mesh.size())
        _check_block_alignment(casts, n, k, sizes, mesh.size())
        return n, k, casts, sizes

    def _tp_sharding(self) -> tuple[Sharding, ...]:
        """The TP sharding of the tensor FSDP2 shards (empty when the weight is not a DTensor).

        Never guessed: a TP-sharded weight whose sharding cannot be read raises, since casting
        its shard with the shard's own amax would give each TP rank a different scale.
        """
        found = _find_param(self)
        if found is None:
            raise RuntimeError(
                "fp8func: FSDP2 all-gathers this fp8 weight, but its FSDP2 parameter could not be found "
                "(fp8func reads FSDP2's state to learn the weight's tensor-parallel sharding); the scale "
                f"cannot be made right. torch {torch.__version__}: please report it, and convert with "
                "fsdp_fp8_all_gather=False meanwhile (still FP8, gathered in bf16)."
            )
        spec = tp_spec(found[1])
        return () if spec is None else (Sharding(spec.mesh, tuple(spec.placements)),)

    def _slots(self, module, names: list[str]) -> list[str]:
        """The casts whose payloads travel in this all-gather.

        One cast: that one. Two (row-wise weights): when FSDP2 reshards after forward, the forward
        gathers the forward's cast and the backward the grad_input's, into the same buffer (each
        pass gathers half of bf16's bytes); otherwise both travel in the forward. The count must
        not change between passes (FSDP2 sizes its buffers once).
        """
        if len(names) == 1:
            return names
        state, reshard = _fsdp_pass(self, module)
        want = 1 if (state in ("forward", "backward") and reshard) else 2
        if self._n_slots is None:
            self._n_slots = want
        elif self._n_slots != want:
            raise RuntimeError(
                f"fp8func: this row-wise weight was first all-gathered with {self._n_slots} cast(s) "
                f"per all-gather and now needs {want} (FSDP2 state {state!r}, reshard_after_forward="
                f"{reshard}): FSDP2 sizes its buffers once, so reshard_after_forward cannot change after "
                "the first step, and an explicit unshard() outside forward/backward is not supported "
                "for row-wise fp8 all-gather. Keep the setting fixed or convert with fsdp_fp8_all_gather=False."
            )
        if want == 2:
            return names
        return [names[0]] if state == "forward" else [names[1]]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        entries, slots, n = metadata
        casts = {
            name: Fp8Tensor(_gathered_payload(all_gather_outputs, slot)[:n].view(meta.spec.dtype),
                            _gathered_scale(all_gather_outputs, scale), meta)
            for name, slot, scale, meta in entries
        }
        if out is not None:
            target = out._local_tensor if isinstance(out, DTensor) else out
            if not isinstance(target, Fp8GatheredWeight):
                raise RuntimeError(f"fp8func: FSDP2 passed out={type(target).__name__}; expected an Fp8GatheredWeight.")
            target.set_casts(casts, slots)
            return None
        shape = (n, all_gather_outputs[0].shape[-1])
        return Fp8GatheredWeight(casts, shape, param_dtype, slots), ()


class Fp8AllGatherWeight(_GatherHooks, torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (see module docstring)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: Recipe):
        self._tensor = tensor
        self._recipe = recipe
        self._param_dtype: torch.dtype | None = None  # learnt at the first all-gather
        self._writes = 0  # in-place ops on this wrapper (see weight_version)
        # Each cast's scale by cast name, with the weight_version() it was made at: by the last
        # all-gather (the backward's all-gather under reshard_after_forward casts the unchanged
        # weight again and reuses it: no second amax and amax all-reduce per weight and step), or
        # by precompute_scales. Used only while the version is unchanged.
        self._scales: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        self._fsdp_group = None  # weakrefs to FSDP2's (param group, FSDPParam), found at the first all-gather
        self._n_slots: int | None = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        if func._schema.is_mutable:  # e.g. the optimizer's update: scales made before are stale
            for t in wrappers:
                t._writes += 1
        recipe = wrappers[0]._recipe
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, recipe), out)

    def weight_version(self) -> tuple[int, int]:
        """Changes whenever the weight's values may have: in-place ops on this wrapper (the
        optimizer's step, ``copy_`` from a checkpoint), or on its storage from elsewhere. Ops inside
        ``__torch_dispatch__`` run below autograd and never bump the inner tensor's ``_version``
        (the optimizer's update left it at 0), so the wrapper counts its own writes."""
        return self._writes, self._tensor._version

    def __tensor_flatten__(self):
        return ["_tensor"], self._recipe

    @staticmethod
    def __tensor_unflatten__(inner, recipe, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_tensor"], recipe)

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor!r}, recipe={self._recipe.name})"

    def data_ptr(self) -> int:
        # The wrapped tensor's address. A wrapper subclass has no storage, so the default is 0 for
        # every such weight, and code that keys parameters by data_ptr() (accelerate re-points the
        # optimizer at the FSDP2-sharded parameters that way) mapped all of them to one slot.
        return self._tensor.data_ptr()

    def __reduce_ex__(self, protocol):
        # Saved (torch.save, DCP) as the plain high-precision tensor it is: checkpoints load with
        # weights_only=True, without fp8func, into any model; loading into an Fp8Linear copies
        # the values into this wrapper (copy_ is preserved).
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        n, k, casts, sizes = self._gather_plan(mesh, outer_size, tuple(self._tensor.shape),
                                               "convert with fsdp_fp8_all_gather=False")
        # Exactly the cast FSDP2's default path applies before its all-gather.
        param_dtype = mp_policy.param_dtype or self._tensor.dtype
        self._param_dtype = param_dtype
        shard = self._tensor.to(param_dtype)
        # FSDP2 splits the rows over its mesh; under 2D (FSDP x TP) the tensor it shards is itself
        # a TP shard, whose amax must be reduced over the TP mesh as well.
        sharding = (Sharding(mesh, (Shard(0),)),) + self._tp_sharding()
        slots = self._slots(module, [name for name, _ in casts])
        inputs, entries = [], []
        for name, spec in casts:
            q = self._cast_shard(name, shard, spec, sharding, data=name in slots)
            add_all_gather_input(inputs, entries, name, q, slots, sizes, mesh, param_dtype)
        entries = finish_all_gather_inputs(inputs, entries)  # appends to inputs
        return tuple(inputs), (entries, tuple(slots), n)

    def _cast_shard(self, name, shard, spec, sharding, *, data: bool) -> "Fp8Tensor | _ScaleOnly":
        """Cast ``name`` of this shard (``data``: its payload travels now; else only its scale is
        needed), with the kept scale while the weight is unchanged since it was made."""
        version = self.weight_version()
        kept = self._scales.get(name)
        if kept is not None and kept[0] == version:
            if data:
                return _cast_with_scale(shard, kept[1], spec, sharding)
            return _ScaleOnly(shard, kept[1], spec)
        if data:  # the fused kernels on CUDA (this hook runs eagerly, outside compiled regions)
            q = _cast(shard, spec, sharding=sharding)[0]
        else:  # the payload travels in the other pass
            q = _ScaleOnly(shard, _scale(shard, spec, sharding), spec)
        self._scales[name] = (version, q.scale)
        return q


class _ScaleOnly(NamedTuple):
    """A cast whose payload travels in the other pass: the shard (its shape) and its scale."""

    data: torch.Tensor
    scale: torch.Tensor
    spec: object


class _ScaleInput(NamedTuple):
    """A row-split scale of an evenly sharded weight on its way into the all-gather (uint8 bytes)."""

    data: torch.Tensor


class _LocalPayload(NamedTuple):
    """A payload kept out of the all-gather: on a one-rank FSDP2 mesh, every one after the first."""

    data: torch.Tensor


class _GatheredScale(NamedTuple):
    """Where a row-split scale is in FSDP2's all-gather outputs."""

    slot: int


def add_all_gather_input(inputs: list, entries: list, name: str, q: Fp8Tensor, slots, sizes: list[int],
                         mesh, param_dtype: torch.dtype) -> None:
    """Appends one weight cast to FSDP2's all-gather inputs and its entry to the metadata.

    ``q`` is the cast of the local shard (its data is read only when ``name`` travels in this
    all-gather, i.e. is in ``slots``). The payload goes as uint8 padded to the padded shard
    size. Row / block scales are split like the rows: they travel in the same all-gather, as
    uint8 inputs that ``finish_all_gather_inputs`` appends after every payload (evenly sharded
    weights; uneven shards gather them here, in an all-gather of their own, because FSDP2 then
    takes only inputs of the padded shard's shape); a scale that spans the rows is already the
    mesh-wide one and rides in the metadata.
    """
    scale = q.scale
    b = block_lengths(q.spec.granularity, tuple(q.data.shape))[0]
    if mesh.size() == 1:
        # One rank: FSDP2 skips the collective and copies only the first input into its output
        # (torch 2.11-2.13, FSDPParamGroup.wait_for_unshard), so the shard is the whole weight:
        # its scale rides in the metadata, and any payload after the first one too.
        if name in slots and inputs:
            entries.append((name, _LocalPayload(q.data.view(torch.uint8)), scale, Fp8Meta(q.spec, param_dtype, None)))
            return
    elif b is not None and len(set(sizes)) == 1:  # row / block scales split like the rows: gather them too
        scale = _ScaleInput(scale.contiguous().view(torch.uint8))
    elif b is not None:
        # Uneven row shards: FSDP2 takes only inputs of the padded shard's shape then, so the
        # scales go in an all-gather of their own, here.
        scale = _gather_padded(scale, 0, [s // b for s in sizes], mesh, 0)
    if name in slots:
        data = q.data.view(torch.uint8)
        if data.shape[0] < max(sizes):  # FSDP2 wants every input at the padded shard size
            data = torch.cat([data, data.new_zeros(max(sizes) - data.shape[0], data.shape[1])])
        inputs.append(data)
    entries.append((name, len(inputs) - 1 if name in slots else 0, scale, Fp8Meta(q.spec, param_dtype, None)))


def finish_all_gather_inputs(inputs: list, entries: list) -> tuple:
    """Appends the row-split scales of ``entries`` to ``inputs``, after every payload; returns the
    entries with each such scale replaced by its place in the all-gather outputs.

    After the payloads, so every input keeps its position and size from one all-gather of the
    weight to the next (FSDP2 sizes its buffers once), whichever payloads a pass moves. One
    collective for the weight: the scales used to travel in an all-gather of their own, issued
    and waited for inside the pre-all-gather hook.
    """
    out = []
    for name, slot, scale, meta in entries:
        if isinstance(scale, _ScaleInput):
            inputs.append(scale.data)
            scale = _GatheredScale(len(inputs) - 1)
        out.append((name, slot, scale, meta))
    return tuple(out)


def _gathered_payload(outputs, slot):
    """The unsharded uint8 payload of an entry: its all-gather output, or the one kept local."""
    return slot.data if isinstance(slot, _LocalPayload) else outputs[slot]


def _gathered_scale(outputs, scale):
    """The unsharded scale of an entry: the metadata's, or the row-split one gathered with the payload."""
    if not isinstance(scale, _GatheredScale):
        return scale
    return outputs[scale.slot].view(torch.float32)


def _check_block_alignment(casts, n: int, k: int, sizes: list[int], world: int) -> None:
    for _, spec in casts:
        b = block_lengths(spec.granularity, (n, k))[0]
        if b is not None and any(s % b for s in sizes):
            raise ValueError(
                f"fp8func: FSDP2 splits this {n}x{k} weight into row shards of {sizes} over "
                f"{world} ranks, but its {spec.granularity!r} cast needs shards in multiples of "
                f"{b} rows (a block must not straddle ranks). Use sizes where {n}/{world} is a "
                f"multiple of {b}, or convert this layer with fsdp_fp8_all_gather=False (still FP8, "
                "gathered in bf16), e.g. convert(model, recipe, filter=...) for the rest."
            )


def _fsdp_pass(weight: "Fp8AllGatherWeight", module) -> tuple[str, bool]:
    """("forward" | "backward" | "unknown", reshard_after_forward) of the FSDP2 group holding ``weight``.

    Reads FSDP2's own state (private attributes, looked up once per weight): the group's
    training state during its unshard, and whether it reshards after forward.
    """
    found = _find_param(weight)
    if found is None:
        _warn_once("could not find this weight's FSDP2 parameter group; gathering both row-wise casts")
        return "unknown", False
    group = found[0]
    state = getattr(group, "_training_state", None)
    name = getattr(state, "name", "")
    pass_ = {"FORWARD": "forward", "PRE_BACKWARD": "backward"}.get(name, "unknown")
    return pass_, getattr(group, "post_forward_mesh_info", None) is not None


# FSDPParam's DTensor spec of the parameter it was given (TP / EP placements): ``_tp_spec`` up to
# torch 2.11, ``_unsharded_dtensor_spec`` since 2.12.
_TP_SPEC_ATTRS = ("_unsharded_dtensor_spec", "_tp_spec")


def tp_spec(fsdp_param):
    """The DTensor spec of the parameter FSDP2 sharded (its TP sharding), or None for a plain tensor.

    Raises when FSDP2 was given a DTensor but the spec is under neither known name: reading it as
    "no TP" would cast every TP shard with its own amax (a torch 2.11 run did exactly that while
    only the newer name was read: on != off on 2 GPUs, different scales per TP rank)."""
    for attr in _TP_SPEC_ATTRS:
        spec = getattr(fsdp_param, attr, None)
        if spec is not None:
            return spec
    if getattr(fsdp_param, "is_dtensor", False):
        raise RuntimeError(
            f"fp8func: FSDP2 shards a DTensor parameter here, but this torch ({torch.__version__}) keeps its "
            f"spec under none of {_TP_SPEC_ATTRS}, so the weight's TP sharding is unknown. Please report it; "
            "convert with fsdp_fp8_all_gather=False meanwhile (still FP8, gathered in bf16)."
        )
    return None


def _find_param(weight):
    """(FSDP2 param group, FSDPParam) that hold ``weight``, looked up once and cached weakly."""
    if weight._fsdp_group is not None:
        group, fsdp_param = weight._fsdp_group[0](), weight._fsdp_group[1]()
        if group is not None and fsdp_param is not None:
            return group, fsdp_param
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return None
    for ref in list(_module_state_mapping.values()):
        state = ref()
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if fsdp_param._sharded_local_tensor is weight:
                weight._fsdp_group = (weakref.ref(group), weakref.ref(fsdp_param))
                return group, fsdp_param
    return None


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("fp8func: %s", msg)


@torch.no_grad()
def precompute_scales(model: torch.nn.Module) -> int:
    """Computes every tensorwise FSDP2 fp8 weight scale with one all-reduce (call after ``optimizer.step()``).

    Same numbers as the per-weight reduction in ``fsdp_pre_all_gather`` (MAX is exact), in one
    collective instead of one per weight. A precomputed scale is used only while the weight is
    unchanged since (its version counter says so); a stale one is never used. Returns the number
    of weights it covered.
    """
    groups: dict = {}
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if not (isinstance(local, Fp8AllGatherWeight) and isinstance(p, DTensor)):
            continue
        spec = local._recipe.weight
        if not isinstance(spec.granularity, TensorWise) or len(weight_casts(local._recipe)) != 1:
            continue
        if local._param_dtype is None:  # never all-gathered yet: the param dtype is not known
            continue
        groups.setdefault(p.device_mesh, []).append(local)
    covered = 0
    for mesh, weights in groups.items():
        # The amax of exactly what fsdp_pre_all_gather casts: the shard in the param dtype.
        amax = torch.stack([w._tensor.to(w._param_dtype).abs().amax().float() if w._tensor.numel()
                            else w._tensor.new_zeros((), dtype=torch.float32) for w in weights])
        amax = reduce_amax(amax, mesh, tuple(range(mesh.ndim)))
        for w, a in zip(weights, amax):
            scale = compute_scale(a.reshape(1, 1), w._recipe.weight.dtype, w._recipe.weight.pow2_scales)
            w._scales[weight_casts(w._recipe)[0][0]] = (w.weight_version(), scale)
        covered += len(weights)
    return covered
