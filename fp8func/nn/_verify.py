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
* which path each ``fp8func.gemm`` took: during the step ``fp8func._gemm.gemm_path`` leaves an
  empty ``fp8func::gemm_path::<path>`` range where the GEMM runs; an ``aten::_scaled_mm`` (or
  ``_scaled_mm_v2``) op beside it proves the FP8 kernel ran, and its CUDA kernels are listed.
* FSDP2: ``fsdp_pre_all_gather`` of ``Fp8AllGatherWeight`` and ``Fp8WeightParam`` is wrapped to
  count, per layer, the uint8 payloads FSDP2 all-gathers.

Both wrappers are removed when ``verify`` returns.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from .. import _gemm
from ..distributed._fp8_weights import Fp8WeightParam
from ..distributed._fsdp import Fp8AllGatherWeight
from ._convert import _DECISIONS
from ._linear import Fp8Linear

__all__ = ["verify", "Verification", "LayerCheck"]

log = logging.getLogger("fp8func")
_RANGE, _MARK = "fp8func::", "fp8func::gemm_path::"
_EVAL = "autograd::engine::evaluate_function: "
_HP_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_FP8_GATHERED = (Fp8AllGatherWeight, Fp8WeightParam)  # the weight types FSDP2 all-gathers in FP8


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
    linears = {_canonical(fqn): m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    tallies = {fqn: _Tally() for fqn in linears}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        _install_ranges(stack, linears)
        stack.enter_context(_gemm_path_markers())
        stack.enter_context(_all_gather_counter(model, tallies))
        prof = stack.enter_context(profile(activities=activities))
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


def _canonical(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


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


@contextlib.contextmanager
def _gemm_path_markers():
    """Wraps ``gemm_path`` (which ``gemm`` calls) to mark each GEMM's path in the profile."""
    original = _gemm.gemm_path

    def marked(a, b, path="auto"):
        chosen = original(a, b, path)
        with record_function(_MARK + chosen):
            pass
        return chosen

    _gemm.gemm_path = marked
    try:
        yield
    finally:
        _gemm.gemm_path = original


@contextlib.contextmanager
def _all_gather_counter(model: nn.Module, tallies: dict[str, _Tally]):
    """Wraps ``fsdp_pre_all_gather`` of the fp8 weight types (``Fp8AllGatherWeight``,
    ``Fp8WeightParam``) to count each layer's fp8 all-gathers.

    FSDP2 reads the wrapped method's signature (5 parameters), so it is spelled out."""
    names = {id(m): _canonical(fqn) for fqn, m in model.named_modules()}
    originals = {cls: cls.fsdp_pre_all_gather for cls in _FP8_GATHERED}

    def counting(original):
        def counted(self, mesh, outer_size, outer_stride, module, mp_policy):
            inputs, metadata = original(self, mesh, outer_size, outer_stride, module, mp_policy)
            tally = tallies.get(names.get(id(module), ""))
            if tally is not None:
                hp = self.numel() * (mp_policy.param_dtype or self.dtype).itemsize
                tally.gathers.append((sum(t.numel() * t.element_size() for t in inputs if t.dtype == torch.uint8), hp))
            return inputs, metadata

        return counted

    for cls, original in originals.items():
        cls.fsdp_pre_all_gather = counting(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.fsdp_pre_all_gather = original


def _fp8_functions() -> set[str]:
    """Names of fp8func's autograd Functions: their forward and backward GEMMs are not high precision."""
    found, todo = set(), [torch.autograd.Function]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("fp8func."):
            found |= {cls.__name__, cls.__name__ + "Backward"}
    return found


def _walk(event, tally: _Tally, fp8_fns: set[str], keys: set | None, inside: bool) -> None:
    """Tallies the ops under ``event``; collects the (thread, sequence_nr) of forward ops in ``keys``."""
    todo = [(c, inside) for c in event.cpu_children]
    while todo:
        e, inside = todo.pop()
        if e.name.startswith(_MARK):
            tally.paths[e.name[len(_MARK):]] += 1
            continue
        if "scaled_mm" in e.name:
            tally.scaled_mm += 1
            tally.kernels.update(_kernel_names(e))
            continue
        if e.name in _HP_GEMMS and not inside:
            tally.hp_gemms += 1  # the outermost one: aten::linear -> aten::matmul -> aten::mm is one GEMM
        if keys is not None and e.sequence_nr >= 0:
            keys.add((e.thread, e.sequence_nr))
        inside = inside or e.name in fp8_fns or e.name in _HP_GEMMS
        todo.extend((c, inside) for c in e.cpu_children)


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
            _walk(e, tallies[fqn], fp8_fns, None, inside=e.name[len(_EVAL):] in fp8_fns)


def _converted_fqns(model: nn.Module) -> set[str]:
    """Layers ``convert`` put in FP8, read from its per-layer decisions (a converted layer's entry
    is empty or a note; the reasons for keeping one high-precision are the strings below)."""
    recorded = getattr(model, "_fp8func_converted", None)  # set by convert()
    if recorded is not None:
        return {_canonical(fqn) for fqn in recorded}
    kept = ("excluded by filter", "K=", "auto: kept bf16")
    decisions = getattr(model, _DECISIONS, {})
    return {_canonical(fqn) for fqn, why in decisions.items()
            if not why.startswith(kept) and " does not tile " not in why}


def _sharded_by_fsdp(model: nn.Module, fqn: str) -> bool:
    from torch.distributed.fsdp import FSDPModule

    parts = fqn.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), FSDPModule) for i in range(len(parts) + 1))


def _gather_column(model, fqn: str, m: nn.Module, tally: _Tally) -> tuple[str, str]:
    """(all-gather column, failure or "") for one layer."""
    w = m.weight
    if not (isinstance(w, DTensor) and _sharded_by_fsdp(model, fqn)):
        return "-", ""
    if not isinstance(w._local_tensor, _FP8_GATHERED):
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
    hardware = sum(t.paths.values()) - emulated
    if t.calls == 0:
        return row(ok=False, note="its forward did not run in this step (unused, or its weight used by other code)")
    if not t.paths:
        return row(ok=False, note="its forward ran without an FP8 GEMM (forward replaced or patched?)")
    if device.type != "cpu" and emulated:
        return row(ok=False, note=f"{emulated} GEMM(s) emulated on {device.type} (gemm_path -> 'emulated', recipe "
                                  f"{m.recipe.name!r} path={m.recipe.path!r}): no FP8 kernel ran. Use path='auto' "
                                  "and a recipe with a hardware kernel on this GPU (see the fp8func log)")
    if t.scaled_mm < hardware:
        return row(ok=False, note=f"gemm_path chose scaled_mm {hardware}x but the profiler saw aten::_scaled_mm "
                                  f"{t.scaled_mm}x")
    if any_backward and t.backward == 0 and m.weight.requires_grad:
        return row(ok=False, note="no backward ran for it in this step, though other layers had one")
    if gather_fail:
        return row(ok=False, note=gather_fail)
    how = f"FP8 emulated on {device.type}" if emulated else f"FP8 aten::_scaled_mm on {device.type}"
    return row(ok=True, note=how)


def _judge(model, linears, tallies, output) -> Verification:
    converted = _converted_fqns(model)
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
        why = getattr(model, _DECISIONS, {}).get(fqn, "convert() has not seen this layer")
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
