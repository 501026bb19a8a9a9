"""Where the time of one linear fwd+bwd goes: the GPU kernels of bf16, torchao and fp8func, side by side.

``python -m fp8func.bench profile --shapes 16384x4096x4096 --recipes tensorwise`` runs each
implementation compiled (as ``bench linear`` does), then ``torch.profiler`` over a few steps, and
prints per implementation its kernels by total GPU time per step (name, calls per step, us per
step, share). The rows are the evidence for where a gap between implementations comes from.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import fp8func as f8

from ._linear import _fwd_bwd, _linear, torchao_linear

STEPS = 5


def _kernels(step, steps: int = STEPS) -> list[tuple[str, float, float]]:
    """[(kernel name, calls per step, GPU us per step)] of ``step``, largest first."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
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
    return sorted(rows, key=lambda r: -r[2])


def run(shapes=((16384, 4096, 4096),), recipes=("tensorwise",), iters: int = 0) -> list[dict]:
    if "grouped" in recipes:
        return run_grouped()
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        impls = [("bf16", "-", torch.compile(_linear(m, k, n)))]
        for recipe in recipes:
            ao = torchao_linear(_linear(m, k, n), recipe)
            if ao is not None:
                impls.append(("torchao", recipe, torch.compile(ao)))
            ours = f8.nn.Fp8Linear.from_linear(_linear(m, k, n), f8.Recipe.from_name(recipe), fsdp_fp8_all_gather=False)
            impls.append(("fp8func", recipe, torch.compile(ours, fullgraph=True)))
        for impl, recipe, module in impls:
            kernels = _kernels(_fwd_bwd(module, x, dy))
            rows.append({"shape": (m, k, n), "impl": impl, "recipe": recipe, "kernels": kernels})
            torch.compiler.reset()
    return rows


def table(rows: list[dict], top: int = 14) -> str:
    out = []
    for r in rows:
        total = sum(us for _, _, us in r["kernels"])
        m, k, n = r["shape"]
        out += [f"\n{m}x{k}x{n} {r['impl']} {r['recipe']}: {total:.0f} us of GPU kernels per step",
                "| kernel | calls/step | us/step | share |", "|---|---|---|---|"]
        for name, calls, us in r["kernels"][:top]:
            out.append(f"| {name[:90]} | {calls:g} | {us:.1f} | {us / total:.0%} |")
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
    for impl, fn in (("bf16", g._bf16_grouped), ("fp8func", g._fp8_grouped)):
        compiled = torch.compile(fn, fullgraph=True)
        step = g._step(lambda x, w, c=compiled: c(x, w, offs), (x, w), dy, ())
        rows.append({"shape": (m, k, n), "impl": impl, "recipe": "grouped rowwise", "kernels": _kernels(step)})
        torch.compiler.reset()
    return rows
