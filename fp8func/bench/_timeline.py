"""Host against GPU through a training step of a decoder stack, read without a profiler.

``python -m fp8func.bench model --timeline``: six synchronized steps per configuration, with a CUDA
event and a host clock reading at each decoder layer's forward (a wrapper module around the
layer), before the final norm, at each layer's backward (a hook on the layer's output) and at
the step's end. The GPU time of a mark is when the GPU reached it. Over the layers' forward (and
their backward) the host and the GPU each take some time; where the GPU's is no longer than the
host's and the GPU stays close behind the host (its lag at the phase's end, ms: what is queued
for it), the GPU waited for the host: the host bounds that phase, and faster kernels would not
shorten it. torch.profiler adds host time to every op it records, so it makes steps look more
host-bound than they are; events do not.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

STEPS = 6


class _Marks:
    """(name, host s, CUDA event) in the order the host makes them."""

    def __init__(self):
        self.rows: list[tuple[str, float, torch.cuda.Event]] = []

    def add(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.rows.append((name, time.perf_counter(), event))

    def read(self) -> list[tuple[str, float, float]]:
        """(name, host ms, GPU ms) since the first mark; call after synchronizing."""
        _, h0, e0 = self.rows[0]
        return [(name, (h - h0) * 1e3, e0.elapsed_time(e)) for name, h, e in self.rows]


class _Marked(nn.Module):
    """A decoder layer that marks its forward's start, and its backward's (a hook on its output)."""

    def __init__(self, layer: nn.Module, index: int, marks: _Marks):
        super().__init__()
        self.layer, self.index, self.marks = layer, index, marks

    def forward(self, hidden_states, *args, **kwargs):
        self.marks.add(f"f{self.index}")
        out = self.layer(hidden_states, *args, **kwargs)
        t = out[0] if isinstance(out, tuple) else out
        if t.requires_grad:
            t.register_hook(lambda _grad: self.marks.add(f"b{self.index}"))
        return out


def summarize(marks: list[tuple[str, float, float]]) -> dict:
    """Per phase of ``marks`` ((name, host ms, GPU ms) of one step, in host order: ``start``,
    ``f0``..``f{L-1}``, ``norm``, ``b{L-1}``..``b0``, ``end``): the layers' forward (``f0`` to
    ``norm``) and backward (``b{L-1}`` to ``b0``), the host and GPU ms each took and how far the
    GPU was behind the host at the phase's end; the GPU ms before the first layer and of the step."""
    at = {name: (h, g) for name, h, g in marks}
    n = sum(name.startswith("f") for name in at)

    def phase(first: str, last: str) -> dict:
        return {"host_ms": at[last][0] - at[first][0], "gpu_ms": at[last][1] - at[first][1],
                "lag_ms": at[last][1] - at[last][0]}

    return {"forward": phase("f0", "norm"), "backward": phase(f"b{n - 1}", "b0"),
            "first_layer_gpu_ms": at["f0"][1], "step_gpu_ms": at["end"][1]}


def timeline(model: nn.Module, step, steps: int = STEPS) -> dict:
    """``summarize`` of ``step`` (a training step of HF causal LM ``model``), the median of each
    figure over ``steps`` synchronized steps; the model is left as it was."""
    layers, marks = model.model.layers, _Marks()
    model.model.layers = nn.ModuleList(_Marked(layer, i, marks) for i, layer in enumerate(layers))
    hook = model.model.norm.register_forward_pre_hook(lambda _module, _args: marks.add("norm"))
    runs = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            marks.rows.clear()
            marks.add("start")
            step()
            marks.add("end")
            torch.cuda.synchronize()
            runs.append(summarize(marks.read()))
    finally:
        model.model.layers = layers
        hook.remove()
    return _median(runs)


def _median(runs: list[dict]) -> dict:
    first = runs[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in runs]) for k in first}
    return statistics.median(runs)


def table(rows: list[dict]) -> list[str]:
    """The ``--timeline`` table of the rows that have one."""
    lines = ["", f"Host against GPU per step (CUDA events, median of {STEPS} synchronized steps): the ms the decoder "
             "layers took on the host and on the GPU, and how far the GPU was behind the host at the end (GPU ms "
             "no longer than host ms, and a small lag: the GPU waited for the host):", "",
             "| config | forward host / GPU ms | GPU behind at the forward's end, ms | backward host / GPU ms | "
             "GPU behind at the backward's end, ms | GPU ms before layer 0 | step GPU ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.get("timeline")
        if t:
            f, b = t["forward"], t["backward"]
            lines.append(f"| {r['config']} | {f['host_ms']:.1f} / {f['gpu_ms']:.1f} | {f['lag_ms']:.1f} | "
                         f"{b['host_ms']:.1f} / {b['gpu_ms']:.1f} | {b['lag_ms']:.1f} | "
                         f"{t['first_layer_gpu_ms']:.1f} | {t['step_gpu_ms']:.1f} |")
    return lines


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def gpu_waits(events: list[dict], steps: int) -> dict:
    """Where one rank's GPU stood idle, from a CUDA + CPU ``torch.profiler`` trace (the
    ``traceEvents`` of ``export_chrome_trace``) of ``steps`` steps, in ms per step.

    Between two consecutive compute kernels (every kernel but NCCL's) the GPU idles; the part of
    that gap before the host's launch call of the second kernel returned is waiting for the host,
    the rest waiting for something the kernel depends on (on a rank of an FSDP2 step: a
    collective, hence the other rank). NCCL kernels are counted apart (their time includes their
    wait for the peer). ``host_sync_ms``: the host's time in CUDA calls that wait for the GPU
    (stream, event and device synchronizations, and copies to the host), where the host waited
    for the GPU instead of launching. A trace with no kernel raises."""
    spans = [e for e in events if e.get("ph") == "X"]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if not kernels:
        raise ValueError("gpu_waits: the trace holds no CUDA kernel; profile with ProfilerActivity.CUDA on a GPU.")
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    compute = sorted((k for k in kernels if "nccl" not in k["name"].lower()), key=lambda k: k["ts"])
    host = dependency = 0.0
    end = None
    for k in compute:
        if end is not None and k["ts"] > end:
            launch = launches.get(k.get("args", {}).get("correlation"))
            launched = launch["ts"] + launch["dur"] if launch is not None else end
            waited_host = min(max(launched - end, 0.0), k["ts"] - end)
            host += waited_host
            dependency += k["ts"] - end - waited_host
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    first, last = compute[0]["ts"], end
    compute_spans = [(k["ts"], k["ts"] + k["dur"]) for k in compute]
    nccl_spans = [(k["ts"], k["ts"] + k["dur"]) for k in nccl]
    compute_busy = _busy_us(compute_spans)
    return {"compute_kernels": len(compute) / steps,
            "compute_busy_ms": compute_busy / 1e3 / steps,
            "nccl_busy_ms": _busy_us(nccl_spans) / 1e3 / steps,
            # NCCL time with no compute kernel running beside it: communication the step waits for
            "nccl_exposed_ms": (_busy_us(compute_spans + nccl_spans) - compute_busy) / 1e3 / steps,
            "idle_host_ms": host / 1e3 / steps, "idle_dependency_ms": dependency / 1e3 / steps,
            "host_sync_ms": sum(e["dur"] for e in spans if _waits_for_gpu(e)) / 1e3 / steps,
            "span_ms": (last - first) / 1e3 / steps}


def _waits_for_gpu(event: dict) -> bool:
    """A CUDA runtime / driver call of the trace in which the host waits for the GPU."""
    if event.get("cat") not in ("cuda_runtime", "cuda_driver"):
        return False
    name = event["name"]  # a copy to the host (``.item()``) is an async copy and a stream synchronization
    return "Synchronize" in name or (name.startswith(("cudaMemcpy", "cuMemcpy")) and "Async" not in name)


NCCL_KINDS = ("allgather", "allreduce", "reducescatter", "broadcast", "sendrecv")


def step_profile(prof, steps: int) -> dict:
    """GPU ms and kernels per step by class, and where the GPU stood idle, from a finished
    CPU + CUDA ``torch.profiler.profile`` of ``steps`` training steps.

    ``"classes"``: {class: (ms, calls)} per step; the classes of ``_model.kernel_class`` (GEMM fp8 /
    bf16, attention, fp8func casts, inductor's fused Triton kernels, optimizer, other) and NCCL
    kernels by collective ("NCCL allgather", ...). ``"waits"``: ``gpu_waits`` of the trace (compute
    busy, NCCL busy and exposed, idle waiting for the host or for a dependency). ``"symm_mem_ops"``:
    host calls per step of ``symm_mem`` ops (async TP's fused all-gather / reduce-scatter matmuls).
    ``"top_kernels"``: per class its largest kernels (name, ms and calls per step); ``"host_ops"``:
    the ops and annotated regions with the most host (self CPU) time, ms and calls per step."""
    import json
    import os
    import tempfile

    from ._model import kernel_class

    kernels: dict[tuple[str, str], list[float]] = {}  # (class, kernel name) -> [ms, calls] per step
    symm = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            symm += "symm_mem" in e.name
            continue
        name = e.name.lower()
        kind = next((f"NCCL {k}" for k in NCCL_KINDS if "nccl" in name and k in name.replace("_", "")), None)
        kind = kind or ("NCCL other" if "nccl" in name else kernel_class(e.name))
        k = kernels.setdefault((kind, e.name[:160]), [0.0, 0.0])
        k[0] += e.device_time / 1e3 / steps
        k[1] += 1 / steps
    classes: dict[str, tuple[float, float]] = {}
    top = {}  # the largest kernels of each class, to check what a class holds
    for (kind, name), (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        total_ms, total_calls = classes.get(kind, (0.0, 0.0))
        classes[kind] = (total_ms + ms, total_calls + calls)
        if len(top.setdefault(kind, [])) < 6:
            top[kind].append((name, round(ms, 2), calls))
    host = [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 2), e.count / steps)
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            waits = gpu_waits(json.load(fh)["traceEvents"], steps)
    return {"classes": classes, "waits": waits, "symm_mem_ops": symm / steps, "top_kernels": top,
            "host_ops": host}
