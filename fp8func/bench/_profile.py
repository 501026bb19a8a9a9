"""Where the time of one linear fwd+bwd goes: the GPU kernels of bf16, torchao and fp8func, side by side.

``python -m fp8func.bench profile --shapes 16384x4096x4096 --recipes tensorwise`` runs each
implementation compiled (as ``bench linear`` does), then ``torch.profiler`` over a few steps, and
prints per implementation its kernels by total GPU time per step (name, calls per step, us per
step, share). The rows are the evidence for where a gap between implementations comes from.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8func as f8

from ._linear import fwd_bwd, make_linear, parse_recipe, torchao_linear

STEPS = 5
HOST_TABLES: list[str] = []  # CPU-side profile of each implementation's step, in run order


def kernel_times(step, steps: int = STEPS) -> list[tuple[str, float, float]]:
    """[(kernel name, calls per step, GPU us per step)] of ``step``, largest first."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name, [0, 0.0])
            t[0] += 1
            t[1] += e.device_time
    rows = [(name, n / steps, us / steps) for name, (n, us) in totals.items()]
    # Host time of a step (Python, guards, autograd, launches): the GPU idles for whatever of it
    # a step-by-step timing cannot hide behind the previous kernels.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    HOST_TABLES.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
    return sorted(rows, key=lambda r: -r[2]) + [("(host time per step, not a kernel)", 0, host)]


def run(shapes=((16384, 4096, 4096),), recipes=("tensorwise",), iters: int = 0) -> list[dict]:
    if "grouped" in recipes:
        print("\n".join(grouped_gemm_times()))
        return run_grouped()
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        impls = [("bf16", "-", torch.compile(make_linear(m, k, n)))]
        for recipe in recipes:
            base, ours_recipe = parse_recipe(recipe)  # "delayed" against torchao's tensorwise
            ao = None if any(i[:2] == ("torchao", base) for i in impls) else torchao_linear(make_linear(m, k, n), base)
            if ao is not None:
                impls.append(("torchao", base, torch.compile(ao)))
            ours = f8.nn.Fp8Linear.from_linear(make_linear(m, k, n), ours_recipe, fsdp_fp8_all_gather=False)
            impls.append(("fp8func", recipe, torch.compile(ours, fullgraph=True)))
        for impl, recipe, module in impls:
            kernels = kernel_times(fwd_bwd(module, x, dy))
            rows.append({"shape": (m, k, n), "impl": impl, "recipe": recipe, "kernels": kernels})
            torch.compiler.reset()
    return rows


def table(rows: list[dict], top: int = 14) -> str:
    out = []
    for r in rows:
        total = sum(us for _, calls, us in r["kernels"] if calls)
        m, k, n = r["shape"]
        out += [f"\n{m}x{k}x{n} {r['impl']} {r['recipe']}: {total:.0f} us of GPU kernels per step",
                "| kernel | calls/step | us/step | share |", "|---|---|---|---|"]
        for name, calls, us in r["kernels"][:-1][:top] + r["kernels"][-1:]:
            out.append(f"| {name[:90]} | {calls:g} | {us:.1f} | {us / total:.0%} |")
    for r, host in zip(rows, HOST_TABLES):
        out += [f"\nhost side of {r['impl']} {r['recipe']} ({STEPS} steps):", host]
    return "\n".join(out)


def run_grouped(tokens: int = 16384) -> list[dict]:
    """The kernels of one grouped fwd+bwd (Qwen3-30B-A3B gate/up projection), bf16 and fp8func."""
    from . import _grouped as g

    m, k, n = tokens * g.TOP_K, g.HIDDEN, g.EXPERT_DIM
    offs = g.group_offsets(m, g.EXPERTS, 0.0, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(g.EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for impl, fn in (("bf16", g.bf16_grouped), ("fp8func", g.fp8_grouped)):
        compiled = torch.compile(fn, fullgraph=True)
        step = g.make_step(lambda x, w, c=compiled: c(x, w, offs), (x, w), dy, ())
        rows.append({"shape": (m, k, n), "impl": impl, "recipe": "grouped rowwise", "kernels": kernel_times(step)})
        torch.compiler.reset()
    return rows


def grouped_gemm_times(tokens: int = 16384, iters: int = 20) -> list[str]:
    """Each GEMM of the grouped fwd+bwd alone (operands cast beforehand): bf16 vs FP8, median ms."""
    from .._grouped import grouped_gemm, quantize_jagged
    from .._ops import quantize
    from .._scaling import Recipe
    from . import _grouped as g
    from ._timing import median_ms

    m, k, n, e = tokens * g.TOP_K, g.HIDDEN, g.EXPERT_DIM, g.EXPERTS
    offs = g.group_offsets(m, e, 0.0, "cuda")
    r = Recipe.from_name("rowwise")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qx, qw, qdy = quantize(x, r.input), quantize(w, r.weight).transpose(1, 2), quantize(dy, r.grad_output)
    qw_n = quantize(w.transpose(1, 2), r.weight_for_grad_input).transpose(1, 2)
    qdy_t, qx_j = quantize_jagged(dy, offs, r.grad_output).t(), quantize_jagged(x, offs, r.input)
    cases = [
        ("forward x @ w.T", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
         lambda: grouped_gemm(qx, qw, offs)),
        ("grad_input dy @ w", lambda: torch._grouped_mm(dy, w, offs=offs), lambda: grouped_gemm(qdy, qw_n, offs)),
        ("grad_weight dy.T @ x", lambda: torch._grouped_mm(dy.t(), x, offs=offs),
         lambda: grouped_gemm(qdy_t, qx_j, offs)),
    ]
    lines = [f"{m}x{k}x{n}, {e} experts", "| GEMM | bf16 ms | fp8 ms (with operand layout copies) | fp8 vs bf16 |",
             "|---|---|---|---|"]
    sa, sb = qx.scale.reshape(-1).contiguous(), qw.scale.expand(e, 1, n).reshape(e, n).contiguous()
    cases.append(("forward, kernel alone, use_fast_accum=True", cases[0][1], lambda: torch._scaled_grouped_mm(
        qx.data, qw.data, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)))
    cases.append(("forward, kernel alone, use_fast_accum=False", cases[0][1], lambda: torch._scaled_grouped_mm(
        qx.data, qw.data, sa, sb, offs=offs, out_dtype=torch.bfloat16)))
    for name, bf16, fp8 in cases:
        b, f = median_ms(bf16, iters=iters), median_ms(fp8, iters=iters)
        lines.append(f"| {name} | {b:.3f} | {f:.3f} | {b / f:.2f}x |")
    return lines
