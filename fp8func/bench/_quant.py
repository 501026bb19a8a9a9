"""Quantization bandwidth: ``fp8func.kernels`` (Triton) against the ``torch.compile``d twin.

Each case runs both implementations of one call (``impl="triton"`` and the twin compiled by
inductor, ``fullgraph=True``), captured in a CUDA graph (no Python overhead in the figure) and
over enough input copies that the data never sits in L2. Bandwidth counts the minimum bytes
(each input read once, each output written once, scales included) and is also given as a
fraction of a device-to-device copy measured in the same process.
"""

from __future__ import annotations

import functools
import math

import torch

import fp8func as f8
import fp8func.kernels as fk

from ._timing import median_ms

SHAPES = [(16384, 4096), (16384, 14336), (8192, 8192), (4096, 2048)]
_TW = f8.CastSpec(f8.E4M3)
_ROW = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), power_of_2=True)
_B1 = f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128)))
_B128 = f8.CastSpec(f8.E4M3, f8.BlockWise((128, 128)))
CASES = [  # (name, spec, op, transpose)
    ("tensorwise amax", _TW, "amax", False),
    ("tensorwise cast", _TW, "cast", False),
    ("tensorwise cast+T", _TW, "cast", True),
    ("tensorwise quantize+T (2 passes)", _TW, "quantize", True),
    ("delayed cast+amax", _TW, "cast_amax", False),
    ("delayed cast+T+amax", _TW, "cast_amax", True),
    ("rowwise", _ROW, "quantize", False),
    ("rowwise+T (2 passes)", _ROW, "quantize", True),
    ("1x128", _B1, "quantize", False),
    ("1x128+T", _B1, "quantize", True),
    ("128x128", _B128, "quantize", False),
    ("128x128+T", _B128, "quantize", True),
]
_L2_FLUSH_BYTES = 256 * 2**20  # inputs rotated until they span this much (H200 L2: 60 MB)


def _call(spec: f8.CastSpec, op: str, transpose: bool, impl: str, x, s, s_t):
    if op == "amax":
        return fk.amax(x, spec.granularity, impl=impl)
    if op == "cast":
        return fk.cast(x, s, spec, transpose=transpose, scale_t=s_t, impl=impl)
    if op == "cast_amax":  # delayed scaling: a given scale, the amax recorded in the same pass
        return fk.cast_amax(x, s, spec, transpose=transpose, impl=impl)
    return fk.quantize(x, spec, transpose=transpose, impl=impl)


def min_bytes(spec: f8.CastSpec, op: str, transpose: bool, shape: tuple[int, int], x_bytes: int) -> int:
    """Each input read once, each output written once: x, fp8 copies, scales (read or written)."""
    m, k = shape
    copies = 2 if transpose else 1
    if op == "amax":
        return m * k * x_bytes + 4 * math.prod(f8.scale_shape(spec.granularity, shape))
    scales = 4 * math.prod(f8.scale_shape(spec.granularity, shape))
    if op == "cast_amax":
        return m * k * x_bytes + copies * m * k + 2 * scales  # the scale read, the amax written
    if transpose:
        scales += 4 * math.prod(f8.scale_shape(spec.granularity, (k, m)))
    return m * k * x_bytes + copies * m * k + scales


def graph_ms(fn, args_list, iters: int) -> float:
    """Median ms of one call, timed as a CUDA graph of one call per rotated input set."""
    for args in args_list[:2]:
        fn(*args)  # compile / JIT outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in args_list:
            fn(*args)
    return median_ms(graph.replay, warmup=3, iters=iters) / len(args_list)


def copy_gbps(iters: int) -> float:
    """Device-to-device copy bandwidth of a 1 GiB bf16 tensor, bytes read + written."""
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=iters)
    return 2 * src.numel() * 2 / ms / 1e6


def run(shapes=SHAPES, iters: int = 50) -> list[dict]:
    copy = copy_gbps(iters)
    rows = [{"shape": None, "kernel": "copy (bf16, 1 GiB)", "gbps": copy}]
    for m, k in shapes:
        n = max(1, math.ceil(_L2_FLUSH_BYTES / (m * k * 2)))
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        for name, spec, op, transpose in CASES:
            if op in ("cast", "cast_amax"):
                s = [fk.quantize(x, spec, transpose=transpose, impl="reference") for x in xs]
                args = [(x, q.scale, None if q_t is None else q_t.scale) for x, (q, q_t) in zip(xs, s)]
            else:
                args = [(x, None, None) for x in xs]
            tri = functools.partial(_call, spec, op, transpose, "triton")
            torch._dynamo.reset()
            ind = torch.compile(functools.partial(_call, spec, op, transpose, "reference"), fullgraph=True)
            nbytes = min_bytes(spec, op, transpose, (m, k), 2)
            t_ms, i_ms = graph_ms(tri, args, iters), graph_ms(ind, args, iters)
            rows.append({"shape": (m, k), "kernel": name, "bytes": nbytes, "triton_ms": t_ms,
                         "triton_gbps": nbytes / t_ms / 1e6, "inductor_ms": i_ms,
                         "inductor_gbps": nbytes / i_ms / 1e6})
        del xs, args
        torch.cuda.empty_cache()
    for r in rows[1:]:
        r["triton_of_copy"], r["inductor_of_copy"] = r["triton_gbps"] / copy, r["inductor_gbps"] / copy
    return rows


def table(rows: list[dict]) -> str:
    copy = rows[0]
    lines = [f"device copy: {copy['gbps']:.0f} GB/s (read + write, {copy['kernel']})", "",
             "| M x K | kernel | min MB | Triton ms | GB/s | of copy | inductor ms | GB/s | of copy | faster |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows[1:]:
        m, k = r["shape"]
        t, i = r["triton_ms"], r["inductor_ms"]
        faster = f"{'Triton' if t <= i else 'inductor'} ({max(t, i) / min(t, i):.2f}x)"
        lines.append(
            f"| {m}x{k} | {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['triton_ms']:.4f} | {r['triton_gbps']:.0f} | "
            f"{r['triton_of_copy']:.0%} | {r['inductor_ms']:.4f} | {r['inductor_gbps']:.0f} | "
            f"{r['inductor_of_copy']:.0%} | {faster} |")
    return "\n".join(lines)
