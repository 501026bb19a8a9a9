"""``python -m fp8func.demo``: a small Llama-style model trained on a public-domain book (bytes as
tokens): bf16, FP8 from the same init and batches, and bf16 from another seed (the run-to-run
noise that the FP8 gap is judged against). Prints a short header, a progress bar (stderr), then
which layers ran FP8 (``fp8func.nn.verify`` on the first FP8 step), a loss table and a one-line
verdict; writes a loss-curve PNG. CPU by default (the emulated FP8 path), the GPU when present
(the hardware path).

Example:
    >>> from fp8func.demo import main
    >>> main(["--steps", "3", "--seq", "64", "--out", "loss.png"])
"""

from ._train import build_model as build_model
from ._train import main as main

__all__ = ["build_model", "main"]
