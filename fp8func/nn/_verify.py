"""``verify(model, step_fn)``: profile one training step and say, per linear layer, whether FP8 GEMMs ran.

How the profile is attributed to layers (eager autograd; the step runs with
``torch.compiler.set_stance("force_eager")``, so a compiled model is checked on the same GEMM paths):

* forward: a forward pre-hook and hook on every ``nn.Linear`` open and close
  ``torch.profiler.record_function(f"fp8func::{fqn}")``; the ops inside the range are the layer's.
* backward: module hooks do not bracket the backward (full backward hooks would wrap the layer's
  outputs in extra autograd nodes, which breaks in-place ops on them). The profiler links the two
  passes itself: a forward op that records an autograd node carries ``(thread, sequence_nr)``, and
  the backward's ``autograd::engine::evaluate_function: <Node>`` event carries the same
  ``(fwd_thread, sequence_nr)``.
* which path each FP8 GEMM took, read from the profile alone (``record_shapes``): an
  ``aten::_scaled_mm`` (``_scaled_mm_v2``, ``fp8func::blockwise_scaled_mm``) is a hardware FP8
  GEMM, its kind read from its scale shapes (one scale: tensorwise; one per row: row-wise), and its
  CUDA kernels are listed; a high-precision GEMM (``aten::mm`` and the like) whose two operands
  were just converted from FP8 dtypes (two ``aten::_to_copy`` from ``Float8_*`` before it) is the
  emulated path. Nothing in fp8func is patched to observe it.
* FSDP2: the fp8 weight types report each pre-all-gather to ``observe_all_gathers`` observers;
  ``verify`` registers one for the step, counting, per layer, the uint8 payloads FSDP2 all-gathers.

The observer and the hooks are removed when ``verify`` returns.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from ._convert import canonical_fqn, hp_reason, planned
from ._linear import Fp8Linear
from ._weights import observe_all_gathers, weight_kind

__all__ = ["verify", "Verification", "LayerCheck"]

log = logging.getLogger("fp8func")
_RANGE = "fp8func::layer::"
_EVAL = "autograd::engine::evaluate_function: "
_HP_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
# libkineto's levels run VERBOSE=0 .. ERROR=4, USDT=5; a threshold above them all prints nothing.
_KINETO_SILENT = "6"


@dataclass(frozen=True)
class LayerCheck:
    """One linear layer in the verified step.

    Attributes:
        fqn: its name in the model.
        fp8: FP8 was requested for it (an ``Fp8Linear``, or a layer ``convert`` converted).
        ok: FP8 layers: FP8 GEMMs ran as expected. High-precision layers: always True.
        gemms: the GEMM paths taken, forward and backward, e.g. ``"emulated x3"``.
        scaled_mm: ``aten::_scaled_mm`` ops the profiler saw in the layer's forward and backward.
        all_gather: FSDP2: ``"fp8 x<n>, <bytes>"``, ``"high precision"``, or ``"-"`` (not sharded).
        note: what ran, or what went wrong and how to fix it.
    """

    fqn: str
    fp8: bool
    ok: bool
    gemms: str
    scaled_mm: int
    all_gather: str
    note: str


@dataclass(frozen=True)
class Verification:
    """What ``verify`` found: ``ok`` and one ``LayerCheck`` per linear layer; prints as a table."""

    ok: bool
    rows: tuple[LayerCheck, ...]
    device: str
    summary: str
    kernels: tuple[tuple[str, int], ...] = ()
    fp8_all_gathers: int = 0
    output: Any = field(default=None, repr=False, compare=False)

    @property
    def failures(self) -> tuple[LayerCheck, ...]:
        return tuple(r for r in self.rows if not r.ok)

    def __str__(self) -> str:
        head = ("layer", "fp8", "GEMMs (fwd+bwd)", "aten::_scaled_mm", "FSDP2 all-gather", "status")
        rows = [head] + [(r.fqn, "yes" if r.fp8 else "no", r.gemms, str(r.scaled_mm), r.all_gather,
                          ("ok: " if r.ok else "FAILED: ") + r.note) for r in self.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"CUDA kernel under aten::_scaled_mm: {name} (x{n})" for name, n in self.kernels]
        return "\n".join(lines + [self.summary])


@dataclass
class _Tally:
    calls: int = 0
    paths: Counter = field(default_factory=Counter)
    scaled_mm: int = 0
    hp_gemms: int = 0
    backward: int = 0
    kernels: Counter = field(default_factory=Counter)
    gathers: list = field(default_factory=list)  # (fp8 bytes, high-precision bytes) per all-gather


def verify(model: nn.Module, step_fn: Callable[[], Any], *, strict: bool = False,
           print_table: bool = True) -> Verification:
    """Runs ``step_fn()`` (forward + backward of ``model``) once under ``torch.profiler`` and checks,
    per linear layer, that the FP8 GEMMs ran: ``aten::_scaled_mm`` on a GPU, the emulated GEMM
    (``gemm_path(...) == "emulated"``) on the CPU; under FSDP2, that the weights were all-gathered
    in FP8. A layer that ``convert`` put in FP8 but that ran in high precision (replaced later,
    a recipe forced to ``path="emulated"`` on a GPU, a forward that never ran) fails, by name.

    Returns a ``Verification`` (``.ok``, ``.rows``, ``.output`` = what ``step_fn`` returned) and
    prints it; ``strict=True`` raises ``RuntimeError`` instead of returning a failed one.

    Example:
        >>> def step():
        ...     loss = model(ids, labels=ids).loss
        ...     loss.backward()
        ...     return loss
        >>> fp8func.verify(model, step, strict=True)
    """
    if not callable(step_fn):
        raise TypeError(f"verify: step_fn={step_fn!r}; expected a callable that runs forward + backward of the model.")
    linears = {canonical_fqn(fqn): m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    tallies = {fqn: _Tally() for fqn in linears}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        _install_ranges(stack, linears)
        stack.enter_context(_all_gather_counter(model, tallies))
        # acc_events: one cycle anyway; torch 2.11 warns about clearing events between cycles without it
        with _kineto_quiet_at_start():
            prof = stack.enter_context(profile(activities=activities, record_shapes=True, acc_events=True))
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        output = step_fn()
    _attribute(prof.events(), tallies)
    result = _judge(model, linears, tallies, output)
    if print_table:
        print(result)
    if not result.ok:
        log.error("fp8func: %s", result.summary)
        if strict:
            raise RuntimeError(f"fp8func.verify: {result.summary}")
    return result


@contextlib.contextmanager
def _kineto_quiet_at_start():
    """Keeps libkineto, torch.profiler's C++ backend, from writing to stderr during ``verify``.

    libkineto reads ``KINETO_LOG_LEVEL`` once, when the first profiler of the process starts. With
    the variable unset, torch sets the threshold to ERROR, and the "USDT" level above it writes a
    "profiler_start" and a "profiler_stop" line to stderr each time a profiler starts and stops.
    The variable is set above every kineto level for that start alone and removed again: the
    environment is left as it was, and a value the user set is kept.
    """
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = _KINETO_SILENT
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def _install_ranges(stack: contextlib.ExitStack, linears: dict[str, nn.Module]) -> None:
    """Forward hooks that bracket each linear layer's forward in a named profiler range."""
    open_ranges: list[record_function] = []

    def enter(fqn, module, args):
        open_ranges.append(record_function(_RANGE + fqn).__enter__())

    def leave(fqn, module, args, out):
        open_ranges.pop().__exit__(None, None, None)

    for fqn, m in linears.items():
        stack.callback(m.register_forward_pre_hook(functools.partial(enter, fqn)).remove)
        stack.callback(m.register_forward_hook(functools.partial(leave, fqn), always_call=True).remove)
    stack.callback(lambda: [r.__exit__(None, None, None) for r in reversed(open_ranges)])


def _all_gather_counter(model: nn.Module, tallies: dict[str, _Tally]):
    """An ``observe_all_gathers`` observer that counts each layer's fp8 all-gathers and their bytes."""
    names = {id(m): canonical_fqn(fqn) for fqn, m in model.named_modules()}

    def counted(weight, module, inputs, mp_policy):
        tally = tallies.get(names.get(id(module), ""))
        if tally is not None:
            hp = weight.numel() * (mp_policy.param_dtype or weight.dtype).itemsize
            tally.gathers.append((sum(t.numel() * t.element_size() for t in inputs if t.dtype == torch.uint8), hp))

    return observe_all_gathers(counted)


def _fp8_functions() -> set[str]:
    """Names of fp8func's autograd Functions: their forward and backward GEMMs are not high precision."""
    found, todo = set(), [torch.autograd.Function]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("fp8func."):
            found |= {cls.__name__, cls.__name__ + "Backward"}
    return found


def _in_fp8(name: str, fp8_fns: set[str]) -> bool:
    return name in fp8_fns or (name.startswith("fp8func::") and not name.startswith(_RANGE))


def _from_fp8(e) -> bool:
    """An ``aten::_to_copy`` of an FP8 tensor (dequantization's first step). Without the input
    dtypes in the profile (older torch), every high-precision GEMM inside an fp8func op counts as
    emulated: the emulated path is the only one that runs one there with FP8 operands."""
    dtypes = getattr(e, "input_dtypes", None)
    return e.name == "aten::_to_copy" and bool(dtypes) and "Float8" in str(dtypes[0])


def _scaled_mm_path(e) -> str:
    """``scaled_mm_<kind>`` of a hardware FP8 GEMM event, the kind read from its scale shapes."""
    if "v2" in e.name or "blockwise" in e.name:
        return "scaled_mm_blockwise"
    shapes = getattr(e, "input_shapes", None) or []
    if len(shapes) < 3:
        return "scaled_mm"
    return "scaled_mm_tensorwise" if math.prod(shapes[2] or [1]) == 1 else "scaled_mm_rowwise"


def _in_order(event, inside: bool, fp8_fns: set[str]):
    """The events under ``event`` in the order they ran, each with whether it runs inside an FP8 op
    or an outer GEMM; the children of a GEMM are not visited (one GEMM, one event)."""
    todo = [(c, inside) for c in sorted(event.cpu_children, key=lambda c: c.time_range.start, reverse=True)]
    while todo:
        e, inside = todo.pop()
        yield e, inside
        if "scaled_mm" in e.name or e.name in _HP_GEMMS:
            continue
        inside = inside or _in_fp8(e.name, fp8_fns)
        todo.extend((c, inside) for c in sorted(e.cpu_children, key=lambda c: c.time_range.start, reverse=True))


def _walk(event, tally: _Tally, fp8_fns: set[str], keys: set | None, inside: bool) -> None:
    """Tallies the GEMMs under ``event``; collects the (thread, sequence_nr) of forward ops in ``keys``."""
    from_fp8 = 0  # FP8 operands converted to high precision since the last GEMM
    dtypes_known = False
    if keys is not None:  # every op under the range, GEMMs' children too (aten::mm records MmBackward)
        todo = list(event.cpu_children)
        while todo:
            e = todo.pop()
            if e.sequence_nr >= 0:
                keys.add((e.thread, e.sequence_nr))
            todo.extend(e.cpu_children)
    for e, within in _in_order(event, inside, fp8_fns):
        dtypes_known = dtypes_known or bool(getattr(e, "input_dtypes", None))
        if _from_fp8(e):
            from_fp8 += 1
        elif "scaled_mm" in e.name:
            tally.scaled_mm += 1
            tally.paths[_scaled_mm_path(e)] += 1
            tally.kernels.update(_kernel_names(e))
            from_fp8 = 0
        elif e.name in _HP_GEMMS:
            if from_fp8 >= 2 or (within and not dtypes_known):
                tally.paths["emulated"] += 1
            elif not within:
                tally.hp_gemms += 1  # a GEMM of the layer outside fp8func's ops
            from_fp8 = 0


def _kernel_names(event) -> list[str]:
    names, todo = [], [event]
    while todo:
        e = todo.pop()
        names += [k.name for k in e.kernels if k.name != e.name]  # legacy entries repeat the op's name
        todo.extend(e.cpu_children)
    return names


def _attribute(events, tallies: dict[str, _Tally]) -> None:
    """Forward ops by the layer ranges; backward ops by the sequence numbers of those forward ops."""
    fp8_fns, owner = _fp8_functions(), {}
    for e in events:
        fqn = e.name[len(_RANGE):] if e.name.startswith(_RANGE) else None
        if fqn in tallies:
            keys: set = set()
            tallies[fqn].calls += 1
            _walk(e, tallies[fqn], fp8_fns, keys, inside=False)
            owner.update(dict.fromkeys(keys, fqn))
    for e in events:
        fqn = owner.get((e.fwd_thread, e.sequence_nr)) if e.name.startswith(_EVAL) else None
        if fqn is not None:
            tallies[fqn].backward += 1
            _walk(e, tallies[fqn], fp8_fns, None, inside=_in_fp8(e.name[len(_EVAL):], fp8_fns))


def _converted_fqns(model: nn.Module) -> set[str]:
    """Layers ``convert`` put in FP8, from the plans the model's FP8 layers carry, and every
    ``Fp8Linear`` of the model."""
    fqns = {canonical_fqn(fqn) for fqn, row in planned(model).items() if row.converted}
    return fqns | {canonical_fqn(fqn) for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _sharded_by_fsdp(model: nn.Module, fqn: str) -> bool:
    from torch.distributed.fsdp import FSDPModule

    parts = fqn.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), FSDPModule) for i in range(len(parts) + 1))


def _gather_column(model, fqn: str, m: nn.Module, tally: _Tally) -> tuple[str, str]:
    """(all-gather column, failure or "") for one layer."""
    w = m.weight
    if not (isinstance(w, DTensor) and _sharded_by_fsdp(model, fqn)):
        return "-", ""
    if weight_kind(w) is None:
        return "high precision", ""
    if not tally.gathers:
        return "none", ("FSDP2 shards its weight with the fp8 all-gather, but no fp8 all-gather ran for it in "
                        "this step; check that FSDP2 unshards it (fully_shard on its block or the root)")
    fp8, hp = map(sum, zip(*tally.gathers))
    return f"fp8 x{len(tally.gathers)}, {_kib(fp8)} (hp {_kib(hp)})", ""


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _paths(tally: _Tally) -> str:
    paths = sorted(tally.paths.items()) + ([("high precision", tally.hp_gemms)] if tally.hp_gemms else [])
    return ", ".join(f"{p} x{n}" for p, n in paths) or ("did not run" if not tally.calls else "-")


def _device_of(m: nn.Module) -> torch.device:
    return m.weight.device


def _check_fp8(model, fqn: str, m: nn.Module, t: _Tally, any_backward: bool) -> LayerCheck:
    gather, gather_fail = _gather_column(model, fqn, m, t) if isinstance(m, Fp8Linear) else ("-", "")
    row = functools.partial(LayerCheck, fqn, True, gemms=_paths(t), scaled_mm=t.scaled_mm, all_gather=gather)
    if not isinstance(m, Fp8Linear):
        return row(ok=False, note=f"convert() put it in FP8, but it is now a {type(m).__name__} and runs in high "
                                  "precision; do not replace layers after convert(), or convert again")
    device, emulated = _device_of(m), t.paths["emulated"]
    if t.calls == 0:
        return row(ok=False, note="its forward did not run in this step (unused, or its weight used by other code)")
    if not t.paths:
        return row(ok=False, note="its forward ran without an FP8 GEMM (forward replaced or patched?)")
    if device.type != "cpu" and emulated:
        return row(ok=False, note=f"{emulated} GEMM(s) emulated on {device.type} (gemm_path -> 'emulated', recipe "
                                  f"{m.plan.name!r} path={m.plan.output.path!r}): no FP8 kernel ran. Use path='auto' "
                                  "and a recipe with a hardware kernel on this GPU (see the fp8func log)")
    if any_backward and t.backward == 0 and m.weight.requires_grad:
        return row(ok=False, note="no backward ran for it in this step, though other layers had one")
    if gather_fail:
        return row(ok=False, note=gather_fail)
    how = f"FP8 emulated on {device.type}" if emulated else f"FP8 aten::_scaled_mm on {device.type}"
    return row(ok=True, note=how)


def _judge(model, linears, tallies, output) -> Verification:
    converted = _converted_fqns(model)
    decided = {canonical_fqn(fqn): row for fqn, row in planned(model).items()}
    any_backward = any(t.backward for t in tallies.values())
    rows = []
    for fqn in sorted(set(linears) | converted, key=_order(linears)):
        m, t = linears.get(fqn), tallies.get(fqn, _Tally())
        if isinstance(m, Fp8Linear) or fqn in converted:
            if m is None:
                rows.append(LayerCheck(fqn, True, False, "-", 0, "-", "convert() put it in FP8, but it is no longer "
                                       "in the model; do not replace layers after convert(), or convert again"))
            else:
                rows.append(_check_fp8(model, fqn, m, t, any_backward))
            continue
        why = hp_reason(decided.get(fqn), m)
        rows.append(LayerCheck(fqn, False, True, _paths(t), t.scaled_mm, "-", f"not converted: {why}"))
    fp8_paths = sum((t.paths for t in tallies.values()), Counter())
    kernels = sum((t.kernels for t in tallies.values()), Counter())
    device = next((str(_device_of(m)) for m in linears.values() if isinstance(m, Fp8Linear)), "-")
    gathers = sum(len(t.gathers) for t in tallies.values())
    summary = _summary(rows, device, fp8_paths, sum(t.scaled_mm for t in tallies.values()), gathers)
    return Verification(all(r.ok for r in rows) and any(r.fp8 for r in rows), tuple(rows), device, summary,
                        tuple(kernels.most_common()), gathers, output)


def _order(linears):
    index = {fqn: i for i, fqn in enumerate(linears)}
    return lambda fqn: (index.get(fqn, len(index)), fqn)


def _summary(rows, device: str, paths: Counter, scaled_mm: int, gathers: int) -> str:
    fp8 = [r for r in rows if r.fp8]
    bad = [r for r in fp8 if not r.ok]
    if not fp8:
        return ("FP8 CHECK FAILED: the model has no FP8 layers (no Fp8Linear): call fp8func.convert(model, recipe) "
                "before training")
    if bad:
        names = ", ".join(r.fqn for r in bad)
        return f"FP8 CHECK FAILED: FP8 did not run for {len(bad)}/{len(fp8)} FP8 layers: {names}. See the rows above."
    if paths["emulated"]:
        how = f"emulated on {device}: gemm_path -> 'emulated'; aten::_scaled_mm ran {scaled_mm} times"
    else:
        how = f"hardware path on {device}: aten::_scaled_mm ran {scaled_mm} times"
    gathered = f"; FSDP2 fp8 all-gathers: {gathers}" if gathers else ""
    return f"FP8 verified: {len(fp8)}/{len(fp8)} FP8 layers ran FP8 GEMMs ({how}){gathered}."
