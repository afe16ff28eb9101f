"""print_struct and stack_info: what each module receives and returns, and where it is called from.

Both record on a module's first call only and cost nothing afterwards. The records, the stack
capture and the files are framework-free (``monitor.structure``); this module only hooks torch
modules and tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from adapters.torch.compiled import traced
from monitor.naming import chunk_name, display_name
from monitor.structure import HookGuard, OnError, StackRecorder, describe, record_grad, write_structure


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _tensor_text(t: torch.Tensor) -> str:
    return f"size={tuple(t.shape)}, dtype={t.dtype}"


def _module_names(chunks: Sequence[torch.nn.Module], squash: bool) -> list[tuple[str, torch.nn.Module]]:
    return [
        (chunk_name(vpp, display_name(raw, squash)), module)
        for vpp, chunk in enumerate(chunks)
        for raw, module in chunk.named_modules()
    ]


class StructureRecorder:
    """Records every module's input/output (and their gradients') structure on the first call."""

    def __init__(self, chunks: Sequence[torch.nn.Module], squash: bool, on_error: OnError) -> None:
        self.modules = _module_names(chunks, squash)
        self.structure: dict[str, dict[str, Any]] = {}
        self._guard = HookGuard("print_struct", on_error)

    def register(self) -> list:
        handles = []
        for name, module in self.modules:
            handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return handles

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if traced() or name in self.structure or not module.training:
                return
            inputs = (*args, *kwargs.values())
            entry = self.structure[name] = {
                "input": describe(inputs, _is_tensor, _tensor_text),
                "output": describe(output, _is_tensor, _tensor_text),
            }
            for direction, obj in (("input_grad", inputs), ("output_grad", output)):
                tensors = [t for t in (obj if isinstance(obj, (tuple, list)) else (obj,)) if _is_tensor(t)]
                for i, tensor in enumerate(tensors):
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(entry, direction, i, len(tensors)))

        return self._guard.wrap(hook)

    def _grad_hook(self, entry: dict, direction: str, index: int, count: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            record_grad(entry, direction, index, count, _tensor_text(grad))

        return self._guard.wrap(hook)

    def write(self, root: str, rank: int) -> str:
        """Write ``module_struct/rank{R}/module_struct.json`` under root; returns its path."""
        return write_structure(root, rank, self.structure)


def stack_recorder(chunks: Sequence[torch.nn.Module], squash: bool, on_error: OnError) -> StackRecorder:
    """stack_info: the call stack of each module's first forward (monitor.structure.StackRecorder)."""
    return StackRecorder(_module_names(chunks, squash), on_error, traced)
