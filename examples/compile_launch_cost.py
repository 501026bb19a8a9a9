"""The host time of fp8func's kernel launches under ``torch.compile``, and how inductor launches them.

A compiled function casts ``--tensors`` small bf16 tensors (tensorwise, with the transposed copy:
an amax kernel and a cast kernel each), so the GPU finishes each kernel before the host has
launched the next and a call's time is the host's: the compiled wrapper's Python, its buffer
allocations and the launches. Prints whether each of fp8func's kernels is statically launchable
(inductor's static CUDA launcher) or launched through Triton's launcher, and the host time per
call (the fastest of ``--repeats`` runs of ``--calls`` calls) and per launch. Compare the two
launchers in separate processes::

    python examples/compile_launch_cost.py
    TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=0 python examples/compile_launch_cost.py

(fp8func turns the static launcher on unless that variable is set: docs/kernels.md). GPU only.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import fp8func as f8
import fp8func.kernels as fk

ENV_VAR = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def launchers() -> list[tuple[str, bool]]:
    """(kernel name, statically launchable) of each user-defined kernel inductor has loaded."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    found = set()
    for o in gc.get_objects():
        try:
            tuner = isinstance(o, CachingAutotuner)
        except ReferenceError:  # a dead weak proxy
            continue
        if tuner and not o.fn.__name__.startswith("triton_"):
            found.add((o.fn.__name__, o.is_statically_launchable()))
    return sorted(found)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=48, help="tensors cast per call (two launches each)")
    p.add_argument("--shape", default="128x256", help="MxK of each bf16 tensor")
    p.add_argument("--calls", type=int, default=200, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the fastest is reported")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_launch_cost.py times CUDA kernel launches: it needs a GPU.")
    m, k = (int(d) for d in args.shape.split("x"))
    spec = f8.CastSpec(f8.E4M3)
    cast_all = torch.compile(lambda xs: [fk.quantize(x, spec, transpose=True)[0].data for x in xs], fullgraph=True)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.tensors)]
    for _ in range(5):
        cast_all(xs)
    torch.cuda.synchronize()
    runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(args.calls):
            cast_all(xs)
        runs.append((time.perf_counter() - t) / args.calls)
        torch.cuda.synchronize()
    best, launches = min(runs), 2 * args.tensors
    print(f"{ENV_VAR}={os.environ.get(ENV_VAR)}; kernels (name, statically launchable): {launchers()}")
    print(f"host time per call {best * 1e6:.0f} us ({launches} launches): {best * 1e6 / launches:.2f} us per launch; "
          f"runs: {' '.join(f'{r * 1e6:.0f}' for r in runs)} us; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
