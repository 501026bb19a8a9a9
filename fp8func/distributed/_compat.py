"""Every torch-private FSDP2 / DTensor attribute fp8func reads, in one place.

FSDP2 offers no public way to ask, from inside ``fsdp_pre_all_gather``, which parameter group a
weight belongs to, which pass (forward or backward) is unsharding it, whether the group reshards
after forward, or the tensor-parallel spec of the parameter it sharded; fp8func needs all four
(which casts travel, and over which meshes an amax is reduced). They are read here, and only here,
with the names each supported torch version uses; ``tests/test_compat.py`` checks every reader
against a real ``fully_shard`` on the running torch (2.11 on the GPU machine, 2.13 in CI). A reader
that cannot find what it needs says so (returns None, or raises where guessing would change the
numbers), never guesses.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TP_SPEC_ATTRS", "find_fsdp_param", "fsdp_pass", "local_tensor", "reshards_after_forward", "tp_spec"]

# FSDPParam's DTensor spec of the parameter it was given (TP / EP placements): ``_tp_spec`` up to
# torch 2.11, ``_unsharded_dtensor_spec`` since 2.12.
TP_SPEC_ATTRS = ("_unsharded_dtensor_spec", "_tp_spec")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The very local tensor object of a DTensor (``DTensor._local_tensor``), or ``t``.

    Not ``to_local()``: that returns a new view, and the fp8 weight types keep state on the
    object itself (kept scales, write counters, gathered casts)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def find_fsdp_param(weight, cache: list | None = None):
    """(FSDP2 param group, FSDPParam) whose sharded local tensor is ``weight``, or None.

    Walks FSDP2's registry of module states (``torch.distributed._composable_state
    ._module_state_mapping``, each state's ``_fsdp_param_group.fsdp_params``, each param's
    ``_sharded_local_tensor``). ``cache``: a two-element list of weakrefs kept by the caller.
    """
    if cache is not None and cache[0] is not None:
        group, fsdp_param = cache[0](), cache[1]()
        if group is not None and fsdp_param is not None:
            return group, fsdp_param
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return None
    for ref in list(_module_state_mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if getattr(fsdp_param, "_sharded_local_tensor", None) is weight:
                if cache is not None:
                    cache[:] = [weakref.ref(group), weakref.ref(fsdp_param)]
                return group, fsdp_param
    return None


_PASSES = {"FORWARD": "forward", "PRE_BACKWARD": "backward"}


def fsdp_pass(group) -> str:
    """"forward", "backward" or "unknown": the training state of an FSDP2 param group
    (``FSDPParamGroup._training_state``: ``FORWARD`` / ``PRE_BACKWARD``) during its unshard."""
    return _PASSES.get(getattr(getattr(group, "_training_state", None), "name", ""), "unknown")


def reshards_after_forward(group) -> bool:
    """Whether an FSDP2 param group frees its unsharded parameters after forward (it keeps a
    ``post_forward_mesh_info`` exactly then)."""
    return getattr(group, "post_forward_mesh_info", None) is not None


def tp_spec(fsdp_param):
    """The DTensor spec of the parameter FSDP2 sharded (its TP sharding), or None for a plain tensor.

    Raises when FSDP2 was given a DTensor but the spec is under neither known name: reading it as
    "no TP" would cast every TP shard with its own amax (a different scale per TP rank)."""
    for attr in TP_SPEC_ATTRS:
        spec = getattr(fsdp_param, attr, None)
        if spec is not None:
            return spec
    if getattr(fsdp_param, "is_dtensor", False):
        raise RuntimeError(
            f"fp8func: FSDP2 shards a DTensor parameter here, but this torch ({torch.__version__}) keeps its "
            f"spec under none of {TP_SPEC_ATTRS}, so the weight's TP sharding is unknown. Please report it; "
            "convert with fsdp_fp8_all_gather=False meanwhile (still FP8, gathered in bf16)."
        )
    return None
