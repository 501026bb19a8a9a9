"""FSDP2 all-gather extension: weights travel as fp8 bytes, bitwise what bf16 all-gather + cast gives.

Two tensor types, both thin:

* ``Fp8AllGatherWeight`` is the *sharded* weight (the local tensor of FSDP2's DTensor). It is
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
order (payloads, then row-split scales): FSDP2 sizes its buffers once (``GatherHooks._slots``).

After each optimizer step ``precompute_scales`` (``fp8func.distributed._precompute``) casts every
cast of every shard (the scales that span ranks in one all-reduce for all weights) and keeps the
payloads with the weight's version, with the all-gather inputs and metadata made from them; while
the weight is unchanged the hook hands FSDP2 those (no cast, no collective), else it casts the
shard itself.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import operator
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from .._casts import cast, cast_with_scale, scale_for_cast, weight_casts
from .._collectives import gather_padded
from .._gathered import Fp8GatheredWeight
from .._log import warn_once
from .._plan import LinearPlan
from .._plan import plan as to_plan
from .._qtensor import Fp8Meta, Fp8Tensor, trusted_fp8_tensor
from .._scaling import Recipe, block_lengths
from .._sharding import Sharding
from .._structural import COPY_OPS, NEW_OPS, STRUCTURAL_OPS, AssignableData
from ..nn._weights import notify_all_gather
from ._compat import find_fsdp_param, fsdp_pass, local_tensor, reshards_after_forward, tp_spec

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "GatherMeta", "add_all_gather_input", "chunk_sizes",
           "finish_all_gather_inputs", "gather_metadata"]

aten = torch.ops.aten
log = logging.getLogger("fp8func")

def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Rows per rank when FSDP2 (``torch.chunk``) shards ``n`` rows over ``world_size`` ranks."""
    c = math.ceil(n / world_size) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(world_size)]


class _BoundHook(functools.partial):
    """A weight's FSDP2 hook bound to it: ``partial(fn, weight)``, made and called in C (no Python
    frame besides the hook's own); ``signed_hook`` gives each hook a subclass whose class attribute
    ``__signature__`` is the hook's signature without ``self``."""

    __slots__ = ()


class signed_hook(property):
    """Method decorator for an FSDP2 hook: the method, bound on attribute access as a ``_BoundHook``.

    FSDP2 reads a weight's ``fsdp_pre_all_gather`` four times before every all-gather of it (two
    ``hasattr``, ``inspect.signature`` to pick its calling convention, the call). A plain method
    gives a bound method, whose signature ``inspect`` derives anew each time (dropping ``self``:
    a few microseconds); this property binds in C (``partial(_BoundHook, fn)`` as its getter), and
    ``inspect.signature`` reads the signature made once here. Nothing is stored on the weight, so
    copies, pickles and ``swap_tensors`` bind to whichever object they read it from. ``fn``: the
    method itself."""

    def __init__(self, fn):
        params = tuple(inspect.signature(fn).parameters.values())
        bound = type("_BoundHook", (_BoundHook,), {
            "__slots__": (), "__module__": __name__, "__signature__": inspect.Signature(params[1:])})
        super().__init__(functools.partial(bound, fn))
        self.fn, self.__doc__ = fn, fn.__doc__


class GatherHooks:
    """What the FSDP2 fp8 weight types share: which casts travel, the TP sharding, and the
    unsharded ``Fp8GatheredWeight`` built after the all-gather. Needs an ``_n_slots`` attribute
    (None until the first all-gather) and an ``_fsdp_group`` list (``compat.find_fsdp_param``'s cache)."""

    def _weight_casts(self) -> list:
        """``weight_casts(self._plan)``, kept while the plan is the same object (host time: the
        optimizer step's precompute asks it of every weight, every step)."""
        kept = self.__dict__.get("_casts_kept")
        if kept is None or kept[0] is not self._plan:
            kept = self._casts_kept = (self._plan, weight_casts(self._plan))
        return kept[1]

    def _gather_plan(self, mesh, outer_size, local_shape, fix: str):
        """(n, k, casts, row sizes per rank) of this all-gather; raises unless FSDP2 shards dim 0
        in row shards that no scale block straddles. Kept while its inputs are unchanged (the hook
        runs at every all-gather; this is pure host work)."""
        key = (mesh.size(), tuple(outer_size), tuple(local_shape))
        kept = self.__dict__.get("_plan_kept")
        if kept is not None and kept[0] is self._plan and kept[1] == key:
            return kept[2]
        plan = self._make_gather_plan(mesh, outer_size, local_shape, fix)
        self._plan_kept = (self._plan, key, plan)
        return plan

    def _make_gather_plan(self, mesh, outer_size, local_shape, fix: str):
        n, k = outer_size
        if len(local_shape) != 2 or local_shape[1] != k:
            raise NotImplementedError(
                f"fp8func: FSDP2 sharded this {tuple(outer_size)} weight along dim 1 (local "
                f"{tuple(local_shape)}); the fp8 all-gather supports dim-0 sharding only. Drop the "
                f"shard_placement_fn for this parameter or {fix}."
            )
        casts = weight_casts(self._plan)
        sizes = chunk_sizes(n, mesh.size())
        _check_block_alignment(casts, n, k, sizes, mesh.size())
        return n, k, casts, sizes

    def _hook_sharding(self, mesh) -> tuple[Sharding, ...]:
        """The shard's sharding: rows over FSDP2's ``mesh``, then its TP sharding (see
        ``_tp_sharding``). Kept for this mesh and this FSDP2 parameter (a new ``fully_shard``
        makes a new one)."""
        found = find_fsdp_param(self, self._fsdp_group)
        kept = self.__dict__.get("_sharding_kept")
        if kept is not None and kept[0] is mesh and found is not None and kept[1]() is found[1]:
            return kept[2]
        sharding = (Sharding(mesh, (Shard(0),)),) + self._tp_sharding()
        if found is not None:
            self._sharding_kept = (mesh, weakref.ref(found[1]), sharding)
        return sharding

    def _tp_sharding(self) -> tuple[Sharding, ...]:
        """The TP sharding of the tensor FSDP2 shards (empty when the weight is not a DTensor).

        Never guessed: a TP-sharded weight whose sharding cannot be read raises, since casting
        its shard with the shard's own amax would give each TP rank a different scale.
        """
        found = find_fsdp_param(self, self._fsdp_group)
        if found is None:
            raise RuntimeError(
                "fp8func: FSDP2 all-gathers this fp8 weight, but its FSDP2 parameter could not be found "
                "(fp8func reads FSDP2's state to learn the weight's tensor-parallel sharding); the scale "
                f"cannot be made right. torch {torch.__version__}: please report it, and convert with "
                "fsdp_fp8_all_gather=False meanwhile (still FP8, gathered in bf16)."
            )
        spec = tp_spec(found[1])
        return () if spec is None else (Sharding(spec.mesh, tuple(spec.placements)),)

    def _slots(self, module, names):
        """The casts whose payloads travel in this all-gather (of ``names``, a list or tuple: the
        same kind comes back).

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
        return names[:1] if state == "forward" else names[1:2]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata: "GatherMeta", param_dtype, *, out=None):
        # FSDP2 hands new views of its all-gather buffers at every all-gather: the buffers are their bases.
        bases = tuple(map(_BASE, all_gather_outputs))
        target = None
        if out is not None:
            target = local_tensor(out)
            if not isinstance(target, Fp8GatheredWeight):
                raise RuntimeError(f"fp8func: FSDP2 passed out={type(target).__name__}; expected an Fp8GatheredWeight.")
            if _same_gather(bases, metadata, target.__dict__.get("_gather_key")):
                # The same buffers (FSDP2 refilled them in place) and the same scales: the casts
                # it holds, views of those buffers, already read this all-gather's bytes.
                return None
        if any(map(operator.is_, bases, itertools.repeat(None))):  # an output that is not a view: its own buffer
            bases = tuple(o if b is None else b for o, b in zip(all_gather_outputs, bases))
        views = _output_views(bases, None if target is None else target.__dict__.get("_gather_views"))
        casts = _gathered_casts(all_gather_outputs, views, metadata)
        if target is not None:
            target.set_casts(casts, metadata.slots)
        else:
            shape = (metadata.n, all_gather_outputs[0].shape[-1])
            target = Fp8GatheredWeight(casts, shape, param_dtype, metadata.slots)
        target._gather_key, target._gather_views = (bases, metadata), views
        return None if out is not None else (target, ())


_BASE = operator.attrgetter("_base")


class GatherMeta(NamedTuple):
    """A weight's all-gather metadata (``fsdp_pre_all_gather`` returns it with the inputs; FSDP2
    hands it back to ``fsdp_post_all_gather``): per cast an entry ``(name, where its payload is,
    where its scale is, its Fp8Meta)`` (``add_all_gather_input``), the casts whose payloads travel
    (``slots``) and the rows ``n``; and the entries split in two for the post-all-gather hook to
    tell a refill of the same casts from new ones without walking them: ``layout`` (``_layout``:
    compared by value) and the tensors they hold (``tensors``: compared by identity)."""

    entries: tuple
    slots: tuple
    n: int
    layout: tuple
    tensors: tuple


def gather_metadata(entries: tuple, slots, n: int, layout: tuple | None = None) -> GatherMeta:
    """The ``GatherMeta`` of ``entries`` (``finish_all_gather_inputs``'); ``layout``: their
    ``_layout`` where the caller has it."""
    tensors = []
    for _, slot, scale, _ in entries:
        if isinstance(slot, _LocalPayload):
            tensors.append(slot.data)
        if not isinstance(scale, _GatheredScale):
            tensors.append(scale)
    return GatherMeta(entries, tuple(slots), n, _layout(entries) if layout is None else layout, tuple(tensors))


def _same_gather(bases: tuple, meta: GatherMeta, kept: tuple | None) -> bool:
    """Whether an all-gather into the buffers ``bases`` with ``meta`` is the one ``kept`` (the
    ``(bases, metadata)`` a gathered weight was built from) again: the buffers by identity, then
    the very same metadata (what the hook hands back from kept payloads), or the same slots,
    rows and layout with the very same tensors (scales riding in the metadata)."""
    if kept is None:
        return False
    kept_bases, kept_meta = kept
    if len(bases) != len(kept_bases) or not all(map(operator.is_, bases, kept_bases)):
        return False
    if meta is kept_meta:
        return True
    return (meta.slots == kept_meta.slots and meta.n == kept_meta.n and meta.layout == kept_meta.layout
            and len(meta.tensors) == len(kept_meta.tensors) and all(map(operator.is_, meta.tensors, kept_meta.tensors)))


class _OutputViews(NamedTuple):
    """The tensors under FSDP2's all-gather outputs of a weight (their ``_base``) and the views
    of them its casts read (payload rows as fp8, row-split scales as float32), by ``(slot, shape
    of the output, rows, dtype)``: FSDP2 refills the same tensors at every all-gather (and hands
    the hook new views of them, of the same shapes), so the views are made once."""

    bases: tuple
    views: dict


def _output_views(bases: tuple, kept: _OutputViews | None) -> _OutputViews:
    """``kept`` while it is of these very tensors, else a new, empty one."""
    if kept is not None and len(kept.bases) == len(bases) and all(map(operator.is_, kept.bases, bases)):
        return kept
    return _OutputViews(bases, {})


class _Writes:
    """The count of in-place ops on a weight, shared by the wrappers that alias its values."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


class Fp8AllGatherWeight(AssignableData, GatherHooks, torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (see module docstring).

    To everything but FSDP2 it is the high-precision tensor it wraps: the structural ops
    (``fp8func._structural``) keep the type, every other op computes on the wrapped values.
    Checkpoints (``Fp8Linear.state_dict``, ``torch.save``) hold the plain values; ``copy.deepcopy``
    makes an independent weight of the same type.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe | LinearPlan | str, writes: _Writes | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: Recipe | LinearPlan | str, writes: _Writes | None = None):
        self._tensor = tensor
        self._plan = to_plan(recipe)
        self._param_dtype: torch.dtype | None = None  # learnt at the first all-gather
        # In-place ops on this wrapper and on its aliases (detach, .data, views): see weight_version.
        self._writes = writes if writes is not None else _Writes()
        # Each cast's scale by cast name, with the weight_version() it was made at: by the last
        # all-gather (the backward's all-gather under reshard_after_forward casts the unchanged
        # weight again and reuses it: no second amax and amax all-reduce per weight and step), or
        # by precompute_scales, which casts every cast of the shard and keeps its payload (the fp8
        # shard) with it. Used only while the version is unchanged.
        self._scales: dict[str, tuple] = {}
        self._fsdp_group: list = [None, None]  # weakrefs to FSDP2's (param group, FSDPParam): compat's cache
        self._n_slots: int | None = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers: list = []
        args = _unwrapped(cls, args, wrappers)  # flat args and lists of tensors (the optimizer's
        if kwargs:                                # multi-tensor ops) without a pytree walk
            kwargs = dict(zip(kwargs, _unwrapped(cls, tuple(kwargs.values()), wrappers)))
        if func._schema.is_mutable:  # e.g. the optimizer's update: scales made before are stale
            for writes in {id(t._writes): t._writes for t in wrappers}.values():
                writes.n += 1
        p = wrappers[0]._plan
        out = func(*args, **(kwargs or {}))
        if func not in STRUCTURAL_OPS:
            return out
        # Aliases (views, row pieces, the destination of copy_) count writes with the weight they
        # alias; copies and new tensors start their own count.
        shared = wrappers[0]._writes if func not in NEW_OPS | COPY_OPS else None
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, p, shared), out)

    @property
    def plan(self) -> LinearPlan:
        """The plan whose weight casts FSDP2 all-gathers."""
        return self._plan

    @property
    def recipe(self) -> Recipe | LinearPlan:
        """The ``Recipe`` of ``plan`` (the plan itself where it was written per GEMM)."""
        return self._plan.given

    def hp_values(self) -> torch.Tensor:
        """The wrapped high-precision tensor itself (a plain tensor sharing this weight's storage)."""
        return self._tensor.detach()

    def weight_version(self) -> tuple[int, int]:
        """Changes whenever the weight's values may have: in-place ops on this wrapper or an alias
        of it (the optimizer's step, ``copy_`` from a checkpoint, an EMA update through
        ``detach()``), or on its storage from elsewhere. Ops inside ``__torch_dispatch__`` run below
        autograd and never bump the inner tensor's ``_version`` (the optimizer's update left it at
        0), so the wrappers count their writes."""
        return self._writes.n, self._tensor._version

    def _take_data(self, new: "Fp8AllGatherWeight") -> None:
        # ``param.data = new`` (AssignableData): new values, so every kept scale is stale; writes
        # through ``new`` and its aliases count for this weight from now on (they share its values).
        self._tensor, self._plan, self._writes = new._tensor, new._plan, new._writes
        self._writes.n += 1
        self._scales.clear()
        self.__dict__.pop("_gathers_kept", None)  # made from the old values, maybe of another shape
        self.__dict__.pop("_kept_casts", None)

    def _wrap_data(self, values: torch.Tensor) -> "Fp8AllGatherWeight":
        return Fp8AllGatherWeight(values, self._plan)

    def __tensor_flatten__(self):
        return ["_tensor"], self._plan

    @staticmethod
    def __tensor_unflatten__(inner, p, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_tensor"], p)

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor!r}, recipe={self._plan.name})"

    def data_ptr(self) -> int:
        # The wrapped tensor's address. A wrapper subclass has no storage, so the default is 0 for
        # every such weight, and code that keys parameters by data_ptr() (accelerate re-points the
        # optimizer at the FSDP2-sharded parameters that way) mapped all of them to one slot.
        return self._tensor.data_ptr()

    def __deepcopy__(self, memo):
        # An independent weight of the same type (Tensor.__deepcopy__ would copy a storage this
        # wrapper does not have), with the same flags (requires_grad, nn.Parameter).
        if id(self) not in memo:
            with torch.no_grad():
                out = Fp8AllGatherWeight(self._tensor.clone(), self._plan)
            out.requires_grad_(self.requires_grad)
            if getattr(self, "_is_param", False):
                out._is_param = True
            memo[id(self)] = out
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save) as the plain high-precision tensor it is, an nn.Parameter where it is
        # one: loadable with weights_only=True, without fp8func, into any model. An Fp8Linear that
        # is unpickled wraps its weight again (Fp8Linear.__setstate__).
        values = self._tensor.detach()
        if getattr(self, "_is_param", False):
            return torch._utils._rebuild_parameter, (values, self.requires_grad, OrderedDict())
        return values.__reduce_ex__(protocol)

    @signed_hook
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        param_dtype = mp_policy.param_dtype or self._tensor.dtype
        names = self._cast_names()
        slots = names if len(names) == 1 else self._slots(module, names)
        out = self._kept_gather(mesh, param_dtype, outer_size, slots, names)
        if out is None:
            out = self._gather_inputs(mesh, outer_size, param_dtype, slots)
        notify_all_gather(self, module, out[0], mp_policy)
        return out

    def _cast_names(self) -> tuple[str, ...]:
        """The names of ``_weight_casts()``, kept while the plan is the same object."""
        kept = self.__dict__.get("_names_kept")
        if kept is None or kept[0] is not self._plan:
            kept = self._names_kept = (self._plan, tuple(name for name, _ in self._weight_casts()))
        return kept[1]

    def _gather_inputs(self, mesh, outer_size, param_dtype, slots) -> tuple:
        """FSDP2's all-gather inputs and metadata of the casts ``slots`` (see the module docstring),
        from the payloads ``precompute_scales`` keeps where they are current, else cast here.
        Remembered for the next all-gather of the same slots when made from kept payloads only."""
        n, k, casts, sizes = self._gather_plan(mesh, outer_size, tuple(self._tensor.shape),
                                               "convert with fsdp_fp8_all_gather=False")
        from ._precompute import register_after_step  # here: _precompute imports this module

        register_after_step()
        # Exactly the cast FSDP2's default path applies before its all-gather.
        if self._param_dtype != param_dtype:
            self._scales.clear()  # kept scales and payloads were made from another param dtype
        self._param_dtype = param_dtype
        # FSDP2 splits the rows over its mesh; under 2D (FSDP x TP) the tensor it shards is itself
        # a TP shard, whose amax must be reduced over the TP mesh as well.
        sharding = self._hook_sharding(mesh)
        inputs, entries, shard = [], [], []  # shard: the tensor in the param dtype, made when first needed
        for name, spec in casts:
            q = self._cast_shard(name, shard, param_dtype, spec, sharding, data=name in slots)
            add_all_gather_input(inputs, entries, name, q, slots, sizes, mesh, param_dtype)
        entries = finish_all_gather_inputs(inputs, entries)  # appends to inputs
        out = tuple(inputs), gather_metadata(entries, slots, n)
        gathers = self.__dict__.setdefault("_gathers_kept", {})
        if len(set(sizes)) == 1:  # even row shards: no padding, no collective of the hook's own
            now = self._current_payloads()
            gathers[slots] = _KeptGather(mesh, param_dtype, tuple(outer_size), tuple(self._tensor.shape),
                                         out[1].layout, len(inputs), n, now, None if now is None else out)
        else:
            gathers.pop(slots, None)
        return out

    def _current_payloads(self) -> tuple | None:
        """``(name, entry)`` of every cast whose ``_scales`` entry holds a payload
        (``precompute_scales``') made at the current weight version; None unless all do."""
        version, scales, out = self.weight_version(), self._scales, []
        for name in self._cast_names():
            e = scales.get(name)
            if e is None or len(e) != 3 or e[0] != version:
                return None
            out.append((name, e))
        return tuple(out)

    def _kept_gather(self, mesh, param_dtype, outer_size, slots, names=None) -> tuple | None:
        """The all-gather inputs and metadata of ``slots`` made from the payloads ``precompute_scales``
        keeps, where every cast has a current one and an earlier all-gather of these slots, in
        the same place, found even row shards; else None (the hook casts what it must). Built
        by ``precompute_scales`` once per weight version (``_kept_gathers``), so the hook only
        checks that they are current: no cast, no collective, no new tensor (FSDP2 copies the
        inputs into its own buffer). ``names``: ``_cast_names()``, where the caller has them."""
        gathers = self.__dict__.get("_gathers_kept")
        kept = None if gathers is None else gathers.get(slots)
        if (kept is None or kept.mesh is not mesh or kept.param_dtype != param_dtype
                or kept.outer_size != outer_size or kept.local_shape != self._tensor.shape):
            return None
        entries, names = kept.entries, self._cast_names() if names is None else names
        # Current while each cast's _scales entry is still the very one it was made from (all at
        # one version, the current one): tested without a Python frame per cast.
        if (entries is not None and len(entries) == len(names) and entries[0][1][0] == self.weight_version()
                and all(map(operator.is_, map(self._scales.get, names), map(_ENTRY, entries)))):
            return kept.out
        now = self._current_payloads()
        if now is None:
            return None
        kept = gathers[slots] = kept.made_from(now, slots)
        return kept.out

    def _kept_gathers(self) -> None:
        """Builds the all-gather inputs and metadata of every layout this weight was gathered in
        from the payloads kept now (called where they are made, after the optimizer step)."""
        gathers, now = self.__dict__.get("_gathers_kept"), self._current_payloads()
        if gathers and now is not None:
            self._gathers_kept = {slots: g.made_from(now, slots) for slots, g in gathers.items()}

    def _payloads_kept(self) -> bool:
        """Whether ``precompute_scales`` kept a current payload of every cast."""
        return self._current_payloads() is not None

    def _drop_stale(self) -> None:
        """Forgets the scales and payloads made at another weight version (before new ones are
        made: a step's payloads never live beside the next step's), and the all-gather inputs
        made from them (their layout stays)."""
        version = self.weight_version()
        self._scales = {name: e for name, e in self._scales.items() if e[0] == version}
        gathers = self.__dict__.get("_gathers_kept")
        if gathers:
            self._gathers_kept = {s: g.made_from(None, s) for s, g in gathers.items()}

    def _keep_entry(self, name: str, entry: list) -> None:
        """Makes ``entry`` (``[version, scale, payload]``, current: ``precompute_scales``' buffers
        kept across steps) this weight's only ``_scales`` entry, and the all-gather inputs and
        metadata of every layout it was gathered in made from it; both stay as they are while they
        already are (the entry is updated in place from one step to the next)."""
        if len(self._scales) != 1 or self._scales.get(name) is not entry:
            self._scales = {name: entry}
        gathers = self.__dict__.get("_gathers_kept")
        if gathers:
            for slots, g in gathers.items():
                if g.entries is None or len(g.entries) != 1 or g.entries[0][1] is not entry:
                    gathers[slots] = g.made_from(((name, entry),), slots)

    def _keep_cast(self, name: str, scale: torch.Tensor, data: torch.Tensor) -> None:
        """Keeps cast ``name``'s scale and payload for the current weight version."""
        self._scales[name] = (self.weight_version(), scale, data)

    def _keep_casts(self) -> None:
        """Casts every cast of the shard that has no current payload yet, exactly as the hook
        would (``_cast_shard``: a kept scale, e.g. a reduced one, is used; a cast whose groups lie
        within the shard makes its own), and keeps each payload for the all-gathers."""
        sharding, made = self.__dict__["_sharding_kept"][2], []
        version = self.weight_version()
        for name, spec in self._weight_casts():
            kept = self._scales.get(name)
            if kept is not None and len(kept) == 3 and kept[0] == version:
                continue
            q = self._cast_shard(name, made, self._param_dtype, spec, sharding, data=True)
            self._keep_cast(name, q.scale, q.data)
        self._kept_gathers()

    def _cast_shard(self, name, made: list, param_dtype, spec, sharding, *, data: bool) -> "Fp8Tensor | _ScaleOnly":
        """Cast ``name`` of this shard in ``param_dtype`` (``data``: its payload travels now; else
        only its scale is needed), with the kept scale while the weight is unchanged since it was
        made: then the cast kernel reads the fp32 master and rounds it as ``.to(param_dtype)``
        would, bitwise, without writing that copy. ``made``: the shard in ``param_dtype``, once made."""
        version = self.weight_version()
        kept = self._scales.get(name)
        if kept is not None and kept[0] == version:
            if data and len(kept) == 3:  # precompute_scales' payload: no launch here
                meta = Fp8Meta(spec, param_dtype, sharding[0] if len(sharding) == 1 else None)
                return Fp8Tensor(kept[2], kept[1], meta)
            if data:
                return cast_with_scale(self._tensor, kept[1], spec, sharding, round_to=param_dtype)
            return _ScaleOnly(self._tensor, kept[1], spec)
        if not made:
            made.append(self._tensor.to(param_dtype))
        shard = made[0]
        if data:  # the fused kernels on CUDA (this hook runs eagerly, outside compiled regions)
            q = cast(shard, spec, sharding=sharding)[0]
        else:  # the payload travels in the other pass
            q = _ScaleOnly(shard, scale_for_cast(shard, spec, sharding), spec)
        self._scales[name] = (version, q.scale)
        return q


def _unwrapped(cls, args, found: list):
    """``args`` (a tuple or list) with every ``cls`` instance replaced by its wrapped tensor, in
    nested lists and tuples too (aten ops take tensors, lists of them, and c10d ops lists of
    lists); the instances are appended to ``found``. No pytree walk: the optimizer's multi-tensor
    ops pass hundreds of tensors here every step."""
    out = []
    for a in args:
        if isinstance(a, cls):
            found.append(a)
            a = a._tensor
        elif type(a) in (list, tuple):
            a = _unwrapped(cls, a, found)
        out.append(a)
    return type(args)(out) if type(args) in (list, tuple) else tuple(out)


class _KeptGather(NamedTuple):
    """A weight's all-gather of some slots on even row shards: where it ran (FSDP2's mesh, the
    param dtype, the unsharded and the local size), its layout (``_layout``: the metadata's
    entries without their tensors; how many inputs; rows), and, once made from the payloads
    ``precompute_scales`` keeps, the ``_scales`` entries it read (``(name, (version, scale,
    payload))`` per cast) and the inputs and metadata made from them; None for both until then,
    and again once the weight changes."""

    mesh: object
    param_dtype: torch.dtype
    outer_size: tuple
    local_shape: tuple
    layout: tuple
    n_inputs: int
    n: int
    entries: tuple | None
    out: tuple | None

    def made_from(self, now: tuple | None, slots: tuple) -> "_KeptGather":
        """This layout with the inputs and metadata made from the kept casts ``now`` (None: none)."""
        return _KeptGather(*self[:-2], now, None if now is None else _kept_inputs(self, now, slots))


_ENTRY = operator.itemgetter(1)  # a _KeptGather entry's _scales entry
_LOCAL = "local"  # _layout's mark of a payload kept out of the all-gather (_LocalPayload)


def _layout(entries: tuple) -> tuple:
    """The metadata entries of an all-gather (``finish_all_gather_inputs``') without their tensors:
    per cast its name, where its payload is (an input's index; ``_LOCAL``), where its scale is
    (a ``_GatheredScale``; None: in the metadata) and its ``Fp8Meta``."""
    return tuple((name, _LOCAL if isinstance(slot, _LocalPayload) else slot,
                  scale if isinstance(scale, _GatheredScale) else None, meta)
                 for name, slot, scale, meta in entries)


def _kept_inputs(kept: _KeptGather, now: tuple, slots: tuple) -> tuple:
    """The all-gather inputs and metadata of layout ``kept`` for the kept casts ``now`` (``(name,
    (version, scale, payload))`` each): the same tensors, in the same places, as
    ``add_all_gather_input`` and ``finish_all_gather_inputs`` put them for those casts."""
    inputs: list = [None] * kept.n_inputs
    entries, tensors = [], []  # tensors: as gather_metadata finds them
    for (name, slot, scale, meta), (_, (_, s, data)) in zip(kept.layout, now):
        if slot is _LOCAL:
            slot = _LocalPayload(data.view(torch.uint8))
            tensors.append(slot.data)
        elif name in slots:
            inputs[slot] = data.view(torch.uint8)
        if scale is None:
            scale = s
            tensors.append(s)
        else:
            inputs[scale.slot] = s.contiguous().view(torch.uint8)
        entries.append((name, slot, scale, meta))
    return tuple(inputs), GatherMeta(tuple(entries), slots, kept.n, kept.layout, tuple(tensors))


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
        scale = gather_padded(scale, 0, [s // b for s in sizes], mesh, 0)
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


def _gathered_casts(outputs, views: _OutputViews, meta: GatherMeta) -> dict[str, Fp8Tensor]:
    """The unsharded casts of an all-gather: each payload its all-gather output's first ``n`` rows
    as its fp8 dtype (or the one kept local), each scale the metadata's or the row-split one
    gathered with the payload (its output as float32). The views are made once (``views``)."""
    made, n, casts = views.views, meta.n, {}
    for name, slot, scale, fp8_meta in meta.entries:
        dtype = fp8_meta.spec.dtype
        if isinstance(slot, _LocalPayload):
            data = slot.data[:n].view(dtype)
        else:
            key = (slot, outputs[slot].shape, n, dtype)
            data = made.get(key)
            if data is None:
                data = made[key] = outputs[slot][:n].view(dtype)
        if isinstance(scale, _GatheredScale):
            key = (scale.slot, outputs[scale.slot].shape, None, torch.float32)
            gathered = made.get(key)
            if gathered is None:
                gathered = made[key] = outputs[scale.slot].view(torch.float32)
            scale = gathered
        # Not validated again (trusted_fp8_tensor): the hook made these metadata from valid casts.
        casts[name] = trusted_fp8_tensor(data, scale, fp8_meta)
    return casts


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


def _fsdp_pass(weight, module) -> tuple[str, bool]:
    """("forward" | "backward" | "unknown", reshard_after_forward) of the FSDP2 group holding ``weight``."""
    found = find_fsdp_param(weight, weight._fsdp_group)
    if found is None:
        warn_once("no fsdp group", "fp8func: %s",
                  "could not find this weight's FSDP2 parameter group; gathering both row-wise casts")
        return "unknown", False
    return fsdp_pass(found[0]), reshards_after_forward(found[0])
