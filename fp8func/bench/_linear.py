"""Linear fwd+bwd: bf16 against torchao's FP8 linear and ``fp8func.linear``, same recipe, compiled.

One process, one table: ms per ``y = linear(x); y.backward(dy)`` (input and weight gradients)
timed two ways, and each FP8 implementation's speedup over bf16; fp8func's over torchao too.
"sync": median of single steps, synchronized after each (host time before the first kernel of
a step counts as GPU idle time); "back-to-back": steps run without synchronization, as in a
training loop where the host runs ahead (``_timing.back_to_back_ms``).
"""

from __future__ import annotations

import torch
from torch import nn

import fp8func as f8

from ._timing import back_to_back_ms, median_ms

SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192),
          (4096, 2048, 2048), (4096, 4096, 1024)]
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
# "<recipe>+fastfwd": fp8func's recipe with the output GEMM in fast accumulation, torchao's GEMM
# configuration (``Float8LinearConfig.gemm_config_output = Float8GemmConfig(use_fast_accum=True)``,
# grad GEMMs precise); fp8func's named recipes keep every GEMM precise by default.
FAST_FWD = "+fastfwd"


# fp8func recipes that torchao does not have, and the torchao recipe each is compared with:
# "delayed" (tensorwise with a 16-step amax history, TransformerEngine's default scaling; torchao
# has no delayed scaling) against torchao's dynamic tensorwise.
TORCHAO_PEER = {"delayed": "tensorwise"}


def parse_recipe(name: str) -> tuple[str, f8.Recipe]:
    """(the torchao recipe to compare with, fp8func's Recipe) for a benchmark recipe name."""
    if name.endswith(FAST_FWD):
        base = name[: -len(FAST_FWD)]
        return TORCHAO_PEER.get(base, base), f8.Recipe.from_name(base, fast_accum=("output",))
    return TORCHAO_PEER.get(name, name), f8.Recipe.from_name(name)


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


def fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def step():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(dy)

    return step


def make_linear(m, k, n, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)


def step_times(step, iters: int) -> tuple[float, float]:
    """(sync ms, back-to-back ms) of one fwd+bwd step."""
    return median_ms(step, iters=iters), back_to_back_ms(step, iters=iters)


def run(shapes=SHAPES, recipes=RECIPES, iters: int = 30) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bf16 = torch.compile(make_linear(m, k, n))
        bf16_ms, bf16_b2b = step_times(fwd_bwd(bf16, x, dy), iters)
        flops = 3 * 2 * m * k * n
        ao_ms = {}  # one torchao timing per torchao recipe
        for recipe in recipes:
            base, ours_recipe = parse_recipe(recipe)
            row = {"shape": (m, k, n), "recipe": recipe, "bf16_ms": bf16_ms, "bf16_b2b_ms": bf16_b2b,
                   "bf16_tflops": flops / bf16_ms / 1e9}
            if base not in ao_ms:
                ao = torchao_linear(make_linear(m, k, n), base)
                ao_ms[base] = step_times(fwd_bwd(torch.compile(ao), x, dy), iters) if ao is not None else (None, None)
            row["torchao_ms"], row["torchao_b2b_ms"] = ao_ms[base]
            ours = f8.nn.Fp8Linear.from_linear(make_linear(m, k, n), ours_recipe, fsdp_fp8_all_gather=False)
            compiled = torch.compile(ours, fullgraph=True)
            row["fp8func_ms"], row["fp8func_b2b_ms"] = step_times(fwd_bwd(compiled, x, dy), iters)
            rows.append(row)
            print(row, flush=True)
            torch.compiler.reset()
        del x, dy
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "n/a"

    def ms(v):
        return f"{v:.3f}" if v else "n/a"

    lines = ["| M x K x N | recipe | timing | bf16 ms | torchao ms | fp8func ms | torchao vs bf16 | fp8func vs bf16 | "
             "fp8func vs torchao |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, k, n = r["shape"]
        for timing, key in (("sync", "_ms"), ("back-to-back", "_b2b_ms")):
            bf, ao, ours = r["bf16" + key], r["torchao" + key], r["fp8func" + key]
            lines.append(f"| {m}x{k}x{n} | {r['recipe']} | {timing} | {ms(bf)} | {ms(ao)} | {ms(ours)} | "
                         f"{ratio(bf, ao)} | {ratio(bf, ours)} | {ratio(ao, ours)} |")
    return "\n".join(lines)
