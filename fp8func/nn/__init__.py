"""The stateful shell: modules that hold parameters and a recipe and call the pure functions."""

from ._convert import LayerReport as LayerReport
from ._convert import Report as Report
from ._convert import convert as convert
from ._convert import report as report
from ._linear import Fp8Linear as Fp8Linear

__all__ = ["Fp8Linear", "LayerReport", "Report", "convert", "report"]
