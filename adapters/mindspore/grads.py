"""Unreduced weight gradients: each rank's own gradient, before any data-parallel reduction.

A MindSpore Parameter has no ``.grad``; its gradient exists only as an element of the tuple
that ``value_and_grad`` returns, which the user's loop then passes through a
``DistributedGradReducer`` (or its own AllReduce) to the optimizer. A tensor hook on every
monitored Parameter (``Parameter.register_hook``) sees the gradient of each backward pass while
``value_and_grad`` computes it, so necessarily before any reduction the loop applies, wherever
and however it does it. The hook returns the gradient unchanged (MindSpore requires a return
value; returning the same tensor changes nothing).

Statistics are taken once per backward pass, for all gradients of that pass at once (one
batched StatEngine call when the last monitored parameter's hook has fired; a pass that leaves
some parameters out is completed at the optimizer's call), so gradients are held only until
the end of their own backward pass; in one process on the CPU, with one micro-batch a step, until
the optimizer's call instead, where grad_reduced reuses their rows if it is handed that very
memory (which holds no more than the loop itself holds then). MindSpore keeps no version
counters: the collection measures one gradient again to catch a change made in place, which a
loss scaler's or clipping's rescale of every gradient shows; a change of some gradients only,
made in place, would go unseen (MindSpore's own clipping and scaling return new tensors).

Per step (default): with ``grad_acc_steps`` 1 each pass's gradients are described. With more
micro-batches the hook keeps the running sum of this step's micro-batch gradients (one
gradient-sized tensor per parameter, on collected steps only -- the analogue of torch's
``.grad`` accumulation) and describes it from the ``grad_acc_steps``-th micro-batch on. The
number of micro-batches is counted, not assumed: a step that ends earlier (a shorter last step
of an epoch) gets the sum of the micro-batches it had, described at the optimizer's call.

Per micro-batch (``monitor_mbs_grad``): each pass's gradients with their micro-step index.

A step that runs for hundreds of passes (``UnendedStep``: likely another optimizer steps than
the one monitored) is said once, and from then on holds its latest pass's statistics only.
"""

from __future__ import annotations

from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import ops

from adapters.mindspore.dist import world_size
from adapters.mindspore.jit_guard import LeftOutOfJit
from adapters.mindspore.params import ParamRegistry
from adapters.mindspore.stats import StatEngine, host_memory
from monitor.session.collection import UnendedStep


class UnreducedGrads:
    """Parameter hooks that turn local gradients into statistics on collected steps only."""

    def __init__(
        self,
        registry: ParamRegistry,
        grad_acc_steps: int,
        engine: StatEngine,
        per_micro_batch: bool,
        on_error: Callable[[str, BaseException], None],
        jit: LeftOutOfJit,
        unended: UnendedStep | None = None,
    ) -> None:
        self.registry = registry
        self.jit = jit
        self.grad_acc_steps = grad_acc_steps
        self.engine = engine
        self.per_micro_batch = per_micro_batch
        self.on_error = on_error
        #: set by the collection before each step's forward: the hooks do nothing when False.
        self.collect = False
        self._micro = [0] * len(registry)
        self._unended = unended or UnendedStep(grad_acc_steps)
        self._sums: dict[int, ms.Tensor] = {}
        self._described: set[int] = set()
        #: after take(): (micro-batches of the step, rows missing from it).
        self.counted: tuple[int, int, int] = (0, 0, 0)
        self._fired = 0
        self._pending: list[tuple[tuple[int, int], ms.Tensor]] = []
        self._blocks: list[tuple[list[tuple[int, int]], ms.Tensor, list[ms.Tensor]]] = []
        #: after take(), per step (not per micro-batch): parameter index -> (the gradient measured,
        #: held until ``release``, and its row of ``taken_matrix``), for grad_reduced to reuse
        self.taken: dict[int, tuple[ms.Tensor, int]] = {}
        self.taken_matrix: ms.Tensor | None = None
        #: where the optimizer can be handed the very gradients measured (one process, one
        #: micro-batch a step, rows per step, host memory), which are then kept to be recognised
        self._reusable = not per_micro_batch and grad_acc_steps == 1 and host_memory() and world_size() == 1

    def passes(self) -> int:
        """Backward passes counted in the current step so far."""
        return max(self._micro, default=0)

    def register(self) -> list:
        """Register one hook per monitored parameter (removed when a ``jit`` compilation calls the
        model: MindSpore would compile them); returns the removable handles."""
        return self.jit.keep(
            lambda: [entry.param.register_hook(self._hook(i)) for i, entry in enumerate(self.registry.params)]
        )

    def _hook(self, index: int) -> Callable[[ms.Tensor], ms.Tensor]:
        def hook(grad: ms.Tensor) -> ms.Tensor:
            if self.collect:
                try:
                    self._observe(index, grad)
                except Exception as exc:
                    self.collect = False
                    self.on_error("grad_unreduced", exc)
            return grad

        return hook

    def _observe(self, index: int, grad: ms.Tensor) -> None:
        micro = self._micro[index]
        self._micro[index] = micro + 1
        if self.per_micro_batch:
            self._pending.append(((index, micro), grad))
        else:  # with grad_acc_steps 1 too: a step may have more micro-batches, whose sum it describes
            total = ops.add(self._sums[index], grad) if index in self._sums else grad
            self._sums[index] = total  # kept: a step may have more micro-batches than grad_acc_steps
            if micro + 1 >= self.grad_acc_steps:
                self._described.add(index)
                self._pending.append(((index, 0), total))
        self._fired += 1
        if self._fired >= len(self.registry):
            self._flush()

    def _flush(self) -> None:
        """Statistics of the gradients held so far, in one batch; the gradients are let go."""
        self._fired = 0
        if self._pending:
            keys = [key for key, _ in self._pending]
            grads = [grad for _, grad in self._pending]
            kept = grads if self._reusable else []
            self._blocks.append((keys, self.engine.matrix(grads), kept))
            self._pending = []
            if self._unended.is_unended(self._micro[keys[-1][0]]):
                del self._blocks[:-1]  # a step that never ends holds its latest pass's only

    def take(self) -> tuple[list[int], list[int] | None, ms.Tensor]:
        """This step's rows in firing order: parameter indices, micro-steps (or None), statistics.

        A parameter seen twice for one micro-step (a repeated backward pass) keeps the latest.
        Also sets ``counted``: the step's number of micro-batches and the rows missing (none here,
        of either kind the torch adapter counts).
        """
        self._pending += [((i, 0), total) for i, total in self._sums.items() if i not in self._described]
        self.counted = (max(self._micro, default=0), 0, 0)
        self._flush()
        blocks = self._blocks
        self.reset()
        if not blocks:
            return [], [] if self.per_micro_batch else None, self.engine.matrix(())
        keys = [key for block_keys, _, _ in blocks for key in block_keys]
        held = [grad for _, _, grads in blocks for grad in grads]
        matrix = blocks[0][1] if len(blocks) == 1 else ops.concat([m for _, m, _ in blocks])
        latest: dict[tuple[int, int], int] = {}
        for position, key in enumerate(keys):
            latest.pop(key, None)
            latest[key] = position
        if len(latest) != len(keys):
            matrix = ops.gather(matrix, ms.Tensor(np.array(list(latest.values()), dtype=np.int32)), 0)
        index = [key[0] for key in latest]
        micro = [key[1] for key in latest] if self.per_micro_batch else None
        if held:
            self.taken = {key[0]: (held[at], row) for row, (key, at) in enumerate(latest.items())}
            self.taken_matrix = matrix
        return index, micro, matrix

    def release(self) -> None:
        """Let go of the gradients and rows ``take`` kept for grad_reduced (at the optimizer's call)."""
        self.taken, self.taken_matrix = {}, None

    def reset(self) -> None:
        """Forget the step: micro-batch counters, running sums, held gradients and statistics."""
        self._micro = [0] * len(self.registry)
        self._unended.end_step()
        self._sums.clear()
        self._described = set()
        self._fired = 0
        self._pending = []
        self._blocks = []
        self.release()
