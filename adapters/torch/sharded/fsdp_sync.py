"""FSDP with gradient sync on before a step's last micro-batch: the step's local gradient is gone.

With gradient sync on (FSDP2's default, FSDP1 outside ``no_sync()``), FSDP reduce-scatters each
micro-batch's unsharded gradient as its backward ends and frees it, so this rank's gradient of
the whole tensor summed over the step's micro-batches never exists. Keeping a sum of our own
would hold every parameter's unsharded gradient at once, what FSDP is there to avoid; the rows of
such steps are therefore left out, said once with the remedy, rather than written as the last
micro-batch's gradient under the name of the step's sum. (``grad_reduced`` is unaffected, and
``monitor_mbs_grad`` gives each micro-batch's own gradient.)

A reduction before ``grad_acc_steps`` micro-batches is also how a loop that turns sync on for
each step's last micro-batch ends a short step (an epoch's last): the gradient is measured
there, before FSDP frees it, and kept unless another micro-batch of the same step follows.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from adapters.torch.sharded.fsdp_internals import FsdpInternalsChanged

logger = logging.getLogger("trainmon")


class ReducedEarly:
    """Mixin for an FSDP back-end's UnreducedGrads: parameters whose gradient FSDP reduced before
    the step's last micro-batch get no row at that step."""

    def __init__(self, *args: Any) -> None:
        self._reduced_early: set[int] = set()
        #: measured at a reduction before grad_acc_steps micro-batches: the step's last, unless
        #: another micro-batch of the step follows
        self._reduced_maybe_last: set[int] = set()
        self._told_reduced_early = False
        self._cannot_tell = False
        super().__init__(*args)

    def _reduces_now(self, index: int, param: torch.Tensor) -> bool:
        """Whether FSDP reduces the gradient of parameter ``index`` after the backward now running."""
        raise NotImplementedError

    def _lost_to_reduction(self, index: int, param: torch.Tensor, grad: torch.Tensor, last: bool) -> bool:
        if index in self._reduced_maybe_last:  # a micro-batch after the reduction: it came early
            self._reduced_maybe_last.discard(index)
        elif index in self._reduced_early or last or not self._reduces_now_or_not_known(index, param):
            return index in self._reduced_early
        else:  # reduced now, before grad_acc_steps micro-batches: a short step's last, or too early
            self._reduced_maybe_last.add(index)
            self._waiting.pop(index, None)
            self._measure(index, grad)
            return True
        self._reduced_early.add(index)
        self._rows.drop(index)
        self._waiting.pop(index, None)
        if not self._told_reduced_early:
            self._told_reduced_early = True
            logger.warning(
                "trainmon: grad_unreduced: FSDP reduce-scattered a micro-batch before the step's last "
                "(gradient sync on), which frees this rank's gradient of the whole tensor, so the "
                "step's local sum never exists and such steps get no grad_unreduced rows (grad_reduced "
                "is unaffected); turn sync off for the micro-batches before the last "
                "(FSDP2: model.set_requires_gradient_sync(False), FSDP1: model.no_sync()), or set "
                "monitor_mbs_grad for each micro-batch's own gradient"
            )
        return True

    def _reduces_now_or_not_known(self, index: int, param: torch.Tensor) -> bool:
        try:
            return self._reduces_now(index, param)
        except FsdpInternalsChanged:
            if not self._cannot_tell:
                self._cannot_tell = True
                logger.warning(
                    "trainmon: grad_unreduced: this torch's FSDP keeps its gradient-sync switch "
                    "elsewhere; where sync is on before a step's last micro-batch, rows are that last "
                    "micro-batch's gradient, not the step's sum"
                )
            return False

    def reset(self) -> None:
        super().reset()
        self._reduced_early.clear()
        self._reduced_maybe_last.clear()
