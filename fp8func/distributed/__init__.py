"""Distributed pieces of the shell: FSDP2 fp8 all-gather and fp8 weight types, tensor- and expert-parallel styles."""

from ._delayed import share_scaling_state as share_scaling_state
from ._ep import DispatchPlan as DispatchPlan
from ._ep import ExpertParallel as ExpertParallel
from ._ep import combine as combine
from ._ep import dispatch as dispatch
from ._ep import parallelize_experts as parallelize_experts
from ._fp8_weights import Fp8WeightParam as Fp8WeightParam
from ._fsdp import Fp8AllGatherWeight as Fp8AllGatherWeight
from ._fsdp import Fp8GatheredWeight as Fp8GatheredWeight
from ._fsdp import chunk_sizes as chunk_sizes
from ._fsdp import precompute_scales as precompute_scales
from ._tp import Fp8ColwiseParallel as Fp8ColwiseParallel
from ._tp import Fp8RowwiseParallel as Fp8RowwiseParallel
from ._tp import PrepareFp8ModuleInput as PrepareFp8ModuleInput
from ._tp import sequence_all_gather as sequence_all_gather

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "Fp8WeightParam", "chunk_sizes", "precompute_scales", "Fp8ColwiseParallel", "Fp8RowwiseParallel",
           "PrepareFp8ModuleInput", "sequence_all_gather", "share_scaling_state",
           "DispatchPlan", "ExpertParallel", "combine", "dispatch", "parallelize_experts"]
