"""``python -m fp8func.bench {all,gemm,quantize,linear,block,auto,calibrate,grouped,memory,profile}
[--iters N] [--json PATH]``: print a markdown table.

``python -m fp8func.bench {model,fsdp} [options]``: whole-model training steps; each takes its own
options (``python -m fp8func.bench model --help``) and runs on the CPU too (tiny shapes, for tests).

``python -m fp8func.bench sweep [options]``: the launch-config sweep of ``fp8func.kernels`` (GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import _all, _auto, _block, _calibrate, _gemm, _grouped, _linear, _memory, _profile, _quant
from ._timing import environment

ENTRIES = ("model", "fsdp", "sweep")  # entries with options of their own


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ENTRIES:
        from . import _fsdp, _model, _sweep

        {"model": _model, "fsdp": _fsdp, "sweep": _sweep}[argv[0]].main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m fp8func.bench", description=__doc__)
    parser.add_argument("what", choices=["all", "gemm", "quantize", "linear", "block", "auto", "calibrate", "grouped",
                                         "memory", "profile", *ENTRIES],
                        help="which benchmark to run (all: linear, quantize and block in one process; model, fsdp, "
                             "sweep: see their own --help)")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per case (median reported)")
    parser.add_argument("--json", help="also write rows and environment to this JSON file")
    parser.add_argument("--shapes", help="quantize: MxK[,...]; all / linear / auto / profile: MxKxN[,...] instead of "
                        "the default shapes")
    parser.add_argument("--recipes", help="all / linear / block / auto / memory / profile: comma list of recipes "
                        "(default tensorwise,rowwise,blockwise,delayed; all: tensorwise,rowwise,blockwise; memory: "
                        "tensorwise,rowwise; profile: tensorwise). "
                        "'delayed' is compared with torchao's dynamic tensorwise; '<recipe>+fastfwd' runs the "
                        "output GEMM with fast accumulation as torchao does")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8func.bench needs a CUDA GPU: these are throughput figures, not tests.")
    env = environment()
    bench = {"all": _all, "gemm": _gemm, "quantize": _quant, "linear": _linear, "block": _block, "auto": _auto,
             "calibrate": _calibrate, "grouped": _grouped, "memory": _memory, "profile": _profile}[args.what]
    if args.shapes and args.what not in ("all", "quantize", "linear", "auto", "profile"):
        parser.error("--shapes applies to the all, quantize, linear, auto and profile benchmarks only")
    kwargs = {"shapes": [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]} if args.shapes else {}
    if args.recipes:
        kwargs["recipes"] = tuple(args.recipes.split(","))
    rows = bench.run(iters=args.iters, **kwargs)
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    print(bench.table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
