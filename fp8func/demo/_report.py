"""The demo's text output: the progress bar, the FP8 check table, the loss table and its verdict."""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = ["RunResult", "progress", "smooth", "rel", "check_table", "loss_table", "smoothing", "gap_pct",
           "noise_envelope", "verdict"]


@dataclass(frozen=True)
class RunResult:
    """One training run of the demo: ``kind`` is ``"bf16"`` or ``"fp8"``; ``losses`` per step."""

    name: str
    kind: str
    seed: int
    losses: tuple[float, ...]
    held_out: float
    seconds: float  # training time of steps 2..n (step 1 warms up and, for fp8, runs under verify)


def progress(items: Iterable, total: int, desc: str, initial: int = 0):
    """``tqdm`` on stderr (a dependency of ``transformers``, which the demo needs), else a one-line bar.

    ``total`` counts ``initial`` items done before ``items``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Bar(items, total, desc, initial)
    return tqdm(items, total=total, desc=desc, initial=initial, dynamic_ncols=True)


class _Bar:
    """One line on stderr, rewritten with ``\\r`` at each percent; a newline at the end."""

    def __init__(self, items: Iterable, total: int, desc: str, initial: int = 0):
        self.items, self.total, self.desc, self.initial, self.postfix = items, total, desc, initial, ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:  # tqdm's signature; drawn per percent
        self.postfix = text

    def __iter__(self) -> Iterator:
        shown, width = -1, 0
        for i, item in enumerate(self.items, self.initial + 1):
            yield item
            if 100 * i // self.total != shown or i == self.total:
                shown = 100 * i // self.total
                line = f"{self.desc} [{'#' * (20 * i // self.total):<20}] {i}/{self.total} {self.postfix}".rstrip()
                sys.stderr.write("\r" + line.ljust(width))  # padded: no tail of a longer line stays
                sys.stderr.flush()
                width = len(line)
        sys.stderr.write("\n")


def smooth(values: Iterable[float], half: int) -> list[float]:
    """Centered moving average over ``2 * half + 1`` steps (fewer at the ends): no lag."""
    values = list(values)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half):i + half + 1]
        out.append(sum(window) / len(window))
    return out


def rel(ref: float, value: float) -> str:
    return f"{100 * (value - ref) / ref:+.2f}%"


def _group(fqn: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``: one row per kind of layer."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", fqn)


def check_table(verification) -> str:
    """``verify``'s rows grouped by kind of layer (layer indices as ``*``): which layers ran FP8.

    A failed layer keeps its own row, under its full name; the summary line closes the table."""
    groups: Counter = Counter()
    for r in verification.rows:
        name = _group(r.fqn) if r.ok else r.fqn
        status = ("ok: " if r.ok else "FAILED: ") + r.note
        groups[(name, "yes" if r.fp8 else "no", r.gemms, status)] += 1
    lines = ["| linear layers | count | FP8 | GEMMs per step (fwd + bwd) | status |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {n} | {fp8} | {gemms} | {status} |" for (name, fp8, gemms, status), n in groups.items()]
    return "\n".join(lines + [verification.summary])


def _rows(runs: list[RunResult], last: int) -> list[tuple[str, list[float]]]:
    n = len(runs[0].losses)
    steps = sorted({1, max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n})
    rows = [(f"step {s}", [r.losses[s - 1] for r in runs]) for s in steps]
    k = min(last, n)
    rows.append((f"final (mean of last {k} steps)", [sum(r.losses[-k:]) / k for r in runs]))
    return rows


def loss_table(runs: list[RunResult], held_tokens: int, last: int = 10) -> str:
    """Markdown table: loss of each run at a few steps, over the last steps and held out; every run's
    gap to the first (the bf16 reference)."""
    ref, others = runs[0], runs[1:]
    head = ["loss (nats/byte)"] + [r.name for r in runs] + [f"{r.name} vs {ref.name}" for r in others]
    rows = _rows(runs, last) + [(f"held-out, {held_tokens:,} tokens", [r.held_out for r in runs])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, values in rows:
        cells = [f"{v:.4f}" for v in values] + [rel(values[0], v) for v in values[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def smoothing(n_steps: int) -> int:
    """Half-width of the moving mean of the loss curves: 1/40 of the run, at least 1 step."""
    return max(1, n_steps // 40)


def gap_pct(ref: RunResult, run: RunResult, half: int) -> list[float]:
    """Per step, ``run``'s smoothed loss relative to ``ref``'s, in percent."""
    return [100 * (v - r) / r for r, v in zip(smooth(ref.losses, half), smooth(run.losses, half))]


def noise_envelope(gaps: list[list[float]], half: int) -> list[float]:
    """Per step, the largest ``|gap|`` over the runs and the ``2 * half + 1`` steps around it.

    Two smoothed loss curves cross now and then, so their gap alone pinches to 0 at each crossing;
    the envelope over a window keeps the band as wide as the noise nearby."""
    if not gaps:
        return []
    peak = [max(abs(g[i]) for g in gaps) for i in range(len(gaps[0]))]
    return [max(peak[max(0, i - half):i + half + 1]) for i in range(len(peak))]


def verdict(runs: list[RunResult]) -> str:
    """One line: over the last quarter of training, the FP8 run's smoothed gap to the bf16 reference
    (``runs[0]``) against the gaps of the bf16 runs with other seeds (the noise band of the PNG)."""
    ref, n = runs[0], len(runs[0].losses)
    half, k = smoothing(n), max(1, n // 4)
    fp8 = next(r for r in runs if r.kind == "fp8")
    gap = gap_pct(ref, fp8, half)[-k:]
    line = (f"last {k} steps (mean of {2 * half + 1}): {fp8.name} vs {ref.name} {sum(gap) / k:+.2f}% on average, "
            f"at most {max(abs(g) for g in gap):.2f}%")
    noise = [r for r in runs[1:] if r.kind == "bf16"]
    if not noise:
        return line + "; no bf16 run with another seed: no noise estimate (--noise-seeds 1 or more)."
    spread = max(abs(g) for r in noise for g in gap_pct(ref, r, half)[-k:])
    judged = "within" if max(abs(g) for g in gap) <= spread else "larger than"
    names = ", ".join(r.name for r in noise)
    return f"{line}; {names} vs {ref.name} at most {spread:.2f}% (run-to-run noise): the FP8 gap is {judged} the noise."
