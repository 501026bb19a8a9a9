"""``PrecisionSchedule``: bf16 warm-up, FP8 body, bf16 cool-down — in one run, by step."""

from __future__ import annotations

import logging

from torch import nn

from ._linear import Fp8Linear

__all__ = ["PrecisionSchedule"]

log = logging.getLogger("fp8func")
PRECISIONS = ("bf16", "fp8")


class PrecisionSchedule:
    """Switches a converted model's ``Fp8Linear`` layers between their FP8 recipe and plain
    high-precision ``F.linear`` by training step.

    ``phases``: ``[(first_step, "bf16" | "fp8"), ...]``, sorted, starting at step 0. Call
    ``schedule.apply(model, step)`` before each step: it flips the layers' ``fp8_enabled`` flag
    when the phase changes (logging the switch) and returns the step's precision. Under
    ``torch.compile`` each switch costs at most one recompile (the flag is a guard), and a
    precision seen before reuses its graph. Under FSDP2, convert with
    ``fsdp_fp8_all_gather=False``: an FP8-gathered weight has no bf16 values to run a bf16 phase.

    Example:
        >>> schedule = PrecisionSchedule([(0, "bf16"), (500, "fp8"), (9000, "bf16")])
        >>> for step in range(10000):
        ...     schedule.apply(model, step); train_step(model, batch)
    """

    def __init__(self, phases):
        phases = [(int(s), p) for s, p in phases]
        if not phases or phases[0][0] != 0:
            raise ValueError(f"PrecisionSchedule({phases!r}): the first phase must start at step 0, "
                             "e.g. [(0, 'bf16'), ...].")
        for (a, _), (b, _) in zip(phases, phases[1:]):
            if b <= a:
                raise ValueError(f"PrecisionSchedule: phase starts {[s for s, _ in phases]} must increase strictly.")
        bad = [p for _, p in phases if p not in PRECISIONS]
        if bad:
            raise ValueError(f"PrecisionSchedule: precision(s) {bad}; expected one of {PRECISIONS}.")
        self.phases = phases
        self._current: str | None = None

    def precision_at(self, step: int) -> str:
        """The precision of ``step``."""
        return [p for s, p in self.phases if s <= step][-1]

    def apply(self, model: nn.Module, step: int) -> str:
        """Sets ``model``'s FP8 layers for ``step``; returns its precision."""
        precision = self.precision_at(step)
        if precision != self._current:
            layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
            if not layers:
                raise ValueError("PrecisionSchedule.apply: the model has no Fp8Linear layers; "
                                 "run fp8func.convert first.")
            gathered = [m for m in layers if m.fsdp_fp8_all_gather]
            if precision == "bf16" and gathered and _sharded(model):
                raise ValueError(
                    f"PrecisionSchedule: {len(gathered)} layers all-gather their weights in FP8 under FSDP2, "
                    "so a bf16 phase has no bf16 weights to use; convert with fsdp_fp8_all_gather=False.")
            for m in layers:
                m.set_fp8_enabled(precision == "fp8")
            log.info("fp8func: step %d: %s for %d layers", step, precision, len(layers))
            self._current = precision
        return precision


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
