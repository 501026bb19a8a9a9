"""``python -m fp8func.bench gemm [--iters N] [--json PATH]``: print a markdown table."""

from __future__ import annotations

import argparse
import json

import torch

from . import _gemm
from ._timing import environment


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8func.bench", description=__doc__)
    parser.add_argument("what", choices=["gemm"], help="which benchmark to run")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per case (median reported)")
    parser.add_argument("--json", help="also write rows and environment to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8func.bench needs a CUDA GPU: these are throughput figures, not tests.")
    env = environment()
    rows = _gemm.run(iters=args.iters)
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    print(_gemm.table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
