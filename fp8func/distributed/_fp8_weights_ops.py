"""The ops an ``Fp8WeightParam`` answers itself (structural: FSDP2 sharding, module moves) and the
fallback that runs everything else on its high-precision values (writes are staged)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .._qtensor import Fp8Tensor
from .._scaling import raw_block_lengths
from .._sharding import Sharding

__all__ = ["HANDLERS", "fallback", "State", "row_block"]

aten = torch.ops.aten

SHELL_MSG = (
    "fp8func: this is a flattened view of an Fp8WeightParam (FSDP2 keeps one and never reads it); it "
    "holds no values. Read the weight itself (it dequantizes), or its master copy (fp8func.nn.MasterWeights)."
)


@dataclass(eq=False)
class State:
    """What an ``Fp8WeightParam`` holds; shared by its aliases (``detach``, ``nn.Parameter``).

    Exactly one of ``staged`` (high-precision values waiting to be quantized) and ``casts`` is
    set, except in a shell (a flattened view, which FSDP2 keeps and never reads): neither.
    ``param_dtype`` / ``sharding``: what the casts were quantized from and how their amax was
    reduced, recorded at the first quantization (``MasterWeights`` re-quantizes the same way).
    """

    staged: torch.Tensor | None = None
    casts: dict[str, Fp8Tensor] | None = None
    param_dtype: torch.dtype | None = None
    sharding: tuple[Sharding, ...] | None = None

    def carry(self, **changes) -> "State":
        """A new state with this one's recorded param dtype and sharding, and ``changes``."""
        return State(**{"param_dtype": self.param_dtype, "sharding": self.sharding, **changes})

    def check(self) -> None:
        if self.staged is None and self.casts is None:
            raise RuntimeError(SHELL_MSG)



def row_block(q: Fp8Tensor) -> int | None:
    """Rows per scale entry of a stored cast: None when one scale spans all rows."""
    return raw_block_lengths(q.spec.granularity, tuple(q.data.shape))[0]


def _rows(t: torch.Tensor, start: int, end: int, b: int, n: int) -> torch.Tensor:
    """Rows ``start:end`` of ``t``, whose entries stand for ``b`` rows each (a view)."""
    if start % b or end % b:
        raise ValueError(
            f"fp8func: this fp8 weight ({n} rows) has one scale per {b} rows, so its rows can only be "
            f"split at multiples of {b}; asked for rows {start}:{end}. Under FSDP2, use sizes where "
            f"N / world_size is a multiple of {b}, or convert this layer with fp8_weights=False."
        )
    return t[start // b:end // b]


def _slice_state(state: State, start: int, end: int) -> State:
    state.check()
    if state.staged is not None:
        return state.carry(staged=state.staged[start:end])
    casts = {}
    for name, q in state.casts.items():
        n, b = q.data.shape[0], row_block(q)
        scale = q.scale if b is None else _rows(q.scale, start, end, b, n)
        casts[name] = Fp8Tensor(q.data[start:end], scale, q.meta)
    return state.carry(casts=casts)


def _map_state(state: State, fn, scale_fn=None) -> State:
    """A new state with ``fn`` applied to every inner tensor (``scale_fn`` to the scales)."""
    state.check()
    if state.staged is not None:
        return state.carry(staged=fn(state.staged))
    scale_fn = scale_fn or fn
    return state.carry(casts={n: Fp8Tensor(fn(q.data), scale_fn(q.scale), q.meta) for n, q in state.casts.items()})


def _wrap(cls, self, state: State, shape=None, dtype=None):
    return cls._wrap(self._plan, state, self.shape if shape is None else shape, dtype or self.dtype,
                     _device_of(state, self.device))


def _device_of(state: State, default):
    if state.staged is not None:
        return state.staged.device
    if state.casts:
        return next(iter(state.casts.values())).data.device
    return default


def _alias(cls, self, *args, **kwargs):
    return _wrap(cls, self, self._state)


def _view(cls, self, size, *rest, **kwargs):
    size = list(size)
    if -1 in size:
        known = math.prod(d for d in size if d != -1)
        size[size.index(-1)] = self.numel() // known if known else 0
    if tuple(size) == tuple(self.shape):
        return _wrap(cls, self, self._state)
    # A flattened view (FSDP2 keeps padded_shard.view(-1) and never reads it for tensors that
    # define fsdp_pre_all_gather): a shell, so it does not keep values alive.
    return _wrap(cls, self, self._state.carry(), shape=tuple(size))


def _slice(cls, self, dim=0, start=None, end=None, step=1):
    if self.dim() != 2 or dim % 2 != 0 or step != 1:
        return NotImplemented
    n = self.shape[0]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    start, end = min(max(start, 0), n), min(max(end, start), n)
    return _wrap(cls, self, _slice_state(self._state, start, end), shape=(end - start, self.shape[1]))


def _split_with_sizes(cls, self, sizes, dim=0):
    if self.dim() != 2:
        return NotImplemented
    if dim % 2 != 0:
        raise NotImplementedError(
            f"fp8func: splitting an fp8 weight of shape {tuple(self.shape)} along dim 1 (FSDP2 Shard(1) or a "
            "tensor-parallel split) is not supported: its payloads and scales are split by rows only. "
            "Shard it along dim 0, or convert this layer with fp8_weights=False."
        )
    out, start = [], 0
    for s in sizes:
        out.append(_slice(cls, self, 0, start, start + s))
        start += s
    return out


def _split(cls, self, split_size, dim=0):
    if self.dim() != 2:
        return NotImplemented
    n = self.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return _split_with_sizes(cls, self, sizes or [0], dim)


def _new(cls, self, size, fill, dtype=None, layout=None, device=None, pin_memory=None):
    """``new_zeros`` / ``new_empty`` of rows of this weight (FSDP2's padded shard)."""
    if self.dim() != 2 or len(size) != 2 or size[1] != self.shape[1] or (dtype is not None and dtype != self.dtype):
        return NotImplemented
    m = size[0]
    state = self._state
    state.check()
    device = device or _device_of(state, self.device)
    if state.staged is not None:
        new = state.carry(staged=fill(state.staged, (m, size[1]), device=device))
    else:
        casts = {}
        for name, q in state.casts.items():
            b = row_block(q)
            if b is None:
                scale = q.scale.to(device, copy=True)
            else:
                _rows(q.scale, 0, m, b, m)  # raises unless m is a multiple of b
                scale = q.scale.new_zeros((m // b, *q.scale.shape[1:]), device=device)
            casts[name] = Fp8Tensor(fill(q.data, (m, size[1]), device=device), scale, q.meta)
        new = state.carry(casts=casts)
    return cls._wrap(self._plan, new, (m, size[1]), self.dtype, device)


def _new_zeros(cls, self, size, **kwargs):
    return _new(cls, self, size, lambda t, s, device: t.new_zeros(s, device=device), **kwargs)


def _new_empty(cls, self, size, **kwargs):
    return _new(cls, self, size, lambda t, s, device: t.new_empty(s, device=device), **kwargs)


def _empty_like(cls, self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if dtype is not None and not (dtype.is_floating_point and dtype.itemsize > 1):
        return NotImplemented
    dtype = dtype or self.dtype
    state = self._state
    if state.staged is None and state.casts is None:
        return _wrap(cls, self, state.carry(), dtype=dtype)
    if state.staged is not None:
        new = state.carry(staged=torch.empty_like(state.staged, dtype=dtype, device=device))
    else:
        new = _map_state(state, lambda t: torch.empty_like(t, device=device))
    return cls._wrap(self._plan, new, self.shape, dtype, _device_of(new, self.device))


def _to_copy(cls, self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    if dtype is not None and not (dtype.is_floating_point and dtype.itemsize > 1):
        return NotImplemented  # e.g. .to(torch.int8): a plain tensor of the values
    dtype = dtype or self.dtype
    state = self._state
    state.check()
    if state.staged is not None:
        new = state.carry(staged=aten._to_copy(state.staged, dtype=dtype, device=device, non_blocking=non_blocking))
    else:
        new = _map_state(state, lambda t: aten._to_copy(t, device=device, non_blocking=non_blocking))
    return cls._wrap(self._plan, new, self.shape, dtype, _device_of(new, self.device))


def _clone(cls, self, memory_format=None):
    return _wrap(cls, self, _map_state(self._state, lambda t: t.clone()))


def _pin_memory(cls, self, device=None):
    return _wrap(cls, self, _map_state(self._state, lambda t: aten._pin_memory(t, device)))


def _copy_(cls, self, src, non_blocking=False):
    """``copy_`` between two fp8 weights: a structural copy (FSDP2 padding, module moves)."""
    if not (isinstance(self, cls) and isinstance(src, cls)):
        return NotImplemented
    if tuple(self.shape) != tuple(src.shape):
        raise ValueError(f"fp8func: copy_ of an fp8 weight of shape {tuple(src.shape)} into one of shape "
                         f"{tuple(self.shape)}; fp8 weights copy whole.")
    s, d = src._state, self._state
    s.check()
    if s.staged is not None:
        if d.staged is not None:
            d.staged.copy_(s.staged, non_blocking)  # in place: FSDP2 writes into a view of its padded shard
        else:
            d.staged, d.casts = s.staged.to(device=self.device, dtype=self.dtype, copy=True), None
    elif d.casts is not None and all(n in d.casts and d.casts[n].scale.shape == q.scale.shape
                                     for n, q in s.casts.items()):
        for n, q in s.casts.items():
            d.casts[n].data.copy_(q.data, non_blocking)
            d.casts[n].scale.copy_(q.scale, non_blocking)
        d.casts = {n: Fp8Tensor(d.casts[n].data, d.casts[n].scale, q.meta) for n, q in s.casts.items()}
    else:
        d.staged = None
        d.casts = {n: Fp8Tensor(q.data.to(self.device, copy=True), q.scale.to(self.device, copy=True), q.meta)
                   for n, q in s.casts.items()}
    d.param_dtype, d.sharding = s.param_dtype, s.sharding
    return self


# Exactly fp8func._structural.STRUCTURAL_OPS (tests/test_checkpoint_copies.py checks it).
HANDLERS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.as_strided.default: _view,
    aten._reshape_alias.default: _view,
    aten.slice.Tensor: _slice,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_empty,
    aten.empty_like.default: _empty_like,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten._pin_memory.default: _pin_memory,
    aten.copy_.default: _copy_,
}


def _written(cls, func, args, kwargs) -> list:
    """The fp8 weights among the arguments that ``func`` writes (per its schema)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, cls) and not any(t is w for w in out):
                out.append(t)
    return out


def fallback(cls, func, args, kwargs):
    """Runs ``func`` on the high-precision values; an fp8 weight it writes keeps the result staged.

    No quantization here: a local amax would give each rank its own scale. The next all-gather
    (every rank together) or ``casts()`` quantizes the staged values.
    """
    written = _written(cls, func, args, kwargs)
    values: dict[int, torch.Tensor] = {}

    def hp(t):
        if id(t) not in values:
            values[id(t)] = t._values()  # staged: the tensor itself, so writes land in place
        return values[id(t)]

    args, kwargs = pytree.tree_map_only(cls, hp, (args, kwargs))
    out = func(*args, **kwargs)
    for t in written:
        if t._state.staged is None:
            t._state.staged, t._state.casts = values[id(t)], None
    back = {id(values[id(t)]): t for t in written}
    return pytree.tree_map_only(torch.Tensor, lambda r: back.get(id(r), r), out)
