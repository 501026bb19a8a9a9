"""The demo's loss-curve PNG: bf16, FP8, and the spread of bf16 runs with other seeds (the noise band)."""

from __future__ import annotations

from ._report import RunResult, gap_pct, noise_envelope, smooth, smoothing

__all__ = ["caption", "figure", "plot"]

_FP8, _BF16 = "tab:orange", "tab:blue"


def _loss_panel(ax, runs: list[RunResult], half: int) -> None:
    steps = range(1, len(runs[0].losses) + 1)
    bf16 = [r for r in runs if r.kind == "bf16"]
    fp8 = next(r for r in runs if r.kind == "fp8")
    curves = [smooth(r.losses, half) for r in bf16]
    if len(curves) > 1:
        low = [min(c[i] for c in curves) for i in range(len(steps))]
        high = [max(c[i] for c in curves) for i in range(len(steps))]
        ax.fill_between(steps, low, high, color=_BF16, alpha=0.25, linewidth=0,
                        label=f"bf16 seed spread (seeds {', '.join(str(r.seed) for r in bf16)})")
    for r in (bf16[0], fp8):
        color = _FP8 if r.kind == "fp8" else _BF16
        ax.plot(steps, r.losses, color=color, alpha=0.18, linewidth=0.7)
    ax.plot(steps, curves[0], color=_BF16, linewidth=2.2, label=f"{bf16[0].name} (seed {bf16[0].seed})")
    ax.plot(steps, smooth(fp8.losses, half), color=_FP8, linewidth=1.8, linestyle=(0, (4, 2)), zorder=3,
            label=f"{fp8.name} (seed {fp8.seed}, same init and batches as bf16)")
    warm = max(1, len(steps) // 20)  # after the first 5% of steps: the panel shows the curves, not the drop
    top = max(max(c[warm:] or c) for c in curves + [smooth(fp8.losses, half)])
    bottom = min(min(c) for c in curves + [smooth(fp8.losses, half)])
    ax.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
    ax.set_ylabel(f"training loss (nats/byte)\nmean of {2 * half + 1} steps; faint: per step")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)


def _gap_panel(ax, runs: list[RunResult], half: int) -> None:
    ref = runs[0]
    steps = range(1, len(ref.losses) + 1)
    noise = [r for r in runs[1:] if r.kind == "bf16"]
    gaps = [gap_pct(ref, r, half) for r in noise]
    if noise:
        band = noise_envelope(gaps, half)
        ax.fill_between(steps, [-b for b in band], band, color=_BF16, alpha=0.25, linewidth=0,
                        label=f"noise: largest gap of a bf16 run with another seed, over {2 * half + 1} steps")
        for r, gap in zip(noise, gaps):
            ax.plot(steps, gap, color=_BF16, linewidth=0.8, alpha=0.8, label=f"{r.name} gap")
    fp8 = next(r for r in runs if r.kind == "fp8")
    ax.plot(steps, gap_pct(ref, fp8, half), color=_FP8, linewidth=1.8, label=f"{fp8.name} gap")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylabel(f"gap to {ref.name}, seed {ref.seed}\n(%, smoothed)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)


def figure(runs: list[RunResult], title: str):
    """The loss curves with the bf16 seed band, and each run's gap to the first run (``runs[0]``,
    the bf16 reference) against the band: a matplotlib ``Figure`` on an Agg canvas (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    half = smoothing(len(runs[0].losses))
    _loss_panel(top, runs, half)
    _gap_panel(bottom, runs, half)
    top.set_title(title, fontsize=9)
    fig.supxlabel(caption(runs), fontsize=8)
    return fig


def caption(runs: list[RunResult]) -> str:
    """How to read the figure: the noise band where bf16 runs with other seeds drew one, else what is drawn."""
    if any(r.kind == "bf16" for r in runs[1:]):
        return ("How to read it: the blue band is how much two bf16 runs differ when only the seed of the init "
                "changes.\nThe FP8 gap matters where the orange curve leaves the band; inside it, FP8 is as close "
                "to bf16 as another seed is.")
    return ("How to read it: orange is FP8, blue bf16, from the same init and batches; below, FP8's gap to bf16.\n"
            "No bf16 run with another seed (--noise-seeds 0), so no noise band: nothing says how large a gap "
            "two bf16 runs would show.")


def plot(path: str, runs: list[RunResult], title: str) -> None:
    """Writes ``figure(runs, title)`` to ``path`` (PNG)."""
    figure(runs, title).savefig(path, dpi=110)
