"""fp8func.kernels: Triton kernels for fused amax / cast / transpose.

Always optional: every kernel has a pure-PyTorch twin (``_reference``, calls into
``fp8func.quantize`` / ``quantize_with_scale``) that it matches bitwise; ``impl="reference"``
forces it, and ``impl="auto"`` uses it wherever the tensor is not on CUDA or Triton is not
installed. Below the casts in the layer order (docs/design.md): it imports only formats, scaling,
qtensor and ops. Importing this package imports no Triton and probes no hardware (the kernels
module is imported on first use); where Triton is installed it turns on inductor's static launcher
for these kernels (``_configs.static_launches``: before ``torch.compile`` starts its compile
workers, which read that setting from the environment).

Example:
    >>> import torch, fp8func as f8, fp8func.kernels as k
    >>> spec = f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128)))
    >>> q, q_t = k.quantize(torch.randn(128, 256), spec, transpose=True)
    >>> q.scale.shape, q_t.scale.shape
    (torch.Size([128, 2]), torch.Size([256, 1]))
"""

from ._configs import static_launches as _static_launches
from ._dispatch import IMPLS as IMPLS
from ._dispatch import amax as amax
from ._dispatch import amax_rows_cols as amax_rows_cols
from ._dispatch import cast as cast
from ._dispatch import cast_amax as cast_amax
from ._dispatch import cast_many as cast_many
from ._dispatch import cast_rows_cols as cast_rows_cols
from ._dispatch import quantize as quantize
from ._dispatch import transpose as transpose
from ._dispatch import triton_available as triton_available

if triton_available():
    _static_launches()

__all__ = ["IMPLS", "amax", "amax_rows_cols", "cast", "cast_amax", "cast_many", "cast_rows_cols", "quantize",
           "transpose", "triton_available"]
