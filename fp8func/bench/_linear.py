"""Linear fwd+bwd: bf16 against torchao's FP8 linear and ``fp8func.linear``, same recipe, compiled.

One process, one table: median ms of ``y = linear(x); y.backward(dy)`` (input and weight
gradients), and each FP8 implementation's speedup over bf16; fp8func's over torchao too.
"""

from __future__ import annotations

import torch
from torch import nn

import fp8func as f8

from ._timing import median_ms

SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192),
          (4096, 2048, 2048), (4096, 4096, 1024)]
RECIPES = ("tensorwise", "rowwise", "blockwise")


def torchao_linear(linear: nn.Linear, recipe: str) -> nn.Module | None:
    """torchao's training linear for ``recipe`` (None where torchao has none)."""
    try:
        if recipe == "blockwise":
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

            return Float8BlockwiseLinear.from_float(linear)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return convert_to_float8_training(nn.Sequential(linear), config=Float8LinearConfig.from_recipe_name(recipe))
    except (ImportError, ValueError, AttributeError) as e:  # recipe unknown to this torchao
        print(f"torchao has no {recipe} training linear here: {e}")
        return None


def _fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(dy)

    return step


def _linear(m, k, n, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)


def run(shapes=SHAPES, recipes=RECIPES, iters: int = 30) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bf16 = torch.compile(_linear(m, k, n))
        bf16_ms = median_ms(_fwd_bwd(bf16, x, dy), iters=iters)
        flops = 3 * 2 * m * k * n
        for recipe in recipes:
            row = {"shape": (m, k, n), "recipe": recipe, "bf16_ms": bf16_ms, "bf16_tflops": flops / bf16_ms / 1e9}
            ao = torchao_linear(_linear(m, k, n), recipe)
            row["torchao_ms"] = median_ms(_fwd_bwd(torch.compile(ao), x, dy), iters=iters) if ao is not None else None
            ours = f8.nn.Fp8Linear.from_linear(_linear(m, k, n), f8.Recipe.from_name(recipe), fsdp_fp8_all_gather=False)
            row["fp8func_ms"] = median_ms(_fwd_bwd(torch.compile(ours, fullgraph=True), x, dy), iters=iters)
            rows.append(row)
            print(row, flush=True)
            torch.compiler.reset()
        del x, dy
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| M x K x N | recipe | bf16 ms | torchao ms | fp8func ms | torchao vs bf16 | fp8func vs bf16 | "
             "fp8func vs torchao |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, k, n = r["shape"]
        ao, ours, bf = r["torchao_ms"], r["fp8func_ms"], r["bf16_ms"]
        ao_s = f"{ao:.3f}" if ao else "n/a"
        lines.append(f"| {m}x{k}x{n} | {r['recipe']} | {bf:.3f} | {ao_s} | {ours:.3f} | "
                     f"{(bf / ao if ao else float('nan')):.2f}x | {bf / ours:.2f}x | "
                     f"{(ao / ours if ao else float('nan')):.2f}x |")
    return "\n".join(lines)
