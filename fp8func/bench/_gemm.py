"""GEMM throughput: bf16 ``torch.mm`` against ``fp8func.gemm`` per granularity, one process."""

from __future__ import annotations

import torch

import fp8func as f8

from ._timing import median_ms

SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336)]
KINDS = {  # name: (a spec on [M, K], b spec on [N, K] before transposing to [K, N])
    "tensorwise": (f8.CastSpec(f8.E4M3), f8.CastSpec(f8.E4M3)),
    "rowwise": (f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True), f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True)),
    "blockwise 1x128 x 128x128": (f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128))),
                                  f8.CastSpec(f8.E4M3, f8.BlockWise((128, 128)))),
    "blockwise 1x128 x 128x1": (f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128))),
                                f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128)))),
}


def run(shapes=SHAPES, iters: int = 50) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        flops = 2 * m * k * n
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ms = median_ms(lambda: torch.mm(a, b.t()), iters=iters)
        bf16_ms = ms
        rows.append({"shape": (m, k, n), "kind": "bf16", "path": "torch.mm", "ms": ms,
                     "tflops": flops / ms / 1e9, "vs_bf16": 1.0})
        for name, (sa, sb) in KINDS.items():
            qa, qb = f8.quantize(a, sa), f8.quantize(b, sb).t()
            path = f8.gemm_path(qa, qb)
            ms = median_ms(lambda: f8.gemm(qa, qb, torch.bfloat16), iters=iters)
            rows.append({"shape": (m, k, n), "kind": name, "path": path, "ms": ms,
                         "tflops": flops / ms / 1e9, "vs_bf16": bf16_ms / ms})
        a = b = None  # free the operands before the next shape
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| M x K x N | GEMM | path | median ms | TFLOP/s | vs bf16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        m, k, n = r["shape"]
        lines.append(f"| {m}x{k}x{n} | {r['kind']} | {r['path']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{r['vs_bf16']:.2f}x |")
    return "\n".join(lines)
