"""Plot ``NumericsStats.to_json`` output: one heatmap per tensor and metric, layers x recorded steps.

Usage:
    python -m fp8func.stats_plot stats.json out.png [--tensor x|w|dy|all] [--metrics amax,underflow_pct,sqnr_db]

Rows of the figure are the tensors (``x``, ``w``, ``dy``), columns the metrics; in each heatmap a
row is a linear layer (in the order the model ran them) and a column a recorded step. A model of
any depth fits: with many layers the rows are labelled per block (``layers.0``, ``layers.1``, ...)
and blocks are separated by thin lines. Grey cells have no value (not recorded, or an exact cast's
SQNR). Uses matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re

__all__ = ["plot", "main"]

_TENSORS = ("x", "w", "dy")
# metric -> (colorbar label, log colour scale, colormap, least span of the colour scale); bright is
# worse where there is a worse. The least span keeps harmless spreads (0.03% underflow, 0.5 dB of
# SQNR, i.e. a twelfth of a bit) from taking the whole colormap; percentages start at 0.
_METRICS = {
    "amax": ("amax", True, "viridis", 0.0),
    "scale": ("largest scale", True, "viridis", 0.0),
    "underflow_pct": ("underflow, % of nonzero (bright: more)", False, "magma", 1.0),
    "saturation_pct": ("saturation, % (bright: more)", False, "magma", 1.0),
    "top_binade_pct": ("top binade, %", False, "viridis", 1.0),
    "sqnr_db": ("SQNR, dB (bright: lower)", False, "magma_r", 6.0),
}
_DEFAULT_METRICS = ("amax", "underflow_pct", "sqnr_db")
_NAMED_ROWS = 40  # up to this many layers every row is named; beyond, one label per block


def _layers(records: list[dict]) -> list[str]:
    """Layer names in the order they first appear: the forward order of the model."""
    return list(dict.fromkeys(r["layer"] for r in records))


def _grid(records: list[dict], layers: list[str], tensor: str, metric: str) -> tuple[list[int], list[list[float]]]:
    """``(steps, values)``: ``values[i][j]`` is ``metric`` of ``tensor`` for ``layers[i]`` at ``steps[j]``;
    NaN where there is no record or the value is null (an exact cast's SQNR). Several forwards in
    one step: the last one's."""
    recs = [r for r in records if r["tensor"] == tensor]
    steps = sorted({r["step"] for r in recs})
    col, row = {s: j for j, s in enumerate(steps)}, {name: i for i, name in enumerate(layers)}
    values = [[math.nan] * len(steps) for _ in layers]
    for r in recs:
        v = r.get(metric)
        values[row[r["layer"]]][col[r["step"]]] = math.nan if v is None else float(v)
    return steps, values


def _block(name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.3``: the name up to its first numeric part;
    a layer outside any block (``lm_head``) is its own block."""
    m = re.match(r".*?\.\d+(?=\.|$)", name)
    return m.group(0) if m else name


def _blocks(layers: list[str]) -> list[tuple[int, str]]:
    """``(first row, label)`` per run of rows in one block; labels keep the last two parts (``layers.3``)."""
    keys = [_block(name) for name in layers]
    return [(i, ".".join(k.split(".")[-2:])) for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]


def _label_rows(ax, layers: list[str], names: bool) -> None:
    """Names every row (few layers), or labels one row per block and lines the blocks apart."""
    if len(layers) <= _NAMED_ROWS:
        ax.set_yticks(range(len(layers)), layers if names else [], fontsize=6)
        return
    blocks = _blocks(layers)
    for first, _ in blocks[1:]:
        ax.axhline(first - 0.5, color="white", linewidth=0.4, alpha=0.7)
    if not names:
        ax.set_yticks([])
        return
    shown = blocks[::max(1, math.ceil(len(blocks) / _NAMED_ROWS))]
    ax.set_yticks([first for first, _ in shown], [label for _, label in shown], fontsize=6)


def _rows_note(layers: list[str]) -> str:
    """Which row of a block is which layer, when the rows are labelled per block."""
    first = [name for name in layers if _block(name) == _block(layers[0])]
    if len(layers) <= _NAMED_ROWS or len(first) < 2:
        return ""
    return "\nrows of each block, top to bottom: " + ", ".join(n[len(_block(n)) + 1:] for n in first)


def _limits(values, metric: str) -> tuple[float, float, str]:
    """Colour limits: the 1st to 99th percentile, so that a few outlying cells (say ``lm_head``) do
    not flatten the rest (cells beyond take the end colours: arrows on the colorbar), widened to the
    metric's least span."""
    import numpy as np

    if not values.size:
        return 1.0, 10.0, "neither"
    lo, hi = (float(v) for v in np.percentile(values, (1, 99)))
    span = _METRICS[metric][3]
    if metric.endswith("_pct"):
        lo, hi = 0.0, max(hi, span)
    elif hi - lo < span:
        mid = (hi + lo) / 2
        lo, hi = mid - span / 2, mid + span / 2
    if hi <= lo:  # one value everywhere (a log metric): any range around it
        lo, hi = lo / 2, lo * 2
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}
    return lo, hi, extend[(bool(values.min() < lo), bool(values.max() > hi))]


def _heatmap(fig, ax, steps: list[int], values: list[list[float]], metric: str) -> None:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm, Normalize

    label, log, cmap_name, _ = _METRICS[metric]
    data = np.ma.masked_invalid(np.asarray(values, dtype=float))
    if log:
        data = np.ma.masked_less_equal(data, 0.0)  # log scale: a zero amax has no colour
    lo, hi, extend = _limits(data.compressed(), metric)
    norm = LogNorm(lo, hi) if log else Normalize(lo, hi)
    cmap = colormaps[cmap_name].with_extremes(bad="0.8")
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    fig.colorbar(image, ax=ax, label=label, fraction=0.05, pad=0.02, extend=extend)
    ticks = range(0, len(steps), max(1, math.ceil(len(steps) / 8)))
    ax.set_xticks(ticks, [str(steps[j]) for j in ticks], fontsize=7)


def _panel_height(n_layers: int) -> float:
    return min(6.0, max(2.2, 1.0 + 0.04 * n_layers))


def plot(stats_json: str, out_png: str, tensor: str = "all", metrics=_DEFAULT_METRICS) -> int:
    """Writes the PNG: one heatmap per (tensor, metric), layers x steps. Returns the number of layers
    (rows of each heatmap)."""
    if tensor not in _TENSORS + ("all",):
        raise ValueError(f"stats_plot: tensor={tensor!r}; expected one of {_TENSORS + ('all',)}.")
    unknown = [m for m in metrics if m not in _METRICS]
    if unknown or not metrics:
        raise ValueError(f"stats_plot: metrics={list(metrics)!r}; expected one or more of {list(_METRICS)}.")
    with open(stats_json) as f:
        data = json.load(f)
    records = data.get("records") if isinstance(data, dict) else None
    if not records:
        raise ValueError(f"stats_plot: {stats_json} has no records; write it with NumericsStats.to_json after at "
                         "least one recorded step (step 0 is recorded).")
    present = {r["tensor"] for r in records}
    tensors = [t for t in _TENSORS if t in present and tensor in (t, "all")]
    if not tensors:
        raise ValueError(f"stats_plot: no records for tensor={tensor!r} in {stats_json}; try --tensor all.")
    layers = _layers(records)
    _draw(out_png, records, layers, tensors, list(metrics))
    return len(layers)


def _draw(out_png: str, records, layers: list[str], tensors: list[str], metrics: list[str]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height = _panel_height(len(layers))
    fig = Figure(figsize=(1.5 + 4.2 * len(metrics), 0.6 + height * len(tensors)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(tensors), len(metrics), squeeze=False)
    for i, t in enumerate(tensors):
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            steps, values = _grid(records, layers, t, metric)
            _heatmap(fig, ax, steps, values, metric)
            ax.set_title(f"{t}: {metric}", fontsize=9)
            _label_rows(ax, layers, names=j == 0)
            if i == len(tensors) - 1:
                ax.set_xlabel("step")
    fig.suptitle(f"fp8func numerics stats: {len(layers)} layers (rows, in forward order) x recorded steps; "
                 "grey: no value" + _rows_note(layers), fontsize=10)
    fig.savefig(out_png, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fp8func.stats_plot", description=__doc__.splitlines()[0])
    parser.add_argument("stats_json", help="file written by NumericsStats.to_json")
    parser.add_argument("out_png", help="PNG to write")
    parser.add_argument("--tensor", default="all", choices=_TENSORS + ("all",))
    parser.add_argument("--metrics", default=",".join(_DEFAULT_METRICS),
                        help=f"comma-separated, from {', '.join(_METRICS)}")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        parser.exit(1, "python -m fp8func.stats_plot needs matplotlib, which is not installed: pip install "
                       "'fp8func[demo]' (from a clone: pip install -e '.[demo]')\n")
    n = plot(args.stats_json, args.out_png, args.tensor, [m.strip() for m in args.metrics.split(",") if m.strip()])
    print(f"wrote {args.out_png}: {n} layers")


if __name__ == "__main__":
    main()
