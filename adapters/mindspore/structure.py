"""print_struct and stack_info on MindSpore Cells: what each Cell receives and returns, and from where.

Both record on a Cell's first training call only (see ``activations.is_training_call``); the
records, the stack capture and the files are the torch adapter's (``monitor.structure``), so
``module_struct.json`` and ``stack_info.csv`` have the same layout. Tensors are described as
``size=(5, 4), dtype=Float32`` (MindSpore's dtype names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms

from adapters.mindspore.activations import grad_active, is_tensor, is_training_call, takes_part_in_grad
from adapters.mindspore.jit_guard import LeftOutOfJit
from monitor.naming import chunk_name, display_name
from monitor.structure import HookGuard, OnError, StackRecorder, describe, record_grad, write_structure


def _tensor_text(t: ms.Tensor) -> str:
    return f"size={tuple(t.shape)}, dtype={t.dtype}"


def _cell_names(chunks: Sequence[ms.nn.Cell], squash: bool) -> list[tuple[str, ms.nn.Cell]]:
    return [
        (chunk_name(vpp, display_name(raw, squash)), cell)
        for vpp, chunk in enumerate(chunks)
        for raw, cell in chunk.cells_and_names()
    ]


class StructureRecorder:
    """Records every Cell's input/output (and their gradients') structure on its first training call."""

    def __init__(
        self, chunks: Sequence[ms.nn.Cell], squash: bool, on_error: OnError, jit: LeftOutOfJit
    ) -> None:
        self.cells = _cell_names(chunks, squash)
        self.jit = jit
        self.structure: dict[str, dict[str, Any]] = {}
        self._guard = HookGuard("print_struct", on_error)

    def register(self) -> list:
        return self.jit.keep(
            lambda: [
                cell.register_forward_hook(self.jit.cell_hook(self._hook(name)), with_kwargs=True)
                for name, cell in self.cells
            ]
        )

    def _hook(self, name: str) -> Callable:
        def hook(cell: ms.nn.Cell, args: tuple, kwargs: dict, output: Any) -> None:
            if name in self.structure or not is_training_call(cell):
                return
            inputs = (*args, *kwargs.values())
            entry = self.structure[name] = {
                "input": describe(inputs, is_tensor, _tensor_text),
                "output": describe(output, is_tensor, _tensor_text),
            }
            if not grad_active():
                return
            for direction, obj in (("input_grad", inputs), ("output_grad", output)):
                tensors = [t for t in (obj if isinstance(obj, (tuple, list)) else (obj,)) if is_tensor(t)]
                for i, tensor in enumerate(tensors):
                    if takes_part_in_grad(tensor):
                        tensor.register_hook(self._grad_hook(entry, direction, i, len(tensors)))

        return self._guard.wrap(hook)

    def _grad_hook(self, entry: dict, direction: str, index: int, count: int) -> Callable:
        def hook(grad: ms.Tensor) -> ms.Tensor:
            record_grad(entry, direction, index, count, _tensor_text(grad))
            return grad

        return self._guard.wrap(hook, passthrough=True)

    def write(self, root: str, rank: int) -> str:
        """Write ``module_struct/rank{R}/module_struct.json`` under root; returns its path."""
        return write_structure(root, rank, self.structure)


class CellStacks(StackRecorder):
    """stack_info: the call stack of each Cell's first forward (monitor.structure.StackRecorder),
    its hooks left out of ``jit`` compilations."""

    def __init__(
        self, chunks: Sequence[ms.nn.Cell], squash: bool, on_error: OnError, jit: LeftOutOfJit
    ) -> None:
        super().__init__(_cell_names(chunks, squash), on_error)
        self.jit = jit

    def register(self) -> list:
        return self.jit.keep(super().register)

    def _hook(self, name: str) -> Callable[[Any, Any], None]:
        return self.jit.cell_hook(super()._hook(name))
