"""fp8func: FP8 training for PyTorch as pure functions over explicit pytrees.

The modules form a stack of layers, each importing only from the layers below it; docs/design.md
states their order.

Example:
    >>> import torch, fp8func as f8
    >>> q = f8.quantize(torch.randn(16, 32), f8.CastSpec(granularity=f8.AxisWise(-1)))
    >>> y = f8.linear(torch.randn(4, 32), torch.randn(8, 32), recipe="tensorwise")
"""

from ._formats import E4M3 as E4M3
from ._formats import E5M2 as E5M2
from ._formats import E8M0 as E8M0
from ._formats import fp8_max as fp8_max
from ._formats import round_up_to_pow2 as round_up_to_pow2
from ._formats import to_e8m0 as to_e8m0
from ._scaling import EPS as EPS
from ._scaling import MX as MX
from ._scaling import AxisWise as AxisWise
from ._scaling import BlockWise as BlockWise
from ._scaling import CastSpec as CastSpec
from ._scaling import DelayedScaling as DelayedScaling
from ._scaling import Recipe as Recipe
from ._scaling import TensorWise as TensorWise
from ._scaling import compute_amax as compute_amax
from ._scaling import compute_scale as compute_scale
from ._scaling import scale_shape as scale_shape
from ._sharding import Sharding as Sharding
from ._sharding import reduce_amax as reduce_amax
from ._qtensor import Fp8Meta as Fp8Meta
from ._qtensor import Fp8Tensor as Fp8Tensor
from ._ops import dequantize as dequantize
from ._ops import fake_quantize as fake_quantize
from ._ops import quantize as quantize
from ._ops import quantize_with_scale as quantize_with_scale
from ._delayed import LinearScalingState as LinearScalingState
from ._delayed import ScalingState as ScalingState
from ._delayed import quantize_delayed as quantize_delayed
from ._plan import GemmPlan as GemmPlan
from ._plan import LinearPlan as LinearPlan
from ._plan import plan as plan
from ._collectives import all_gather as all_gather
from ._gemm import gemm as gemm
from ._gemm import gemm_path as gemm_path
from ._casts import input_casts as input_casts
from ._autograd import linear as linear
from ._autograd import linear_delayed as linear_delayed
from ._grouped import JaggedFp8Tensor as JaggedFp8Tensor
from ._grouped import align_groups as align_groups
from ._grouped import dequantize_jagged as dequantize_jagged
from ._grouped import grouped_gemm as grouped_gemm
from ._grouped import grouped_gemm_path as grouped_gemm_path
from ._grouped import grouped_linear as grouped_linear
from ._grouped import quantize_jagged as quantize_jagged
from ._metrics import sqnr as sqnr
from . import distributed as distributed
from . import nn as nn
from .nn import convert as convert
from .nn import report as report
from .nn import unconvert as unconvert
from .nn import export_fp8 as export_fp8
from .nn import MasterWeights as MasterWeights
from .nn import PrecisionSchedule as PrecisionSchedule
from .nn import verify as verify
from .distributed import precompute_scales as precompute_scales

__version__ = "0.1.0"


def __getattr__(name: str):
    # fp8func.hf (the HF Trainer integration) imports transformers: loaded on first use only.
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'fp8func' has no attribute {name!r}")


__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "EPS",
    "MX",
    "AxisWise",
    "BlockWise",
    "CastSpec",
    "DelayedScaling",
    "LinearScalingState",
    "ScalingState",
    "Fp8Meta",
    "Fp8Tensor",
    "GemmPlan",
    "LinearPlan",
    "JaggedFp8Tensor",
    "MasterWeights",
    "align_groups",
    "dequantize_jagged",
    "grouped_gemm",
    "grouped_gemm_path",
    "grouped_linear",
    "quantize_jagged",
    "PrecisionSchedule",
    "Recipe",
    "Sharding",
    "TensorWise",
    "all_gather",
    "compute_amax",
    "convert",
    "export_fp8",
    "distributed",
    "nn",
    "precompute_scales",
    "report",
    "compute_scale",
    "dequantize",
    "fp8_max",
    "gemm",
    "gemm_path",
    "input_casts",
    "linear",
    "linear_delayed",
    "plan",
    "fake_quantize",
    "quantize",
    "quantize_delayed",
    "quantize_with_scale",
    "reduce_amax",
    "round_up_to_pow2",
    "scale_shape",
    "sqnr",
    "verify",
    "to_e8m0",
    "unconvert",
]
