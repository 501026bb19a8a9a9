"""The structural aten ops: the ones a weight tensor type answers itself, keeping its type.

FSDP2 (sharding, padding, unsharding into its buffers), module moves (``.to``, ``to_empty``),
initialisation, ``state_dict`` loading and copies apply these to a parameter; a weight type that
wraps other tensors (the FSDP2 fp8 all-gather weight, FP8 primary weights, a gathered weight)
must return its own type from them, or FSDP2 shards a plain tensor and the FP8 path is silently
lost. Every other op computes on the values and returns plain tensors. One table, read by every
weight type, so that they agree on what "structural" means; ``tests/test_checkpoint_copies.py``
checks that each type answers exactly these.
"""

from __future__ import annotations

import torch

__all__ = ["ALIAS_OPS", "COPY_OPS", "NEW_OPS", "ROW_OPS", "STRUCTURAL_OPS", "WRITE_OPS"]

aten = torch.ops.aten

# Views of the same values: ``detach`` (``.data``, ``nn.Parameter(...)``), FSDP2's flat views.
ALIAS_OPS = frozenset({
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten._reshape_alias.default,
})
# Row pieces: FSDP2's ``torch.chunk`` of dim 0 and the narrow into its padded shard.
ROW_OPS = frozenset({aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default})
# New storage of the same kind (FSDP2's padded shard, ``to_empty``, optimizer-free copies).
NEW_OPS = frozenset({aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default})
# Copies and moves: ``clone`` (``copy.deepcopy``), ``.to(device / dtype)``, pinning.
COPY_OPS = frozenset({aten.clone.default, aten._to_copy.default, aten._pin_memory.default})
# The structural write: ``copy_`` (FSDP2's padding copy, ``load_state_dict``).
WRITE_OPS = frozenset({aten.copy_.default})

STRUCTURAL_OPS = ALIAS_OPS | ROW_OPS | NEW_OPS | COPY_OPS | WRITE_OPS


class AssignableData:
    """``param.data = new`` for a weight type that wraps other tensors: the weight takes ``new``'s
    values, keeping its own type.

    ``Tensor.data``'s setter swaps only the C++ metadata (dtype, shape, device) of a wrapper
    subclass, never the Python attributes that hold its values: after accelerate's upcast of the
    trainable parameters (``param.data = param.data.to(torch.float32)``) the weight would call
    itself float32 and hold bf16 values, and every later move, ``state_dict`` and FSDP2 buffer
    would disagree on its size. A weight type mixing this in implements
    ``_take_data(new: same type) -> None`` (adopt ``new``'s wrapped values) and
    ``_wrap_data(values: plain tensor) -> same type`` (a plain tensor assigned to ``.data``)."""

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.data = {type(new).__name__}: expected a tensor.")
        if type(new) is not type(self):
            new = self._wrap_data(new.detach())
        torch._C.TensorBase.data.__set__(self, new)
        self._take_data(new)
