"""``python -m fp8func.demo``: a small Llama-style model trained on a public-domain book (bytes as
tokens), bf16 and FP8 side by side from the same init and batch order; prints the conversion line,
``report(model)``, the ``verify`` table of the first FP8 step and a loss table, and writes a
loss-curve PNG. CPU by default (the emulated FP8 path), the GPU when present (the hardware path).

Example:
    >>> from fp8func.demo import main
    >>> main(["--steps", "3", "--seq", "64", "--out", "/tmp/loss.png"])
"""

from ._train import build_model as build_model
from ._train import main as main

__all__ = ["build_model", "main"]
