"""Launch-config sweep of the Triton kernels of ``fp8func.kernels`` (GPU only).

``python -m fp8func.bench sweep [--routes a,b] [--iters N] [--json PATH]``: for each route of
``fp8func.kernels._configs.CONFIGS`` runs the candidates below (through ``override``) on bf16
inputs, checks each one bitwise against the twin, times it (median of CUDA-graph replays over
inputs that span more than the L2) and prints the winner. A winner becomes the route's entry in
``CONFIGS`` by hand; docs/kernels.md records the configurations and the run that chose them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import fp8func as f8
import fp8func.kernels as fk
from fp8func.kernels._configs import CONFIGS, Config, override

from ._quant import copy_gbps, graph_ms, min_bytes

C = Config
TW = f8.CastSpec(f8.E4M3)
ROW = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True)
B1 = f8.CastSpec(f8.E4M3, f8.BlockWise((1, 128)))
B128 = f8.CastSpec(f8.E4M3, f8.BlockWise((128, 128)))
TILES = [(32, 256, 8), (16, 512, 8), (64, 256, 8), (8, 1024, 8), (32, 128, 4), (64, 128, 8)]
TILES_T = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 64, 8), (128, 128, 4), (64, 256, 8)]
# the +T block kernels: the 128x128 tile walked in [128, bk] slabs, unrolled (0) or as loops
SLABS = [C(128, bk, w, unroll=u) for bk in (16, 32, 64) for w in (2, 4, 8) for u in (0, 1, 2) if bk * u < 128]
# the transposing routes again with the transposed copy made from the raw (bf16) tile (Config.raw_t)
RAW = lambda cands: cands + [dataclasses.replace(c, raw_t=True) for c in cands]  # noqa: E731
CANDIDATES: dict[str, list[Config]] = {
    "amax_flat": [C(1, bk, w, st) for bk, w in [(4096, 4), (8192, 8), (16384, 16), (16384, 8), (8192, 2), (16384, 4)]
                  for st in (1, 3)],
    "amax_2d": [C(bm, bk, w, st) for bm, bk, w in [(32, 256, 8), (64, 128, 8), (16, 512, 8), (32, 128, 4),
                                                    (64, 256, 8), (8, 1024, 4), (16, 1024, 8), (8, 2048, 8),
                                                    (4, 4096, 8), (16, 2048, 16)]
                for st in (1, 3)],
    "cast": [C(bm, bk, w) for bm, bk, w in TILES],
    "cast_t": RAW([C(bm, bk, w) for bm, bk, w in TILES_T]),
    "cast_amax": [C(bm, bk, w) for bm, bk, w in TILES],
    "cast_amax_t": RAW([C(bm, bk, w) for bm, bk, w in TILES_T + [(32, 128, 4), (64, 128, 8), (128, 256, 8)]]),
    "cast_block": [C(bm, 128, w) for bm in (16, 32, 64) for w in (4, 8)],
    "cast_block_t": RAW([C(bm, bk, w) for bm, bk, w in [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 128, 8),
                                                        (128, 64, 4), (64, 64, 4)]]),
    "rowwise": [C(bm, 0, w) for bm in (4096, 8192, 16384) for w in (4, 8, 16)],
    "block_1x128": [C(bm, 128, w) for bm in (16, 32, 64) for w in (4, 8)],
    "block_1x128_t": RAW(SLABS),
    "block_128": [C(128, 128, w) for w in (4, 8, 16)],
    "block_128_t": RAW(SLABS),
}
# route: (spec, op, transpose); "amax_2d" is timed inside rowwise+T (its only fused user).
CALLS = {
    "amax_flat": (TW, "amax", False), "amax_2d": (ROW, "quantize", True), "cast": (TW, "cast", False),
    "cast_t": (TW, "cast", True), "cast_amax": (TW, "cast_amax", False), "cast_amax_t": (TW, "cast_amax", True),
    "cast_block": (B1, "cast", False), "cast_block_t": (B1, "cast", True),
    "rowwise": (ROW, "quantize", False), "block_1x128": (B1, "quantize", False),
    "block_1x128_t": (B1, "quantize", True), "block_128": (B128, "quantize", False),
    "block_128_t": (B128, "quantize", True),
}
SHAPES = {"rowwise": [(16384, 4096), (16384, 14336)]}
DEFAULT_SHAPES = [(16384, 4096)]


def _call(spec, op, transpose, impl):
    def fn(x, s, s_t):
        if op == "amax":
            return fk.amax(x, spec.granularity, impl=impl)
        if op == "cast":
            return fk.cast(x, s, spec, transpose=transpose, scale_t=s_t, impl=impl)
        if op == "cast_amax":
            return fk.cast_amax(x, s, spec, transpose=transpose, impl=impl)
        return fk.quantize(x, spec, transpose=transpose, impl=impl)
    return fn


def _same(a, b) -> bool:
    flat = lambda o: [t for t in (o if isinstance(o, tuple) else (o,)) if t is not None]  # noqa: E731
    ta = [t for q in flat(a) for t in ((q.data, q.scale) if isinstance(q, f8.Fp8Tensor) else (q,))]
    tb = [t for q in flat(b) for t in ((q.data, q.scale) if isinstance(q, f8.Fp8Tensor) else (q,))]
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in zip(ta, tb)) and len(ta) == len(tb)


def _row(r: dict) -> str:
    c = r["config"]
    return (f"| {r['route']} | {r['shape'][0]}x{r['shape'][1]} | bm={c['bm']} bk={c['bk']} w={c['warps']} "
            f"st={c['stages']} u={c['unroll']} r={int(c['raw_t'])} | {r['bitwise']} | {r['ms']:.4f} | "
            f"{r['gbps']:.0f} |")


def sweep(iters: int = 30, routes=None) -> list[dict]:
    rows = []
    for route, cands in CANDIDATES.items():
        if routes and route not in routes:
            continue
        spec, op, transpose = CALLS[route]
        for shape in SHAPES.get(route, DEFAULT_SHAPES):
            xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            xs[0][5, 7] = 3e4  # an outlier, so groups differ
            args = []
            for x in xs:
                q, q_t = fk.quantize(x, spec, transpose=transpose, impl="reference")
                args.append((x, q.scale / 3, None if q_t is None else q_t.scale / 3))
            want = _call(spec, op, transpose, "reference")(*args[0])
            nbytes = min_bytes(spec, op, transpose, shape, 2)
            for cfg in cands:
                fn = _call(spec, op, transpose, "triton")
                try:
                    with override(route, cfg):
                        ok = _same(fn(*args[0]), want)
                        ms = graph_ms(fn, args, iters) if ok else float("nan")
                except Exception as e:  # a config the compiler rejects (e.g. out of resources)
                    ok, ms = False, float("nan")
                    print(f"{route} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                rows.append({"route": route, "shape": shape, "config": dataclasses.asdict(cfg), "bitwise": ok,
                             "ms": ms, "gbps": nbytes / ms / 1e6})
                print(_row(rows[-1]), flush=True)
            del xs, args
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8func.bench sweep", description=__doc__)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("--routes", help=f"comma list of routes to sweep (default all: {','.join(CANDIDATES)})")
    args = parser.parse_args(argv)
    routes = args.routes.split(",") if args.routes else None
    if routes and not set(routes) <= set(CANDIDATES):
        parser.error(f"--routes {args.routes}: unknown {sorted(set(routes) - set(CANDIDATES))}; "
                     f"known: {list(CANDIDATES)}")
    copy = copy_gbps(args.iters)
    print(f"copy {copy:.0f} GB/s\n| route | shape | config | bitwise | ms | GB/s |\n|---|---|---|---|---|---|")
    rows = sweep(args.iters, routes)
    print(f"copy {copy:.0f} GB/s")
    print("winners (sum of ms over shapes):")
    for route in routes or CANDIDATES:
        per = {}
        for r in rows:
            if r["route"] == route and r["bitwise"]:
                key = json.dumps(r["config"])
                per[key] = per.get(key, 0.0) + r["ms"]
        best = min(per, key=per.get) if per else None
        print(f"  {route}: {best} ({per.get(best, float('nan')):.4f} ms); CONFIGS has {CONFIGS[route]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
