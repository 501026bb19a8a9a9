"""The main benchmarks in one process: linears, quantize kernels, the layer step.

``python -m fp8func.bench all``: bf16, torchao (same recipe) and fp8func fwd+bwd for the six
shapes and the tensorwise, rowwise and blockwise recipes (``bench linear``); each quantize
kernel's bandwidth against the device copy measured in the same process (``bench quantize``);
the Llama-3-8B-sized layer's training step, tokens/s (``bench block``). One report, three
tables, one environment line: the figures are comparable with each other.
"""

from __future__ import annotations

from . import _block, _linear, _quant

RECIPES = ("tensorwise", "rowwise", "blockwise")
PARTS = (("linear fwd+bwd", _linear), ("quantize kernels", _quant), ("layer step", _block))


def run(shapes=_linear.SHAPES, recipes=RECIPES, iters: int = 20) -> dict:
    rows = {}
    rows["linear fwd+bwd"] = _linear.run(shapes=shapes, recipes=recipes, iters=iters)
    rows["quantize kernels"] = _quant.run(iters=max(iters, 30))
    rows["layer step"] = _block.run(recipes=recipes, iters=max(iters // 2, 5))
    return rows


def table(rows: dict) -> str:
    return "\n\n".join(f"### {name}\n\n{module.table(rows[name])}" for name, module in PARTS if name in rows)
