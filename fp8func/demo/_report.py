"""The demo's outputs: a progress bar, the loss table, the loss-curve PNG."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator


def progress(items: Iterable, total: int, desc: str):
    """``tqdm`` when it is installed, else a bar of plain lines on stderr (every 10%)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(items, total, desc)
    return tqdm(items, total=total, desc=desc, dynamic_ncols=True)


class _Lines:
    def __init__(self, items: Iterable, total: int, desc: str):
        self.items, self.total, self.desc, self.postfix = items, total, desc, ""

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def __iter__(self) -> Iterator:
        every = max(1, self.total // 10)
        for i, item in enumerate(self.items, 1):
            yield item
            if i % every == 0 or i == self.total:
                bar = "#" * (20 * i // self.total)
                print(f"{self.desc} [{bar:<20}] {i}/{self.total} {self.postfix}".rstrip(), file=sys.stderr, flush=True)


def smooth(values: list[float], half: int) -> list[float]:
    """Centered moving average over ``2 * half + 1`` steps (fewer at the ends): no lag."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half):i + half + 1]
        out.append(sum(window) / len(window))
    return out


def rel(hp: float, lp: float) -> str:
    return f"{100 * (lp - hp) / hp:+.2f}%"


def loss_table(bf16: list[float], fp8: list[float], held_out: tuple[float, float], held_tokens: int,
               last: int = 10) -> str:
    """Markdown table: loss at a few steps, the mean of the last steps, held-out loss; relative gap."""
    n = len(bf16)
    steps = sorted({1, max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n})
    rows = [(f"step {s}", bf16[s - 1], fp8[s - 1]) for s in steps]
    k = min(last, n)
    rows.append((f"final (mean of last {k})", sum(bf16[-k:]) / k, sum(fp8[-k:]) / k))
    rows.append((f"held-out, {held_tokens:,} tokens (after training)", *held_out))
    lines = ["| | bf16 loss | fp8 loss | fp8 vs bf16 |", "|---|---|---|---|"]
    lines += [f"| {name} | {a:.4f} | {b:.4f} | {rel(a, b)} |" for name, a, b in rows]
    return "\n".join(lines)


def plot(path: str, bf16: list[float], fp8: list[float], title: str) -> None:
    """Loss curves (raw and smoothed) and the smoothed relative gap; Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    steps, half = range(1, len(bf16) + 1), max(1, len(bf16) // 40)
    for name, losses, color in (("bf16", bf16, "tab:blue"), ("fp8", fp8, "tab:orange")):
        top.plot(steps, losses, color=color, alpha=0.3, linewidth=0.8)
        top.plot(steps, smooth(losses, half), color=color, label=f"{name} (mean of {2 * half + 1} steps)")
    top.set_ylabel("training loss (nats/byte)")
    top.set_title(title, fontsize=9)
    top.legend()
    top.grid(alpha=0.3)
    gap = smooth([100 * (b - a) / a for a, b in zip(bf16, fp8)], half)
    bottom.plot(steps, gap, color="tab:green")
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel("fp8 - bf16 (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
