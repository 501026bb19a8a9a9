"""``NumericsStats(model, every=50)``: opt-in per-layer FP8 numerics statistics.

For every ``Fp8Linear`` it records, on recording steps, for the input ``x`` and the weight ``w``
(forward) and the grad_output ``dy`` (backward): the amax, the scale the layer's recipe gives,
the underflow and saturation shares, the share in the top binade and the SQNR of the cast.

How it stays out of the training numerics: the hooks only *read* detached tensors (no in-place
op, no RNG, nothing returned to autograd), and they recompute the casts with the same pure
``quantize`` the layer calls, on the same values (``x`` reshaped to ``[-1, K]``, ``w [N, K]``,
``dy`` reshaped to ``[-1, N]``). With a delayed-scaling recipe the scale is the layer's state
scale as it is *before* the forward (what the layer casts with), so saturation can be nonzero.

How it stays out of ``torch.compile``: each hook first reads one Python bool; on non-recording
steps that is all it does, and dynamo traces it away (dynamo guards on the bool and keeps one
graph per value: nothing is computed, no graph break). On recording steps a compiled forward only
*stashes* the detached ``x`` and ``w`` (a list append, which dynamo replays after the graph; the
tensors become extra graph outputs: still no graph break, so ``fullgraph=True`` works too) and
``step()`` computes their statistics eagerly. The ``dy`` tensor hook is eager-only: under
``torch.compile`` no ``dy`` is recorded (registering it would graph-break). Dynamo does not guard
on module hooks, so attach ``NumericsStats`` before the first compiled call (or call
``torch._dynamo.reset()`` after attaching); ``step()`` warns when a recording step saw no forward.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._formats import fp8_max
from .._metrics import sqnr
from .._ops import apply_scale, dequantize, quantize, quantize_with_scale, reciprocal
from .._scaling import CastSpec, block_lengths
from ._convert import canonical_fqn
from ._linear import Fp8Linear

__all__ = ["NumericsStats", "tensor_stats"]

log = logging.getLogger("fp8func")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor holding ``t``'s values (a DTensor is gathered to its full value)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def tensor_stats(t: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None = None) -> dict[str, float]:
    """Numerics of casting ``t`` per ``spec``: with ``scale=None`` the dynamic scale
    ``quantize(t, spec)`` computes, else the given (e.g. delayed) dequantization scale.

    Returns ``amax``; ``scale`` and ``scale_min`` (largest and smallest group scale, equal for
    tensorwise); ``underflow_pct`` (% of the *nonzero* elements whose cast is 0);
    ``saturation_pct`` (% of elements with ``|t| / scale > fp8_max``, clipped by the cast);
    ``top_binade_pct`` (% with ``|t| / scale >= fp8_max / 2``); ``sqnr_db`` of
    ``dequantize(cast)`` against ``t`` (``inf`` when exact).

    Example:
        >>> tensor_stats(torch.randn(64, 128), fp8func.CastSpec())["sqnr_db"]  # about 31 dB
    """
    if not isinstance(spec, CastSpec):
        raise TypeError(f"tensor_stats: spec={spec!r} is not a CastSpec; e.g. fp8func.CastSpec(dtype=fp8func.E4M3).")
    t = _plain(t)
    q = quantize(t, spec) if scale is None else quantize_with_scale(t, scale.detach().float(), spec)
    scaled = apply_scale(t, reciprocal(q.scale), block_lengths(spec.granularity, tuple(t.shape))).abs()
    top = fp8_max(spec.dtype)
    nonzero = t != 0
    n_nonzero = int(nonzero.sum())
    underflow = int((nonzero & (q.data.float() == 0)).sum())
    n = max(t.numel(), 1)
    return {
        "amax": float(t.abs().max()) if t.numel() else 0.0,
        "scale": float(q.scale.max()),
        "scale_min": float(q.scale.min()),
        "underflow_pct": 100.0 * underflow / n_nonzero if n_nonzero else 0.0,
        "saturation_pct": 100.0 * int((scaled > top).sum()) / n,
        "top_binade_pct": 100.0 * int((scaled >= top / 2).sum()) / n,
        "sqnr_db": sqnr(t.float(), dequantize(q, torch.float32)),
    }


class NumericsStats:
    """Records FP8 numerics of every ``Fp8Linear`` of ``model`` every ``every`` steps.

    Call ``step()`` once per training step (after the optimizer step): steps ``0, every,
    2*every, ...`` are recorded (the forwards and the backward of that step), and ``step()`` logs
    the records of a recorded step on the ``fp8func`` logger (INFO, one line per layer).
    ``records`` is a list of dicts with keys ``step, layer, tensor ("x" | "w" | "dy"), amax, scale,
    scale_min, underflow_pct, saturation_pct, top_binade_pct, sqnr_db`` (one per forward call).
    ``remove()`` (or leaving the ``with`` block) detaches every hook. Under ``torch.compile`` the
    ``x`` / ``w`` records of a step appear at ``step()`` and no ``dy`` is recorded (module docs).

    Example:
        >>> with fp8func.nn.NumericsStats(model, every=50) as stats:
        ...     for batch in data:
        ...         model(batch).loss.backward(); opt.step(); opt.zero_grad()
        ...         stats.step()
        >>> stats.to_json("stats.json")   # python -m fp8func.stats_plot stats.json stats.png
    """

    def __init__(self, model: nn.Module, every: int = 50, *, grad_output: bool = True, start: int = 0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"NumericsStats: model is a {type(model).__name__}; expected an nn.Module.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"NumericsStats(every={every!r}): expected an int >= 1 (record every that many steps), "
                             "e.g. every=50.")
        layers = {canonical_fqn(fqn): m for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)}
        if not layers:
            raise ValueError("NumericsStats: the model has no Fp8Linear layer to watch; call "
                             "fp8func.convert(model, recipe) first.")
        self.every, self.grad_output = every, grad_output
        self.records: list[dict[str, Any]] = []
        self._step = start
        self._active = self._step % every == 0
        self._logged = 0
        self._pending: list[tuple] = []  # forward tensors stashed under torch.compile
        self._handles = []
        for fqn, m in layers.items():
            self._handles.append(m.register_forward_pre_hook(self._pre_hook_for(fqn)))
            if grad_output:
                self._handles.append(m.register_forward_hook(self._hook_for(fqn)))

    @property
    def current_step(self) -> int:
        """The step the next forward belongs to."""
        return self._step

    @property
    def recording(self) -> bool:
        """True when the current step is recorded."""
        return self._active

    def _pre_hook_for(self, fqn: str):
        def pre_hook(module, args):
            if self._active:  # a Python bool: dynamo guards on it; nothing is traced when False
                self._capture_forward(fqn, module, args[0])

        return pre_hook

    def _hook_for(self, fqn: str):
        def hook(module, args, out):
            if self._active and not torch.compiler.is_compiling():
                self._watch_grad_output(fqn, module, out)

        return hook

    def _capture_forward(self, fqn: str, module: Fp8Linear, x: torch.Tensor) -> None:
        p = module.plan
        delayed = p.delayed is not None  # the layer casts with its state scales (as before the forward)
        item = (self._step, fqn, p, x.detach(), module.weight.detach(),
                module.fp8_x_scale if delayed else None, module.fp8_w_scale if delayed else None)
        if torch.compiler.is_compiling():
            # Under dynamo: only stash the detached tensors (a list append is replayed after the
            # graph, the tensors become extra graph outputs: no graph break); step() computes.
            self._pending.append(item)
        else:
            self._compute_forward(*item)

    def _compute_forward(self, step, fqn, p, x, w, x_scale, w_scale) -> None:
        with torch.no_grad():
            x2 = _plain(x).reshape(-1, x.shape[-1])
            self._add(fqn, "x", tensor_stats(x2, p.output.a, x_scale), step)
            self._add(fqn, "w", tensor_stats(w, p.output.b, w_scale), step)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            self._compute_forward(*item)

    def _watch_grad_output(self, fqn: str, module: Fp8Linear, out: torch.Tensor) -> None:
        if not (isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled()):
            return  # eval / no_grad forward: no backward to watch
        step = self._step

        def on_grad(dy: torch.Tensor) -> None:  # returns None: the gradient passes unchanged
            p = module.plan
            if p.grad_input.hp:  # a plan that never casts dy as [M, N]
                return
            with torch.no_grad():
                scale = module.fp8_dy_scale if p.delayed is not None else None
                self._add(fqn, "dy", tensor_stats(_plain(dy).reshape(-1, dy.shape[-1]), p.grad_input.a, scale), step)

        out.register_hook(on_grad)

    def _add(self, fqn: str, tensor: str, stats: dict[str, float], step: int | None = None) -> None:
        self.records.append({"step": self._step if step is None else step, "layer": fqn, "tensor": tensor, **stats})

    def step(self, step: int | None = None) -> None:
        """Ends the current step (logs its records if it was recorded) and starts the next one,
        ``current_step + 1`` or the given ``step`` (e.g. the trainer's global step)."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"NumericsStats.step(step={step!r}): expected None or an int >= 0.")
        self._flush()
        if self._active and len(self.records) == self._logged:
            log.warning("fp8func stats: step %d was a recording step but no watched layer ran a forward with the "
                        "hooks; if the model was compiled before NumericsStats was attached, call "
                        "torch._dynamo.reset() after attaching (dynamo does not guard on module hooks).", self._step)
        self._log_new()
        self._step = self._step + 1 if step is None else step
        self._active = self._step % self.every == 0

    def _log_new(self) -> None:
        new, self._logged = self.records[self._logged:], len(self.records)
        by_layer: dict[tuple[int, str], list[str]] = {}
        for rec in new:
            by_layer.setdefault((rec["step"], rec["layer"]), []).append(
                f"{rec['tensor']} amax={rec['amax']:.3g} scale={rec['scale']:.3g} uf={rec['underflow_pct']:.2f}% "
                f"sat={rec['saturation_pct']:.2f}% top={rec['top_binade_pct']:.2f}% sqnr={rec['sqnr_db']:.1f}dB")
        for (step, layer), parts in by_layer.items():
            log.info("fp8func stats step %d %s: %s", step, layer, " | ".join(parts))

    def to_json(self, path) -> None:
        """Writes ``{"every": ..., "records": [...]}``; an exact cast's SQNR is written as null."""
        self._flush()
        records = [{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()}
                   for r in self.records]
        with open(path, "w") as f:
            json.dump({"every": self.every, "records": records}, f, indent=1)

    def remove(self) -> None:
        """Detaches every hook; the model is as it was (records are kept)."""
        self._flush()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False

    def __enter__(self) -> "NumericsStats":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
