"""The micro-step of each model chunk within a step, for the activation and l2 hooks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from adapters.torch.compiled import traced
from monitor.session.collection import UnendedStep


class MicroSteps:
    """The micro-step of each model chunk within a step: a pre-hook on each chunk's root (run
    before any other) counts its training-mode calls while ``active()``, except the forward a
    checkpoint recomputes during the backward and a pass without backward.

    A call without backward is one in training mode with gradients off and no input that
    requires them (``torch.no_grad()``/``inference_mode``: the old log-probabilities of an RL
    step, samples generated in a callback, from the root or from a submodule such as a wrapped
    language model's ``generate``): no gradient follows it, so it is no micro-step and nothing
    of it is recorded (``records``), nor any call in inference mode. msprobe counts and records
    such calls, which shifts the micro-steps and call names of the training's own forwards
    against their gradients. A call with gradients off is still recorded where an input
    requires them or where it runs within a root call that trains: the reentrant checkpoint's
    first forward.
    """

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
        #: per chunk, within a call of its root: whether that call trains (None outside one)
        self._trains: list[bool | None] = [None] * len(self.chunks)
        self.reset()

    def register(self) -> list:
        """Register the counting hooks, to be run before any other; returns removable handles."""
        return [
            chunk.register_forward_pre_hook(self._hook(vpp), prepend=True, with_kwargs=True)
            for vpp, chunk in enumerate(self.chunks)
        ]

    def register_ends(self) -> list:
        """Register the hooks that end a root's call, to be run after those of the modules;
        returns removable handles."""
        return [
            chunk.register_forward_hook(self._ended(vpp), always_call=True)
            for vpp, chunk in enumerate(self.chunks)
        ]

    def _hook(self, vpp: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not traced() and self.active() and module.training:
                self._trains[vpp] = not _without_backward(args, kwargs)
                if self._trains[vpp]:
                    self._count(vpp)

        return hook

    def _ended(self, vpp: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not traced():
                self._trains[vpp] = None

        return hook

    def records(self, module: torch.nn.Module, vpp: int, args: tuple, kwargs: dict | None = None) -> bool:
        """Whether a hook of a module of chunk ``vpp`` records the call with these inputs: run
        eagerly, while ``active()``, the module in training mode, outside inference mode (whose
        tensors a gradient never reaches), within a root call that trains or, outside any, not a
        call without backward."""
        if traced() or not self.active() or not module.training or torch.is_inference_mode_enabled():
            return False
        trains = self._trains[vpp]
        return trains if trains is not None else not _without_backward(args, kwargs or {})

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

    def counted(self) -> int:
        """Micro-steps counted so far in the step (the most of any chunk)."""
        return max(self._current, default=-1) + 1

    def of(self, vpp: int) -> int:
        """The chunk's current micro-step (0 before its first counted call)."""
        return max(self._current[vpp], 0)

    def reset(self) -> None:
        self._current = [-1] * len(self.chunks)


def _without_backward(args: tuple, kwargs: dict) -> bool:
    """Whether a call is a forward that no backward follows: gradients off, outside a
    backward's recompute, and no input that requires them."""
    if torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return False
    leaves = tree_leaves((args, kwargs))
    return not any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)
