"""fp8func.kernels: Triton kernels for fused amax / cast / transpose (installed from ``kernels/``).

Always optional: every kernel has a pure-PyTorch twin in ``fp8func`` (``quantize``,
``quantize_with_scale``) that it must match bitwise. Nothing here is imported by the core, and
importing this package probes no hardware.
"""

__all__: list[str] = []
