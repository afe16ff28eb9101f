"""Cell activations: statistics of inputs/outputs (``actv``) and their gradients (``actv_grad``).

The design and the row names are the torch adapter's (``monitor.datatypes.modules``): a forward pre-hook
takes a Cell's inputs and a forward hook its outputs; tensor hooks registered on those same
tensors (``Tensor.register_hook``, PyNative) receive dL/d(output) and dL/d(input) while
``value_and_grad`` runs, so ``input_grad`` is the gradient of the loss with respect to the
tensor the Cell received, as with torch. Cell backward hooks are not used: MindSpore implements
them by routing the Cell's inputs and outputs through extra hook operations on every call,
collected or not, and their firings would have to be matched to calls by order.

Micro-steps are counted by a pre-hook on each model chunk's root Cell (one call per
micro-batch). A Cell call is recorded when it runs inside a call of its chunk's root and is a
training call: it runs under ``value_and_grad`` / ``grad``, whether the Cell is in training mode
(``set_train()``) or not -- MindSpore Cells start in eval mode and many PyNative loops never call
``set_train()``, and a call in training mode outside a gradient computation has no backward.
Calls outside the root's call are not recorded, which leaves out MindSpore's recompute pass
(``Cell.recompute()`` runs the forward again during the backward).

PyNative runs every operation separately, so statistics are not taken call by call: the
tensors of a chunk's forward are described together when the root's call ends, gradients when
the next forward starts or the optimizer is called (and earlier whenever the held tensors
exceed ``HOLD_MAX`` elements). Held forward tensors are mostly those autograd keeps for the
backward anyway; a tensor changed in place later in the same forward is described as it is at
the end of that forward.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import mindspore as ms
from mindspore import ops
from mindspore.graph.api import _pynative_executor

from adapters.mindspore.held_tensors import HeldTensors
from adapters.mindspore.jit_guard import LeftOutOfJit
from adapters.mindspore.stats import StatEngine
from monitor.config.schema import MonitorConfig
from monitor.datatypes.leaf_grads import LeafGradients
from monitor.datatypes.modules import (
    call_name,
    direction_tensors,
    forward_mask_positions,
    mask_ids,
    row_names,
    select_modules,
)
from monitor.record import RowSet
from monitor.session.collection import UnendedStep

#: held tensor elements (per direction) above which their statistics are taken at once.
HOLD_MAX = 1 << 24
PREFIXES = ("actv", "actv_grad")


def is_tensor(obj: Any) -> bool:
    return isinstance(obj, ms.Tensor)


def grad_active() -> bool:
    """True while ``value_and_grad`` / ``grad`` records operations for the backward (PyNative)."""
    return bool(_pynative_executor.requires_grad())


def takes_part_in_grad(tensor: ms.Tensor) -> bool:
    """True when a gradient may flow to ``tensor`` (a tensor hook can be registered on it): one
    computed under the gradient's recording, or a floating-point input of the recorded call,
    which ``value_and_grad(fn, 0, ...)`` differentiates (MindSpore does not say before the
    backward whether it will; a hook that no gradient reaches never fires)."""
    has_auto_grad = getattr(tensor, "_has_auto_grad", None)
    if has_auto_grad is None or has_auto_grad():
        return True
    leaf_input = getattr(tensor, "_is_leaf", False) and getattr(tensor, "_requires_grad", False)
    return bool(leaf_input) and tensor.dtype in _FLOATING


_FLOATING = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def is_training_call(cell: ms.nn.Cell) -> bool:
    """A call that training makes: one under a gradient computation, the Cell in training mode
    or not. A call in training mode outside one (samples generated, a forward evaluated without
    ``set_train(False)``) has no backward: no micro-step, nothing recorded (msprobe records it)."""
    return grad_active()


@dataclasses.dataclass
class HookedCell:
    """A monitored Cell: its chunk, display name, and 1.2.2 per-direction formats (if any)."""

    vpp_stage: int
    name: str
    cell: ms.nn.Cell
    formats: Mapping[str, str]
    warned: set[str] = dataclasses.field(default_factory=set)
    #: where ``construct`` takes a mask positionally (``monitor.datatypes.modules.mask_ids``)
    mask_positions: tuple[int, ...] = ()


def select_cells(chunks: Sequence[ms.nn.Cell], config: MonitorConfig) -> list[HookedCell]:
    """Cells to hook: every Cell with all_xy (or no targets), else those named exactly in targets."""
    named = [(vpp, raw, cell) for vpp, chunk in enumerate(chunks) for raw, cell in chunk.cells_and_names()]
    return [
        HookedCell(
            m.vpp_stage,
            m.name,
            named[m.position][2],
            m.formats,
            mask_positions=forward_mask_positions(type(named[m.position][2]).construct),
        )
        for m in select_modules([(vpp, raw) for vpp, raw, _ in named], config)
    ]


class RootCalls:
    """Whether each model chunk's root Cell is running, and the chunk's micro-step: a training
    call of a root that is not inside another call of it starts a micro-step while ``active()``.
    ``on_start(vpp)`` runs when a micro-step starts, ``on_end(vpp)`` when a root call ends while
    ``active()``. The start hooks go before every other hook, the end hooks after them; ``jit``
    leaves them out of compilations."""

    def __init__(
        self,
        chunks: Sequence[ms.nn.Cell],
        active: Callable[[], bool],
        jit: LeftOutOfJit,
        on_start: Callable[[int], None] | None = None,
        on_end: Callable[[int], None] | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.active = active
        self.jit = jit
        self.on_start, self.on_end = on_start, on_end
        self.reset()

    def register_starts(self) -> list:
        return [
            chunk.register_forward_pre_hook(self.jit.cell_hook(self._starts(vpp)), prepend=True)
            for vpp, chunk in enumerate(self.chunks)
        ]

    def register_ends(self) -> list:
        return [
            chunk.register_forward_hook(self.jit.cell_hook(self._ends(vpp)), always_call=True)
            for vpp, chunk in enumerate(self.chunks)
        ]

    def _starts(self, vpp: int) -> Callable:
        def hook(cell: ms.nn.Cell, args: Any) -> None:
            self._running[vpp] += 1
            if self._running[vpp] == 1:
                self._training[vpp] = is_training_call(cell)
            if self.active() and self._running[vpp] == 1 and self._training[vpp]:
                self._micro[vpp] += 1
                if self.on_start is not None:
                    self.on_start(vpp)

        return hook

    def _ends(self, vpp: int) -> Callable:
        def hook(cell: ms.nn.Cell, args: Any, output: Any) -> None:
            self._running[vpp] = max(self._running[vpp] - 1, 0)
            if self.active() and self._running[vpp] == 0 and self.on_end is not None:
                self.on_end(vpp)

        return hook

    def inside(self, vpp: int) -> bool:
        """Whether a call of the chunk's root is running."""
        return self._running[vpp] > 0

    def training(self, vpp: int) -> bool:
        """Whether a training call of the chunk's root is running: the root's call decides for
        the Cells it calls, as a recomputed Cell (``Cell.recompute()``) runs its first forward
        without recording gradients; its recomputation in the backward pass is outside the call."""
        return self._running[vpp] > 0 and self._training[vpp]

    def micro_of(self, vpp: int) -> int:
        return max(self._micro[vpp], 0)

    def counted(self) -> int:
        """Micro-steps counted so far in the step (the most of any chunk)."""
        return max(self._micro, default=-1) + 1

    def reset(self) -> None:
        self._micro = [-1] * len(self.chunks)
        self._running = [0] * len(self.chunks)
        self._training = [False] * len(self.chunks)


class Activations:
    """Hooks on selected Cells; statistics taken in batches, kept on the device until the step is written."""

    def __init__(
        self,
        chunks: Sequence[ms.nn.Cell],
        cells: list[HookedCell],
        engine: StatEngine,
        forward: bool,
        backward: bool,
        on_error: Callable[[str, BaseException], None],
        jit: LeftOutOfJit,
        unended: UnendedStep | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.cells = cells
        self.unended = unended
        self.engine = engine
        self.forward = forward
        self.backward = backward
        self.on_error = on_error
        #: set by the collection before each step's forward: the hooks do nothing when False.
        self.collect = False
        self.roots = RootCalls(
            self.chunks,
            lambda: self.collect,
            jit,
            on_start=self._micro_step_started,
            on_end=lambda vpp: self._guard("actv", self._held["actv"].describe, self.engine),
        )
        self._calls: dict[tuple[int, int], int] = {}
        self._held = {prefix: HeldTensors() for prefix in PREFIXES}
        #: id -> (the tensor, weakly; the gradient rows its one hook fills): a Cell's output is
        #: usually the next one's input, and each ``register_hook`` costs most of a millisecond
        self._watched: dict[int, tuple[weakref.ref, list[tuple[int, str, int]]]] = {}
        self._leaves = LeafGradients(self._measure_grad)

    def register(self) -> list:
        """Register the hooks; returns removable handles.

        Per chunk root: the micro-step counter first (prepended) and the end of its call last
        (after the Cells' own hooks, also when the forward raises).
        """
        jit = self.roots.jit

        def hooks() -> list:
            handles = self.roots.register_starts()
            for index, entry in enumerate(self.cells):
                before, after = jit.cell_hook(self._before(index)), jit.cell_hook(self._after(index))
                handles.append(entry.cell.register_forward_pre_hook(before, with_kwargs=True))
                handles.append(entry.cell.register_forward_hook(after, with_kwargs=True))
            return [*handles, *self.roots.register_ends(), self._leaves]

        return jit.keep(hooks)

    def _micro_step_started(self, vpp: int) -> None:
        """The gradients of the last micro-step are complete: measured; in a step the gradients
        took for one that never ends, the rows held so far are dropped (the latest are kept)."""
        self._guard("actv_grad", self._held["actv_grad"].describe, self.engine)
        if self.unended is not None and self.unended.now:
            self._guard("actv", self._forget_rows)

    def _forget_rows(self) -> None:
        self._calls.clear()
        self._watched.clear()
        self._leaves.remove()
        for held in self._held.values():
            held.blocks.clear()

    # -- hooks -------------------------------------------------------------------------------

    def _recorded(self, entry: HookedCell) -> bool:
        return self.roots.training(entry.vpp_stage)

    def _before(self, index: int) -> Callable:
        def hook(cell: ms.nn.Cell, args: tuple, kwargs: dict) -> None:
            entry = self.cells[index]
            if self.collect and self._recorded(entry):
                inputs = (*args, *kwargs.values()) if kwargs else args
                masks = mask_ids(args, kwargs, entry.mask_positions, is_tensor)
                self._guard("actv", self._observe, index, "input", inputs, False, masks)

        return hook

    def _after(self, index: int) -> Callable:
        def hook(cell: ms.nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
            entry = self.cells[index]
            if self.collect and self._recorded(entry):
                self._guard("actv", self._observe, index, "output", output, True)

        return hook

    def _observe(
        self, index: int, direction: str, obj: Any, call_done: bool, masks: AbstractSet[int] = frozenset()
    ) -> None:
        entry = self.cells[index]
        micro = self.roots.micro_of(entry.vpp_stage)
        tensors = direction_tensors(entry.name, entry.formats, entry.warned, direction, obj, is_tensor)
        name = f"{call_name(entry.name, self._calls.get((index, micro), 0))}.{direction}"
        if tensors and self.forward:
            self._hold("actv", entry.vpp_stage, row_names(name, len(tensors)), micro, tensors, masks)
        if tensors and self.backward and grad_active():
            for tensor, row in zip(tensors, row_names(f"{name}_grad", len(tensors))):
                if takes_part_in_grad(tensor):
                    self._watch(tensor, (entry.vpp_stage, row, micro))
        if call_done:
            self._calls[(index, micro)] = self._calls.get((index, micro), 0) + 1

    def _watch(self, tensor: ms.Tensor, row: tuple[int, str, int]) -> None:
        """The tensor's gradient fills ``row``: one hook per tensor, naming every row that watches
        it; a Parameter returned or received outlives the backward pass, and so would its hook."""
        if isinstance(tensor, ms.Parameter):
            self._leaves.watch(tensor, row, None)
            return
        watched = self._watched.get(id(tensor))
        if watched is not None and watched[0]() is tensor:
            watched[1].append(row)
            return
        rows = [row]
        self._watched[id(tensor)] = (weakref.ref(tensor), rows)
        tensor.register_hook(functools.partial(self._measure_grad, rows, None))

    def _measure_grad(self, rows: list[tuple[int, str, int]], tag: None, grad: ms.Tensor) -> ms.Tensor:
        """A watched tensor's gradient hook: the gradient fills each row naming it (``tag``, a
        mesh's on torch, is None here: the signature is LeafGradients' ``measure``)."""
        if self.collect:
            for vpp, name, micro in rows:  # held once per row, measured once
                self._guard("actv_grad", self._hold, "actv_grad", vpp, [name], micro, [grad])
        return grad  # MindSpore wants the gradient back; the same tensor changes nothing

    def _hold(
        self,
        prefix: str,
        vpp: int,
        names: list[str],
        micro: int,
        tensors: list[ms.Tensor],
        masks: AbstractSet[int] = frozenset(),
    ) -> None:
        held = self._held[prefix]
        held.add(vpp, names, micro, tensors, masks)
        if held.numel > HOLD_MAX:
            held.describe(self.engine)

    def _guard(self, part: str, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.collect = False
            self.on_error(part, exc)

    # -- the step ----------------------------------------------------------------------------

    def micro_batches(self) -> int:
        """Micro-batches the step's forwards counted so far."""
        return self.roots.counted()

    def take(self, rank: int) -> list[tuple[str, RowSet, ms.Tensor]]:
        """This step's records: ``(prefix, rows, statistics)`` for actv and actv_grad; resets."""
        out = []
        for prefix in PREFIXES:
            held = self._held[prefix]
            held.describe(self.engine)
            if held.blocks:
                rows = [row for block_rows, _, _ in held.blocks for row in block_rows]
                unjudged = [flag for _, block_flags, _ in held.blocks for flag in block_flags]
                matrices = [matrix for _, _, matrix in held.blocks]
                vpp, names, micro = zip(*rows)
                matrix = matrices[0] if len(matrices) == 1 else ops.concat(matrices)
                out.append((prefix, RowSet.build(vpp, names, rank, prefix, micro, unjudged), matrix))
        self.reset()
        return out

    def reset(self) -> None:
        """Forget the step (a Cell that does not run in a step has no row for it)."""
        self.roots.reset()
        self._calls.clear()
        self._watched.clear()
        self._leaves.remove()
        self._held = {prefix: HeldTensors() for prefix in PREFIXES}
