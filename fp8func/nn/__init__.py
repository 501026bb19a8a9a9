"""The stateful shell: modules that hold parameters and a recipe and call the pure functions."""

from ._apply import apply as apply
from ._apply import next_states as next_states
from ._apply import scaling_states as scaling_states
from ._checkpoint import checkpoint_context as checkpoint_context
from ._checkpoint import selective_checkpoint_policy as selective_checkpoint_policy
from ._convert import LayerReport as LayerReport
from ._convert import Report as Report
from ._convert import convert as convert
from ._convert import plan_conversion as plan_conversion
from ._convert import report as report
from ._convert import unconvert as unconvert
from ._export import export_fp8 as export_fp8
from ._linear import Fp8Linear as Fp8Linear
from ._linear import hook_scaling_states as hook_scaling_states
from ._master import MasterWeights as MasterWeights
from ._moe import Fp8Experts as Fp8Experts
from ._moe import Fp8MoE as Fp8MoE
from ._moe import MoE as MoE
from ._moe import Router as Router
from ._schedule import PrecisionSchedule as PrecisionSchedule
from ._shared import SharedInputCasts as SharedInputCasts
from ._stats import NumericsStats as NumericsStats
from ._stats import tensor_stats as tensor_stats
from ._verify import LayerCheck as LayerCheck
from ._verify import Verification as Verification
from ._verify import verify as verify
from ._weights import observe_all_gathers as observe_all_gathers

__all__ = ["Fp8Experts", "Fp8Linear", "Fp8MoE", "LayerCheck", "LayerReport", "MasterWeights", "MoE", "NumericsStats",
           "PrecisionSchedule", "Report", "Router", "SharedInputCasts", "Verification", "apply", "checkpoint_context",
           "convert", "export_fp8", "hook_scaling_states", "next_states", "observe_all_gathers", "plan_conversion",
           "report", "scaling_states", "selective_checkpoint_policy", "tensor_stats", "unconvert", "verify"]
