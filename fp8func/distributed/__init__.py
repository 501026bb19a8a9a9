"""Distributed pieces of the shell: FSDP2 fp8 all-gather weight types (tensor-parallel styles next)."""

from ._fsdp import Fp8AllGatherWeight as Fp8AllGatherWeight
from ._fsdp import Fp8GatheredWeight as Fp8GatheredWeight
from ._fsdp import chunk_sizes as chunk_sizes
from ._fsdp import precompute_scales as precompute_scales

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "chunk_sizes", "precompute_scales"]
