"""MoE grouped GEMMs, fwd+bwd: bf16 ``torch._grouped_mm`` against ``fp8func.grouped_linear``.

Qwen3-30B-A3B's experts: 128 experts, hidden 2048, expert dim 768, 8 experts per token; 16384
tokens give 131072 routed rows. Rows per expert are positive multiples of 16 (what the FP8
kernel's weight-gradient GEMM needs; ``Fp8MoE`` pads to it), balanced or Zipf-skewed. Every
callable is compiled (``fullgraph=True``); each row is the median ms of ``y = f(x, w, offs);
y.backward(dy)`` with both gradients, and torchao's row-wise FP8 grouped GEMM where it imports.

Usage: ``python -m fp8func.bench grouped``. The "fast-accum" column runs the same casts with
``Recipe.fast_accum`` set for all three GEMMs (``use_fast_accum``: no periodic fp32 promotion).
"""

from __future__ import annotations

import importlib
import inspect

import torch

from .._grouped import grouped_gemm_path, grouped_linear
from .._ops import quantize
from .._scaling import Recipe
from ..nn._moe import Fp8MoE, MoE
from ._timing import environment, median_ms

EXPERTS, HIDDEN, EXPERT_DIM, TOP_K, TOKENS = 128, 2048, 768, 8, 16384
SKEWS = (0.0, 1.0)  # Zipf exponent of the rows-per-expert distribution (0: balanced)


def group_offsets(rows: int, experts: int, skew: float, device, seed: int = 0) -> torch.Tensor:
    """int32 ends of ``experts`` groups, each a positive multiple of 16 rows, summing to ``rows``."""
    if rows % 16 or rows < 16 * experts:
        raise ValueError(f"group_offsets: rows={rows} must be a multiple of 16 and at least 16 * {experts}.")
    g = torch.Generator().manual_seed(seed)
    weights = (torch.arange(experts, dtype=torch.float64) + 1) ** -skew
    weights = weights[torch.randperm(experts, generator=g)]
    blocks = rows // 16
    counts = (weights / weights.sum() * (blocks - experts)).floor().long() + 1  # >= 1 block each
    counts[counts.argmax()] += blocks - int(counts.sum())
    return torch.cumsum(counts * 16, 0, dtype=torch.int32).to(device)


def bf16_grouped(x, w, offs):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


FAST = Recipe.from_name("rowwise", fast_accum=("output", "grad_input", "grad_weight"))


def fp8_grouped(x, w, offs):
    return grouped_linear(x, w, offs, "rowwise")


def _fp8_grouped_fast(x, w, offs):
    return grouped_linear(x, w, offs, FAST)


def torchao_grouped():
    """torchao's row-wise FP8 grouped GEMM as ``f(x, w [E, N, K], offs)``, or None where it does not import."""
    for module, name in (("torchao.prototype.moe_training.fp8_grouped_mm", "_to_fp8_rowwise_then_scaled_grouped_mm"),
                         ("torchao.prototype.moe_training.scaled_grouped_mm", "_scaled_grouped_mm")):
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        # torchao 0.18 asserts unless told the groups are padded already (they are: multiples of 16)
        pad = "pad_token_groups_for_grouped_mm"
        kw = {pad: False} if pad in inspect.signature(fn).parameters else {}
        return lambda x, w, offs: fn(x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16, **kw)
    print("torchao: no row-wise FP8 grouped GEMM importable here; its column is n/a")
    return None


def make_step(fn, inputs, dy, params):
    def step():
        for t in (*inputs, *params):
            t.grad = None
        fn(*inputs).backward(dy)

    return step


def _time(fn, inputs, dy, iters: int, params=(), optional: bool = False) -> float | None:
    """Median ms of a compiled fwd+bwd; ``optional``: a baseline whose failure (torchao API drift)
    is printed and gives None instead of stopping the other rows."""
    try:
        return median_ms(make_step(torch.compile(fn, fullgraph=True), inputs, dy, params), iters=iters)
    except Exception as e:
        if not optional:
            raise
        print(f"baseline failed, its column is n/a: {type(e).__name__}: {e}")
        return None
    finally:
        torch.compiler.reset()


def _experts_block(recipe, hidden: int, expert_dim: int, experts: int, device):
    torch.manual_seed(0)
    moe = MoE(hidden, expert_dim, experts, TOP_K, device=device, dtype=torch.bfloat16)
    moe = Fp8MoE.from_float(moe, recipe, align=1) if recipe else moe  # groups are already aligned
    return lambda x, offs: moe._experts(x, offs), list(moe.parameters())


def run(iters: int = 30, tokens: int = TOKENS, skews=SKEWS, *, experts: int = EXPERTS, hidden: int = HIDDEN,
        expert_dim: int = EXPERT_DIM, device="cuda") -> list[dict]:
    """The table's rows; the keywords shrink the problem for a smoke run."""
    rows, m = [], tokens * TOP_K
    ao = torchao_grouped()
    for skew in skews:
        offs = group_offsets(m, experts, skew, device)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        groups = f"{int(sizes.min())}..{int(sizes.max())} rows/expert"
        for what, k, n in (("gate / up proj", hidden, expert_dim), ("down proj", expert_dim, hidden)):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) / k**0.5).requires_grad_()
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            spec = Recipe.from_name("rowwise").input
            path = grouped_gemm_path(quantize(x.detach(), spec), quantize(w.detach(), spec).transpose(1, 2))
            flops = 3 * 2 * m * k * n
            row = {"what": what, "shape": (m, k, n), "groups": groups, "path": path, "tflop": flops / 1e12}
            for name, fn in (("bf16_ms", bf16_grouped), ("fp8func_ms", fp8_grouped),
                             ("fp8func_fast_ms", _fp8_grouped_fast), ("torchao_ms", ao)):
                run_fn = lambda x, w, fn=fn: fn(x, w, offs)  # noqa: E731
                row[name] = None if fn is None else _time(run_fn, (x, w), dy, iters, optional=fn is ao)
            rows.append(row)
            print(row, flush=True)
            del x, w, dy
        x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
        row = {"what": "SwiGLU experts (3 projections)", "shape": (m, hidden, expert_dim), "groups": groups,
               "path": rows[-1]["path"], "tflop": 3 * 3 * 2 * m * hidden * expert_dim / 1e12, "torchao_ms": None}
        for name, recipe in (("bf16_ms", None), ("fp8func_ms", "rowwise"), ("fp8func_fast_ms", FAST)):
            fn, params = _experts_block(recipe, hidden, expert_dim, experts, device)
            row[name] = _time(lambda x, fn=fn: fn(x, offs), (x,), dy, iters, params=params)
        rows.append(row)
        print(row, flush=True)
        del x, dy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    env = environment()
    lines = [f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}: `{env['command']}`", "",
             "| GEMM | M x K x N | groups | FP8 path | bf16 ms | fp8func ms | fp8func fast-accum ms | torchao ms | "
             "fp8func vs bf16 | fast-accum vs bf16 | fp8func TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(v):
        return f"{v:.3f}" if v else "n/a"

    for r in rows:
        m, k, n = r["shape"]
        bf, ours = r["bf16_ms"], r["fp8func_ms"]
        fast = r.get("fp8func_fast_ms")
        speedup = f"{bf / ours:.2f}x" if bf and ours else "n/a"
        fast_speedup = f"{bf / fast:.2f}x" if bf and fast else "n/a"
        tflops = f"{r['tflop'] / ours * 1e3:.0f}" if ours else "n/a"
        lines.append(f"| {r['what']} | {m}x{k}x{n} | {r['groups']} | {r['path']} | {ms(bf)} | {ms(ours)} | "
                     f"{ms(fast)} | {ms(r['torchao_ms'])} | {speedup} | {fast_speedup} | {tflops} |")
    return "\n".join(lines)
