"""Unreduced weight gradients: each rank's own gradient, before any data-parallel reduction.

Per step (default): a post-accumulate-grad hook on every monitored parameter counts the
backward passes of the step and, at its last micro-batch, reduces the accumulated local gradient
to statistics right away. The hook runs before DDP's reducer sees the gradient, so under DDP it
is really this rank's gradient.

Which micro-batch is the last is counted, not assumed: the ``grad_acc_steps``-th, or an earlier
one that ``last_micro_batch`` names (DDP synchronising it, accelerate's sync flag, a backward
running inside the optimizer's closure). A parameter whose step ends before either is measured
at the optimizer step when its gradient is provably unchanged since (same tensor, same version);
otherwise that step's row is missing, this is said once, and from then on every micro-batch's
accumulated gradient is measured.

Where nothing can change a gradient before the backward pass ends (``measure_at_pass_end``:
one process, or DDP that writes its reduction back after the pass), the hooks only note which
parameters the pass accumulated into; one callback at the end of that pass measures them
together (one kernel call for all of them, before anything such as clipping or DDP's write-back
can change them), so that thousands of parameters cost little more than torch's own call of
their hooks.

Per micro-batch (``monitor_mbs_grad``): a tensor hook sees each micro-batch's own gradient
before it is accumulated, with its micro-step index.

No gradient is copied. In one process with torch's optimizers (where the reduced pass can reuse
a row), the gradient tensors measured in a step are referenced (the parameters hold the very
same tensors meanwhile) until the optimizer's pre-step has compared them with what it reads,
then released, so ``zero_grad`` frees them as usual; elsewhere nothing is held (DeepSpeed frees
each gradient after its hook, and a reference would keep it). Rows go into a
preallocated buffer: a hook allocates nothing per parameter.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from adapters.torch.dist import dtensor_type, local_tensor, partials_summed
from adapters.torch.params import ParamRegistry
from adapters.torch.row_buffer import RowBuffer
from adapters.torch.sharded.tp_activations import Piece, TensorParallelMerge
from adapters.torch.stats import stack_rows, tensor_stats
from monitor.session.collection import UnendedStep

logger = logging.getLogger("trainmon")


@dataclasses.dataclass(frozen=True)
class GradCounting:
    """How a collection wants its unreduced gradients: micro-batches a step, the statistics, per
    micro-batch or per step, where failures go, and what can tell a step's last micro-batch."""

    grad_acc_steps: int
    ops: tuple[str, ...]
    eps: float
    per_micro_batch: bool
    on_error: Callable[[str, BaseException], None]
    last_micro_batch: Callable[[], bool] | None = None
    #: tells a step that never ends (shared with the activations, so that it is said once)
    unended: UnendedStep | None = None


class UnreducedGrads:
    """Hooks that turn local gradients into statistics on collected steps only."""

    def __init__(self, registry: ParamRegistry, counting: GradCounting) -> None:
        self.registry = registry
        self.grad_acc_steps = counting.grad_acc_steps
        self.ops = counting.ops
        self.eps = counting.eps
        self.per_micro_batch = counting.per_micro_batch
        self.on_error = counting.on_error
        #: set by the session before each step's forward: the hooks do nothing when False.
        self.collect = False
        self._micro = [0] * len(registry)
        #: micro-batches a trainer announced this step, less one (None: none announced)
        self.announced: int | None = None
        #: per step: the accumulated gradients' rows, by parameter index
        self._rows = RowBuffer(len(registry), self.ops, self.eps)
        #: per micro-batch: rows by (parameter index, micro-step)
        self._micro_rows: dict[tuple[int, int], list[float] | torch.Tensor] = {}
        #: whether to keep the measured gradients for ``measured_rows`` (set by the owner where a
        #: reduced pass can reuse rows: one process, torch's optimizers)
        self.keep_measured = False
        #: whether the hooks only note parameters, measured together when the pass ends (set by
        #: the owner where no gradient can change before then)
        self.measure_at_pass_end = False
        #: with ``keep_measured``, the gradient each parameter's row was measured from, and its
        #: version: held from the hook to the optimizer step (the parameter holds the same tensor
        #: meanwhile), then by ``take`` for ``measured_rows`` until ``release``. A list, not weak
        #: references: nothing is allocated per parameter.
        self._held: list[torch.Tensor | None] = [None] * len(registry)
        self._versions = [0] * len(registry)
        self._taken_grads: list[torch.Tensor | None] = []
        self._taken: dict[int, int] = {}
        self._last_micro_batch = counting.last_micro_batch or (lambda: False)
        #: parameters whose latest micro-batch may have been the step's last: gradient and version.
        self._waiting: dict[int, tuple[weakref.ref, int]] = {}
        #: after a short step whose gradients changed before the optimizer step: measure every pass.
        self._every_micro_batch = False
        #: after take(): (micro-batches of the step, parameters whose row is missing because their
        #: gradient changed before the optimizer step, those whose sum was lost: ``_add_to_sum``).
        self.counted: tuple[int, int, int] = (0, 0, 0)
        self._unended = counting.unended or UnendedStep(self.grad_acc_steps)
        #: after take(): the statistics it returned (``measured_rows`` indexes them).
        self.taken_matrix: torch.Tensor | None = None
        #: whether the optimizer consumes and frees each micro-batch's gradient (DeepSpeed ZeRO-2/3),
        #: so that the step's sum exists only as the monitor's own fp32 copy (``_sums``), kept on
        #: collected steps with several micro-batches, until the step is measured
        self.sum_micro_batches = False
        self._sums: dict[int, torch.Tensor] = {}
        #: parameters whose first micro-batch of this step was taken for its last and left
        #: uncopied, and of those the ones that had another: their sum is lost, no row this step
        self._uncopied: set[int] = set()
        self._unsummed: set[int] = set()
        #: after such a step: every first micro-batch is copied into the sum, last or not
        self._sum_from_first = False
        #: parameters whose gradient is a DTensor (tensor parallelism): (elements of this
        #: rank's piece, elements of the tensor); their rows describe the piece.
        self.pieces: dict[int, tuple[int, int]] = {}
        #: with ``measure_at_pass_end``: parameters noted by the hooks since the backward pass's end
        #: was last handled (the hooks hold this very list), and whether that end is awaited
        self._noted: list[int] = []
        self._end_queued = False
        #: whether any gradient can be a DTensor (its parameter is one): measured as its piece
        self._dtensors = any(isinstance(entry.param, dtensor_type()) for entry in registry.params)
        #: set by the collection with ``shard_reduce``: the pieces' mesh tags, merged at take
        self.merge: TensorParallelMerge | None = None
        self.tags: dict[int, Piece | None] = {}

    def passes(self) -> int:
        """Backward passes counted in the current step so far."""
        return max(self._micro, default=0)

    @property
    def task(self) -> str:
        """The task of the rows' tags."""
        return "pre_grad" if self.registry.main_grad else "acc_grad"

    def register(self) -> list:
        """Register one hook per monitored parameter; returns the removable handles."""
        handles = []
        for index, entry in enumerate(self.registry.params):
            if self.per_micro_batch:
                handles.append(entry.param.register_hook(self._micro_batch_hook(index)))
            elif self.measure_at_pass_end:
                handles.append(entry.param.register_post_accumulate_grad_hook(self._noting_hook(index)))
            else:
                handles.append(entry.param.register_post_accumulate_grad_hook(self._accumulated_hook(index)))
        return handles

    def _accumulated_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        return self._collecting(self.on_accumulated, index)

    def _collecting(
        self, handle: Callable[[int, torch.Tensor], None], index: int
    ) -> Callable[[torch.Tensor], None]:
        """A hook that hands its tensor to ``handle`` with ``index`` while collecting."""

        def hook(tensor: torch.Tensor) -> None:
            if self.collect:
                handle(index, tensor)

        return hook

    def on_accumulated(self, index: int, param: torch.Tensor) -> None:
        """A backward pass accumulated into the gradient of parameter ``index`` (held by
        ``param``): count it, and measure the gradient at the step's last micro-batch."""
        try:
            count = self._micro[index] + 1
            self._micro[index] = count
            if count >= self._unended.after:  # compared here: this runs per parameter and pass
                self._unended.is_unended(count)
            grad = self.accumulated(index, param)
            if grad is None:
                return
            last = count >= self.grad_acc_steps or self._every_micro_batch or self._last_micro_batch()
            if self._lost_to_reduction(index, param, grad, last):
                return
            if self.sum_micro_batches:
                grad = self._add_to_sum(index, grad, count, last)
                if grad is None:
                    return
            if not last:
                self._await_later_micro_batch(index, grad)
                return
            self._waiting.pop(index, None)
            self._measure(index, grad)
        except Exception as exc:
            self.collect = False
            self.on_error("grad_unreduced", exc)

    def _noting_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        noted = self._noted

        def hook(param: torch.Tensor) -> None:
            if self.collect:
                noted.append(index)
                if not self._end_queued:
                    self._await_pass_end()

        return hook

    def _await_pass_end(self) -> None:
        """Have the backward pass that runs now call ``measure_noted`` when it is done."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)
            self._end_queued = True
        except Exception as exc:
            self.collect = False
            self.on_error("grad_unreduced", exc)

    def _pass_ended(self) -> None:
        self._end_queued = False
        self.measure_noted()

    def measure_noted(self) -> None:
        """``on_accumulated`` for every parameter noted since the last call, measured together."""
        if not self._noted:
            return
        noted = self._noted[:]
        self._noted.clear()  # in place: the hooks append to this list
        try:
            last_pass = self._every_micro_batch or self._last_micro_batch()
            micro, params, grad_of = self._micro, self.registry.params, self.registry.grad
            slots, grads = [], []
            for index in noted:
                count = micro[index] + 1
                micro[index] = count
                grad = grad_of(params[index].param)
                if grad is None:
                    continue
                if last_pass or count >= self.grad_acc_steps:
                    slots.append(index)
                    grads.append(grad)
                else:
                    self._await_later_micro_batch(index, grad)
            if self._waiting:
                for index in slots:
                    self._waiting.pop(index, None)
            self._unended.is_unended(micro[noted[0]])
            local = [self._local(i, grad) for i, grad in zip(slots, grads)] if self._dtensors else grads
            self._rows.put_many(slots, local)
            if self.keep_measured:
                held, versions = self._held, self._versions
                for index, grad in zip(slots, grads):
                    held[index] = grad
                    versions[index] = grad._version
        except Exception as exc:
            self.collect = False
            self.on_error("grad_unreduced", exc)

    def _lost_to_reduction(self, index: int, param: torch.Tensor, grad: torch.Tensor, last: bool) -> bool:
        """Whether ``on_accumulated`` is done with the gradient ``grad`` of parameter ``index``:
        where a sharded back-end reduces and frees it before the step's last micro-batch (its
        accumulated gradient can then no longer exist), or measured it already; never here."""
        return False

    def _await_later_micro_batch(self, index: int, grad: torch.Tensor) -> None:
        """Not the step's last micro-batch (as far as is known): no row yet; the gradient and its
        version are noted, so that a step ending early can still be measured at the optimizer."""
        self._rows.drop(index)
        self._waiting[index] = (weakref.ref(grad), grad._version)

    def accumulated(self, index: int, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient of parameter ``index`` accumulated so far in this step, held by ``param``."""
        return self.registry.grad(param)

    def _add_to_sum(self, index: int, grad: torch.Tensor, count: int, last: bool) -> torch.Tensor | None:
        """The step's fp32 sum of the micro-batches' gradients, where the optimizer consumes and
        frees each micro-batch's gradient (``sum_micro_batches``). A step of one micro-batch is
        not copied. None where the sum is lost: the first micro-batch was taken for the step's
        last (grad_acc_steps 1) and freed uncopied before another came; the row is dropped, and
        from then on every first micro-batch is copied."""
        total = self._sums.get(index) if count > 1 else None
        if total is None and index in self._uncopied:
            self._unsummed.add(index)
            self._sum_from_first = True
            self._rows.drop(index)
            return None
        if total is None:
            if last and not (self._sum_from_first or self._every_micro_batch):
                self._uncopied.add(index)
                return grad
            total = self._sums[index] = grad.detach().to(torch.float32, copy=True)
            return total
        total.add_(grad)
        return total

    def _local(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient itself, or this rank's piece of a DTensor gradient (noted in ``pieces``),
        its partial sums over tensor-parallel ranks done first (a collective of that mesh's
        ranks, which all run the same hooks in the same order)."""
        if not isinstance(grad, dtensor_type()):
            return grad
        if self.merge is not None:
            local, self.tags[index] = self.merge.local(grad)
        else:
            local = local_tensor(partials_summed(grad))
        self.pieces[index] = (local.numel(), grad.numel())
        return local

    def _measure(self, index: int, grad: torch.Tensor) -> None:
        self._rows.put(index, self._local(index, grad))  # a repeat keeps the latest, in firing order
        if self.keep_measured:
            self._held[index] = grad
            self._versions[index] = grad._version

    def _measure_waiting(self) -> int:
        """At the optimizer step: measure the parameters whose step ended early, where their
        gradient is unchanged since their last micro-batch; returns how many could not be."""
        missing = 0
        for index, (source, version) in self._waiting.items():
            grad = self._sums.get(index)
            if grad is None:
                grad = self.registry.grad(self.registry.params[index].param)
            if grad is not None and source() is grad and grad._version == version:
                self._measure(index, grad)
            else:
                missing += 1
        self._waiting = {}
        if missing:
            self._every_micro_batch = True
        return missing

    def _micro_batch_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        return self._collecting(self.on_micro_batch, index)

    def on_micro_batch(self, index: int, grad: torch.Tensor) -> None:
        """One micro-batch's own gradient of parameter ``index``, before it is accumulated."""
        try:
            micro = self._micro[index]
            self._micro[index] = count = micro + 1
            # compared here (per parameter and pass); a step that never ends keeps its latest rows
            if count >= self._unended.after and self._unended.is_unended(count):
                for earlier in range(0 if count == self._unended.after else micro - 1, micro):
                    self._micro_rows.pop((index, earlier), None)
            local = self._local(index, grad.detach())
            key = micro if self.announced is None else self.announced
            self._micro_rows[(index, key)] = tensor_stats(local, self.ops, self.eps)
        except Exception as exc:
            self.collect = False
            self.on_error("grad_unreduced", exc)

    def take(self) -> tuple[list[int], list[int] | None, torch.Tensor]:
        """This step's rows in firing order: parameter indices, micro-steps (or None), statistics.

        Also sets ``counted``: the step's number of micro-batches, the rows missing because the
        gradients changed before the optimizer step, and those whose sum was lost.
        """
        self.measure_noted()  # a pass that raised never reached its end
        self._end_queued = False
        missing = self._measure_waiting()
        self.counted = (max(self._micro, default=0), missing, len(self._unsummed))
        if self.per_micro_batch:
            items = list(self._micro_rows.items())
            self.reset()
            keys = [key for key, _ in items]
            matrix = stack_rows([row for _, row in items], len(self.ops))
            return [i for i, _ in keys], [micro for _, micro in keys], matrix
        index, matrix = self._rows.take()
        held = self._held
        self.reset()
        self._taken_grads, self._taken = held, dict(zip(index, range(len(index))))
        self.taken_matrix = matrix
        return index, None, matrix

    def measured_rows(self, index: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[int | None]:
        """Per parameter ``index[k]``: the row, in the matrix ``take`` returned, of its gradient
        when ``tensors[k]`` is that very gradient, unchanged since it was measured; else None. A
        reduced-gradient pass reuses those rows where no reduction ran."""
        taken = self._taken if self.keep_measured else {}
        if not taken:
            return [None] * len(index)
        held, versions = self._taken_grads, self._versions
        return [
            row if row is not None and held[i] is tensor and tensor._version == versions[i] else None
            for i, tensor, row in zip(index, tensors, map(taken.get, index))
        ]

    def release(self) -> None:
        """Drop the gradients and rows ``take`` kept for ``measured_rows`` (at the end of the
        optimizer's pre-step: a gradient freed by ``zero_grad`` must not stay alive here)."""
        self._taken_grads, self._taken = [], {}
        self.taken_matrix = None

    def announce(self) -> None:
        """A trainer says a micro-batch begins: per-micro-batch rows take their micro-step from
        these calls, as activation rows do, so that one whose forward had no backward (a
        training_step returning None) still numbers the next micro-batch as the one it is."""
        self.announced = 0 if self.announced is None else self.announced + 1

    def reset(self) -> None:
        """Forget the step: micro-batch counters and pending statistics."""
        self.announced = None
        self._micro = [0] * len(self.registry)
        self._unended.end_step()
        self._rows.clear()
        self._micro_rows.clear()
        self._held = [None] * len(self.registry)
        self._waiting = {}
        self._sums = {}
        self._uncopied, self._unsummed = set(), set()
        self._noted.clear()
        self._end_queued = False
        self.release()
