"""Measures the rates ``convert(filter="auto")`` models (``fp8func.nn._auto.DeviceProfile``).

The host floors and leads of the profile come from ``python -m fp8func.bench auto``'s host-bound
and large shapes (see ``fp8func.nn._auto``)."""

from __future__ import annotations

import torch

import fp8func as f8

from ._timing import median_ms


def run(iters: int = 30, size: int = 8192) -> list[dict]:
    rows = []
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    flops = 2 * size**3
    rows.append({"what": "bf16_tflops", "value": flops / median_ms(lambda: a @ b.t(), iters=iters) / 1e9})
    specs = {"tensorwise": (f8.CastSpec(), f8.CastSpec()),
             "rowwise": (f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True),) * 2,
             "blockwise": (f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128))),
                           f8.CastSpec(f8.E4M3, f8.BlockWise((128, 128)))),
             # the blockwise recipe's grad-weight GEMM: both operands 1x128 groups along the contraction
             "blockwise_dw": (f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128))),) * 2}
    for kind, (sa, sb) in specs.items():
        qa, qb = f8.quantize(a, sa), f8.quantize(b, sb).t()
        rows.append({"what": f"fp8_tflops[{kind}]",
                     "value": flops / median_ms(lambda: f8.gemm(qa, qb, torch.bfloat16), iters=iters) / 1e9})
    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=iters)
    rows.append({"what": "bandwidth_gbs", "value": 2 * src.numel() * src.element_size() / ms / 1e6})
    tiny = torch.zeros(1024, device="cuda")
    ms = median_ms(lambda: [tiny.add_(1) for _ in range(100)], iters=iters)
    rows.append({"what": "kernel_us", "value": ms * 1e3 / 100})
    return rows


def table(rows: list[dict]) -> str:
    return "\n".join(["| rate | measured |", "|---|---|"] + [f"| {r['what']} | {r['value']:.1f} |" for r in rows])
