"""Plot ``NumericsStats.to_json`` output: per-layer amax and underflow over steps, one PNG.

Usage:
    python -m fp8func.stats_plot stats.json out.png [--tensor x|w|dy|all]

Two panels (amax on a log axis, underflow % of the nonzero elements), one line per
(layer, tensor). Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

__all__ = ["plot", "main"]

_TENSORS = ("x", "w", "dy")


def _series(records: list[dict], tensor: str) -> dict[str, tuple[list, list, list]]:
    """``"layer:tensor" -> (steps, amaxes, underflows)``; several forwards in one step: the last."""
    by: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    for r in records:
        if tensor == "all" or r["tensor"] == tensor:
            by[f"{r['layer']}:{r['tensor']}"][r["step"]] = (r["amax"], r["underflow_pct"])
    out = {}
    for name, points in by.items():
        steps = sorted(points)
        out[name] = (steps, [points[s][0] for s in steps], [points[s][1] for s in steps])
    return out


def plot(stats_json: str, out_png: str, tensor: str = "all") -> int:
    """Writes the PNG; returns the number of lines drawn per panel."""
    if tensor not in _TENSORS + ("all",):
        raise ValueError(f"stats_plot: tensor={tensor!r}; expected one of {_TENSORS + ('all',)}.")
    with open(stats_json) as f:
        data = json.load(f)
    records = data.get("records") if isinstance(data, dict) else None
    if not records:
        raise ValueError(f"stats_plot: {stats_json} has no records; write it with NumericsStats.to_json after at "
                         "least one recorded step (step 0 is recorded).")
    series = _series(records, tensor)
    if not series:
        raise ValueError(f"stats_plot: no records for tensor={tensor!r} in {stats_json}; try --tensor all.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_amax, ax_uf) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for name, (steps, amax, uf) in sorted(series.items()):
        ax_amax.plot(steps, amax, marker=".", label=name)
        ax_uf.plot(steps, uf, marker=".", label=name)
    ax_amax.set_yscale("log")
    ax_amax.set_ylabel("amax")
    ax_uf.set_ylabel("underflow (% of nonzero)")
    ax_uf.set_xlabel("step")
    ax_amax.set_title(f"fp8func numerics stats ({tensor})")
    ax_amax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return len(series)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8func.stats_plot", description=__doc__.splitlines()[0])
    parser.add_argument("stats_json", help="file written by NumericsStats.to_json")
    parser.add_argument("out_png", help="PNG to write")
    parser.add_argument("--tensor", default="all", choices=_TENSORS + ("all",))
    args = parser.parse_args(argv)
    n = plot(args.stats_json, args.out_png, args.tensor)
    print(f"wrote {args.out_png}: {n} series")


if __name__ == "__main__":
    main()
