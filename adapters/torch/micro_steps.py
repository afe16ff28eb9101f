"""The micro-step of each model chunk within a step, for the activation and l2 hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.compiled import traced
from monitor.session.collection import UnendedStep


class MicroSteps:
    """The micro-step of each model chunk within a step: a pre-hook on each chunk's root (run
    before any other) counts its training-mode calls while ``active()``, except the forward a
    checkpoint recomputes during the backward."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        active: Callable[[], bool],
        unended: UnendedStep | None = None,
        forget: Callable[[], None] = lambda: None,
    ) -> None:
        self.chunks = list(chunks)
        self.active = active
        #: once the gradients have taken the step for one that never ends (``unended.now``), each
        #: new micro-step first has ``forget`` drop the rows held so far: the latest one's are kept
        self.unended, self.forget = unended, forget
        #: micro-batches are announced (``announce``) instead of counted at the roots' calls
        self._announced = False
        self.reset()

    def register(self) -> list:
        """Register the counting hooks; returns removable handles."""
        return [
            chunk.register_forward_pre_hook(self._hook(vpp), prepend=True)
            for vpp, chunk in enumerate(self.chunks)
        ]

    def _hook(self, vpp: int) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not traced() and self.active() and module.training:
                self._count(vpp)

        return hook

    def _count(self, vpp: int) -> None:
        if not self._announced and torch._C._current_graph_task_id() == -1:  # not a recompute
            self._advance(vpp)

    def announce(self) -> None:
        """A trainer says a micro-batch's forward begins (Lightning's training_step may call
        submodules, never the root): from now on micro-steps are counted from these calls only."""
        self._announced = True
        if self.active():
            for vpp in range(len(self.chunks)):
                self._advance(vpp)

    def _advance(self, vpp: int) -> None:
        self._current[vpp] += 1
        if self.unended is not None and self.unended.now:
            try:
                self.forget()
            except Exception:  # never the training's problem: the rows are then kept
                self.unended = None

    def of(self, vpp: int) -> int:
        """The chunk's current micro-step (0 before its first counted call)."""
        return max(self._current[vpp], 0)

    def reset(self) -> None:
        self._current = [-1] * len(self.chunks)
