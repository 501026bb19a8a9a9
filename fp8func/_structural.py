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
