"""``StateWrites``: the next delayed-scaling states one backward produced, written at its end.

A delayed-scaling ``Fp8Linear`` gets its next state as the gradient of its state leaf; a hook on
that leaf hands the layer's ``ScalingBuffers`` to their ``StateWrites``, whose callback, queued
once per backward, writes every such layer's state with one multi-tensor copy after the last
gradient is accumulated. ``convert`` and ``hook_scaling_states`` give all the delayed layers of a
model one ``StateWrites`` (one copy for the model); a layer built alone has its own. The list of a
backward lives on this object, tagged with the backward's graph task: a backward that raised
before its end leaves its list behind, and the next backward starts a new one.
"""

from __future__ import annotations

import torch

__all__ = ["StateWrites"]


class StateWrites:
    """The layers whose next states the running backward produced (see the module docstring)."""

    def __init__(self):
        self._queued: list = []
        self._task: int | None = None

    def add(self, buffers) -> None:
        """Queues the state write of a layer's ``ScalingBuffers`` for the end of the running backward."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first layer of this backward
            self._queued, self._task = [], task
            torch.autograd.Variable._execution_engine.queue_callback(self._write)
        self._queued.append(buffers)

    def _write(self) -> None:
        """Writes each queued layer's next state into its buffers (``ScalingBuffers.take_next``),
        with one multi-tensor copy. At the end of the backward every state gradient is accumulated."""
        queued, self._queued, self._task = self._queued, [], None
        pairs = [pair for buffers in queued for pair in buffers.take_next()]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])

    # A copy of a model (deepcopy, pickle) writes its own layers: its layers share a new, empty one.
    def __deepcopy__(self, memo):
        return StateWrites()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()
