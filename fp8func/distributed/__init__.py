"""Distributed pieces of the shell: FSDP2 fp8 all-gather and fp8 weight types, tensor- and expert-parallel styles.

Sits above the shell ``fp8func.nn`` in the layer order of docs/design.md: it may import the shell,
the shell never imports it. When imported (``import fp8func`` imports it) it registers its weight
types with the shell, and with the core op (``fp8func._hooks``) what the op asks of a DTensor: the
core modules import nothing of DTensor or FSDP2.
"""

from .._hooks import register_distributed as _register_distributed
from ..nn._weights import FP8_ALL_GATHER as _FP8_ALL_GATHER
from ..nn._weights import FP8_WEIGHTS as _FP8_WEIGHTS
from ..nn._weights import register_weight_type as _register_weight_type
from ._delayed import share_scaling_state as share_scaling_state
from ._dtensor import DTENSOR_HOOKS as _DTENSOR_HOOKS
from ._ep import DispatchPlan as DispatchPlan
from ._ep import ExpertParallel as ExpertParallel
from ._ep import combine as combine
from ._ep import dispatch as dispatch
from ._ep import parallelize_experts as parallelize_experts
from ._fp8_weights import Fp8WeightParam as Fp8WeightParam
from ._fsdp import Fp8AllGatherWeight as Fp8AllGatherWeight
from ._fsdp import Fp8GatheredWeight as Fp8GatheredWeight
from ._fsdp import chunk_sizes as chunk_sizes
from ._precompute import precompute_after_optimizer_step as precompute_after_optimizer_step
from ._precompute import precompute_scales as precompute_scales
from ._tp import Fp8ColwiseParallel as Fp8ColwiseParallel
from ._tp import Fp8RowwiseParallel as Fp8RowwiseParallel
from ._tp import PrepareFp8ModuleInput as PrepareFp8ModuleInput
from ._tp import sequence_all_gather as sequence_all_gather

# Neither the shell nor the core op imports this layer: the weight types the shell can hold, and
# the answers the op needs about DTensors, are registered with them here.
_register_weight_type(_FP8_ALL_GATHER, Fp8AllGatherWeight)
_register_weight_type(_FP8_WEIGHTS, Fp8WeightParam)
_register_distributed(_DTENSOR_HOOKS)

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "Fp8WeightParam", "chunk_sizes",
           "precompute_after_optimizer_step", "precompute_scales", "Fp8ColwiseParallel", "Fp8RowwiseParallel",
           "PrepareFp8ModuleInput", "sequence_all_gather", "share_scaling_state",
           "DispatchPlan", "ExpertParallel", "combine", "dispatch", "parallelize_experts"]
