"""Timing helpers: CUDA events, warm-up, median of many runs."""

from __future__ import annotations

import datetime
import pathlib
import platform
import statistics
import sys
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], *, warmup: int = 10, iters: int = 50) -> float:
    """Median wall time of ``fn`` in milliseconds, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], object], *, warmup: int = 10, iters: int = 50, rounds: int = 3) -> float:
    """Steady-state time per call of ``fn`` in milliseconds: ``iters`` calls back to back between
    two CUDA events, no synchronization in between (the host runs ahead of the GPU, as in
    training), median over ``rounds``. ``median_ms`` synchronizes after every call instead, so
    host time before a call's first kernel shows there as GPU idle time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _program() -> str:
    """How the running command was started, without this machine's paths: ``python -m
    fp8func.bench`` for the bench, else ``python`` and the script's name."""
    script = pathlib.PurePath(sys.argv[0])
    if script.parts[-3:] == ("fp8func", "bench", "__main__.py"):
        return "python -m fp8func.bench"
    return f"python {script.name}"


def environment() -> dict[str, str]:
    """What a reader needs to reproduce a figure: command, device, versions, date."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "command": " ".join([_program()] + sys.argv[1:]),
        "device": device,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
