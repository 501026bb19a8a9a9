"""FP8 primary weights: a parameter stored as fp8 payload(s) + scales, sharded and gathered by FSDP2.

``Fp8WeightParam`` is a weight ``[N, K]`` (the local rows under FSDP2) that holds, for each cast
of ``weight_casts(recipe)``, an fp8 payload ``[n, K]`` and its scale, and no high-precision copy.
It advertises the dtype the model was built in, so FSDP2, ``to_empty``, ``state_dict`` and
optimizers see an ordinary weight of that dtype:

* **Structural ops keep the type** (the ones FSDP2 and module moves apply: ``split``,
  ``new_zeros``, ``slice`` along the rows, ``copy_`` from another ``Fp8WeightParam``,
  ``empty_like``, ``_to_copy``, ``clone``, ``detach``). Payloads and row-split scales (one per
  row, per 128-row block) are split with the rows; scales that span the rows (tensorwise, the
  row-wise recipe's column scales) are carried unchanged.
* **Writes are staged.** An in-place op that is not such a copy (``normal_`` and the other
  init functions, ``copy_`` from a plain tensor as ``load_state_dict`` does, an optimizer's
  update) runs on the high-precision values and keeps the result as a high-precision tensor
  inside the parameter; the payloads are dropped. Nothing is quantized there with a local
  amax (each rank would get its own scale): the next ``fsdp_pre_all_gather``, which runs on
  every rank together, quantizes the staged values exactly as ``Fp8AllGatherWeight`` does (cast
  to the param dtype, amax reduced over the FSDP mesh) and drops them. So initialising on the
  ``meta`` device (``fully_shard``, ``to_empty``, init) gives exactly the weights a
  high-precision model initialised the same way has, quantized once.
* **Every other op reads the high-precision values** (the staged tensor, or the forward cast
  dequantized to the advertised dtype) and returns plain tensors.
* Under FSDP2 the stored payloads travel as uint8 and come out as the ``Fp8GatheredWeight``
  the fp8 all-gather path builds, so ``Fp8Linear`` is unchanged. Outside FSDP2, ``casts()``
  hands ``Fp8Linear`` the stored casts directly.

Memory: tensorwise and 128x128-block weights keep one payload, 1 byte per element plus the
scales; row-wise weights keep two (row scales for the forward, column scales for the backward's
grad_input GEMM), 2 bytes per element: the same as bf16.

Aliases (``detach``, ``nn.Parameter(...)``, ``.data``) share one state, so a write through any
of them is seen by all. A row slice is a new tensor once written (its payload views are shared
only for FSDP2's structural copies).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from .._casts import weight_casts
from .._ops import dequantize, quantize
from .._plan import LinearPlan
from .._plan import plan as to_plan
from .._qtensor import Fp8Tensor
from .._scaling import Recipe
from .._sharding import Sharding
from .._structural import AssignableData
from ..nn._weights import check_fp8_weights_recipe, notify_all_gather
from ._fp8_weights_ops import HANDLERS, SHELL_MSG, State, fallback
from ._fsdp import GatherHooks, add_all_gather_input, finish_all_gather_inputs, gather_metadata, signed_hook

__all__ = ["Fp8WeightParam", "check_fp8_weights_recipe"]

# Tensor attributes a deep copy leaves behind: the state is cloned; FSDP2's lookup cache and the
# all-gather hook's kept plan and sharding are the original's.
_NOT_COPIED = ("_state", "_fsdp_group", "_plan_kept", "_sharding_kept")


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class Fp8WeightParam(AssignableData, GatherHooks, torch.Tensor):
    """A weight stored in FP8 (payloads + scales, no high-precision copy) that FSDP2 shards and
    all-gathers in 8 bits; writes are staged and quantized at the next all-gather. More in the
    module docstring and docs/fp8_weights.md.

    Build it with ``convert(model, recipe, fp8_weights=True)``; train it with
    ``fp8func.nn.MasterWeights`` (the optimizer updates a high-precision master copy and the
    weight is re-quantized after each step).

    Example:
        >>> w = Fp8WeightParam(torch.randn(256, 128), fp8func.Recipe.from_name("tensorwise"))
        >>> w.is_staged, w.casts()["w"].data.dtype          # quantized at first use
        (True, torch.float8_e4m3fn)
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe | LinearPlan | str):
        return cls._make(tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, recipe: Recipe | LinearPlan | str):
        if tensor.ndim != 2 or not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            raise ValueError(f"Fp8WeightParam: expected a 2-D high-precision weight [N, K], got shape "
                             f"{tuple(tensor.shape)} and dtype {tensor.dtype}.")
        p = to_plan(recipe)
        check_fp8_weights_recipe(p)
        self._init(p, State(staged=tensor.detach()))

    @classmethod
    def _make(cls, shape, dtype, device, requires_grad=False) -> "Fp8WeightParam":
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=_contiguous_strides(shape), dtype=dtype,
                                                   device=device, requires_grad=requires_grad)

    def _init(self, p: LinearPlan, state: State) -> None:
        self._plan = p
        self._state = state
        self._fsdp_group: list = [None, None]  # weakrefs to FSDP2's (param group, FSDPParam): compat's cache
        self._n_slots: int | None = None

    def _take_data(self, new: "Fp8WeightParam") -> None:
        # ``param.data = new`` (AssignableData): its state (payloads or staged values) is this weight's now.
        self._plan, self._state = new._plan, new._state

    def _wrap_data(self, values: torch.Tensor) -> "Fp8WeightParam":
        return Fp8WeightParam(values, self._plan)  # staged: quantized at the next all-gather

    @classmethod
    def _wrap(cls, p: LinearPlan, state: State, shape, dtype: torch.dtype, device) -> "Fp8WeightParam":
        """A wrapper of ``shape`` / ``dtype`` / ``device`` around ``state`` (shared, not copied)."""
        out = cls._make(tuple(shape), dtype, torch.device(device))
        out._init(p, state)
        return out

    # ---- the values -------------------------------------------------------------------------

    @property
    def plan(self) -> LinearPlan:
        """The plan whose weight casts this weight stores."""
        return self._plan

    @property
    def recipe(self) -> Recipe | LinearPlan:
        """The ``Recipe`` of ``plan`` (the plan itself where it was written per GEMM)."""
        return self._plan.given

    @property
    def is_staged(self) -> bool:
        """True when the weight holds high-precision values waiting to be quantized (after init,
        a load, or another in-place write); the next all-gather or ``casts()`` quantizes them."""
        return self._state.staged is not None

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype the stored casts were quantized from (FSDP2's param dtype), None before."""
        return self._state.param_dtype

    @property
    def sharding(self) -> tuple[Sharding, ...] | None:
        """How the amax of the stored casts was reduced: FSDP2's mesh (and TP's under 2D), ``()``
        outside FSDP2; None before the first quantization."""
        return self._state.sharding

    def dequantize(self) -> torch.Tensor:
        """The high-precision values, a new plain tensor of the advertised dtype: the staged ones,
        or the forward cast dequantized."""
        values = self._values()
        return values.clone() if values is self._state.staged else values

    def hp_values(self) -> torch.Tensor:
        """``dequantize()``: the high-precision values checkpoints, copies and ``unconvert`` store
        (an ``Fp8Linear`` trained through ``MasterWeights`` stores its master's values instead)."""
        return self.dequantize()

    def _values(self) -> torch.Tensor:
        """``dequantize()`` without the copy: the staged tensor itself when there is one."""
        state = self._state
        if state.staged is not None:
            return state.staged
        if state.casts is None:
            raise RuntimeError(SHELL_MSG)
        return dequantize(state.casts["w"], dtype=self.dtype)

    def stage(self, values: torch.Tensor) -> None:
        """Replaces the weight's values by ``values`` (quantized at the next all-gather / use)."""
        if tuple(values.shape) != tuple(self.shape):
            raise ValueError(f"Fp8WeightParam.stage: values have shape {tuple(values.shape)}; expected "
                             f"{tuple(self.shape)}.")
        state = self._state
        state.staged, state.casts = values.detach().to(device=self.device, dtype=self.dtype, copy=True), None

    def set_casts(self, casts: dict[str, Fp8Tensor], param_dtype: torch.dtype,
                  sharding: tuple[Sharding, ...]) -> None:
        """Stores new casts (one per ``weight_casts(recipe)``) and drops staged values."""
        names = [name for name, _ in weight_casts(self._plan)]
        if sorted(casts) != sorted(names):
            raise ValueError(f"Fp8WeightParam.set_casts: recipe {self._plan.name!r} needs casts {names}, "
                             f"got {sorted(casts)}.")
        state = self._state
        state.staged, state.casts = None, dict(casts)
        state.param_dtype, state.sharding = param_dtype, tuple(sharding)

    def quantize_staged(self, param_dtype: torch.dtype, sharding: tuple[Sharding, ...] = ()) -> None:
        """Quantizes the staged values (cast to ``param_dtype``; amax reduced over ``sharding``).

        Collective when ``sharding`` is not empty: every rank of those meshes must call it. A
        no-op when nothing is staged.
        """
        if self._state.staged is None:
            return
        values = self._state.staged.to(param_dtype)
        casts = {name: quantize(values, spec, sharding=sharding or None)
                 for name, spec in weight_casts(self._plan)}
        self.set_casts(casts, param_dtype, sharding)

    def casts(self) -> dict[str, Fp8Tensor]:
        """The stored casts, for ``linear_with_casts`` (outside FSDP2).

        Staged values are quantized first, with this tensor's own amax: the weight is whole here
        (no mesh), so that is the logical tensor's amax.
        """
        if self._state.staged is not None:
            with torch.no_grad():
                self.quantize_staged(self._state.param_dtype or self.dtype, ())
        if self._state.casts is None:
            raise RuntimeError(SHELL_MSG)
        return self._state.casts

    def storage_bytes(self) -> int:
        """Bytes of the tensors this weight holds (payloads, scales, staged values)."""
        state = self._state
        inner = [state.staged] if state.staged is not None else []
        for q in (state.casts or {}).values():
            inner += [q.data, q.scale]
        return sum(t.untyped_storage().nbytes() for t in inner if not t.is_meta)

    # ---- torch plumbing ---------------------------------------------------------------------

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is not None:
            out = handler(cls, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return fallback(cls, func, args, kwargs)

    def __tensor_flatten__(self):
        state = self._state
        if state.staged is not None:
            return ["_staged"], (self._plan, self.dtype, None, state.param_dtype, state.sharding)
        metas = tuple((name, q.meta) for name, q in (state.casts or {}).items())
        names = [f"_{n}_{part}" for n, _ in metas for part in ("data", "scale")]
        return names, (self._plan, self.dtype, metas, state.param_dtype, state.sharding)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        p, dtype, metas, param_dtype, sharding = ctx
        if metas is None:
            state = State(staged=inner["_staged"], param_dtype=param_dtype, sharding=sharding)
            device = inner["_staged"].device
        else:
            casts = {n: Fp8Tensor(inner[f"_{n}_data"], inner[f"_{n}_scale"], m) for n, m in metas}
            state = State(casts=casts, param_dtype=param_dtype, sharding=sharding)
            device = inner[f"_{metas[0][0]}_data"].device
        return Fp8WeightParam._wrap(p, state, outer_size, dtype, device)

    def __getattr__(self, name: str):
        # The inner tensors, by the names __tensor_flatten__ gives (they live in the shared state).
        state = self.__dict__.get("_state")
        if state is not None:
            if name == "_staged" and state.staged is not None:
                return state.staged
            for cast, q in (state.casts or {}).items():
                if name == f"_{cast}_data":
                    return q.data
                if name == f"_{cast}_scale":
                    return q.scale
        raise AttributeError(f"'Fp8WeightParam' object has no attribute {name!r}")

    def __repr__(self):
        state = self._state
        kind = "staged" if state.staged is not None else "shell" if state.casts is None else \
            "casts=" + ",".join(state.casts)
        return (f"Fp8WeightParam(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._plan.name}, "
                f"{kind}, device={self.device})")

    def data_ptr(self) -> int:
        # The first inner tensor's address (code keys parameters by data_ptr(); see Fp8AllGatherWeight).
        state = self._state
        inner = state.staged if state.staged is not None else \
            next(iter(state.casts.values())).data if state.casts else None
        return 0 if inner is None else inner.data_ptr()

    def __deepcopy__(self, memo):
        # Tensor.__deepcopy__ takes a non-zero data_ptr() for a tensor with storage; this one has
        # none of its own. A deep copy is a clone (new state, cloned payloads) with the same flags.
        if id(self) not in memo:
            with torch.no_grad():
                out = self.clone()
            out.requires_grad_(self.requires_grad)
            for key, value in self.__dict__.items():
                if key not in _NOT_COPIED:
                    setattr(out, key, copy.deepcopy(value, memo))
            memo[id(self)] = out
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save) as the plain high-precision tensor, an nn.Parameter where it is one:
        # loadable with weights_only=True, without fp8func. An Fp8Linear that is unpickled stages
        # its weight again (Fp8Linear.__setstate__).
        values = self.hp_values().detach()
        if getattr(self, "_is_param", False):
            return torch._utils._rebuild_parameter, (values, self.requires_grad, OrderedDict())
        return values.__reduce_ex__(protocol)

    # ---- FSDP2 ------------------------------------------------------------------------------

    @signed_hook
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        n, _, casts, sizes = self._gather_plan(mesh, outer_size, tuple(self.shape), "convert it with fp8_weights=False")
        param_dtype = mp_policy.param_dtype or self.dtype
        if self._state.staged is not None:
            # Exactly Fp8AllGatherWeight's quantization: the shard in the param dtype, amax reduced
            # over the FSDP mesh (and the TP mesh under 2D). Runs on every rank together.
            self.quantize_staged(param_dtype, self._hook_sharding(mesh))
        state = self._state
        if state.casts is None:
            raise RuntimeError(SHELL_MSG)
        slots = self._slots(module, [name for name, _ in casts])
        inputs, entries = [], []
        for name, _ in casts:
            add_all_gather_input(inputs, entries, name, state.casts[name], slots, sizes, mesh,
                                 state.param_dtype)
        entries = finish_all_gather_inputs(inputs, entries)  # appends to inputs
        notify_all_gather(self, module, inputs, mp_policy)
        return tuple(inputs), gather_metadata(entries, slots, n)

