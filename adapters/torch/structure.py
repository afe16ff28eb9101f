"""print_struct and stack_info: what each module receives and returns, and where it is called from.

Both record on a module's first call only and cost nothing afterwards. Stacks are captured with a
frame walk (file, line, function) and their source lines are read once, when the file is written
(spec W3), never per call.
"""

from __future__ import annotations

import csv
import io
import json
import linecache
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from monitor.files import atomic_write_text, make_private_dir
from monitor.naming import chunk_name, display_name

logger = logging.getLogger("trainmon")


def describe(obj: Any) -> dict[str, Any]:
    """The reference's structure record of one object (spec §5.6)."""
    if isinstance(obj, torch.Tensor):
        return {"config": "tensor", "tensor": _tensor_text(obj)}
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {"config": f"{kind}[{len(obj)}]", **{str(i): _item_text(v) for i, v in enumerate(obj)}}
    if isinstance(obj, dict):
        return {"config": f"dict[{len(obj)}]", **{str(k): _item_text(v) for k, v in obj.items()}}
    return {"config": str(type(obj))}


def _tensor_text(t: torch.Tensor) -> str:
    return f"size={tuple(t.shape)}, dtype={t.dtype}"


def _item_text(obj: Any) -> str:
    return _tensor_text(obj) if isinstance(obj, torch.Tensor) else str(type(obj))


def _module_names(chunks: Sequence[torch.nn.Module], squash: bool) -> list[tuple[str, torch.nn.Module]]:
    return [
        (chunk_name(vpp, display_name(raw, squash)), module)
        for vpp, chunk in enumerate(chunks)
        for raw, module in chunk.named_modules()
    ]


class StructureRecorder:
    """Records every module's input/output (and their gradients') structure on the first call."""

    def __init__(self, chunks: Sequence[torch.nn.Module], squash: bool) -> None:
        self.modules = _module_names(chunks, squash)
        self.structure: dict[str, dict[str, Any]] = {}

    def register(self) -> list:
        handles = []
        for name, module in self.modules:
            handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return handles

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if name in self.structure or not module.training:
                return
            inputs = (*args, *kwargs.values())
            entry = self.structure[name] = {"input": describe(inputs), "output": describe(output)}
            for direction, obj in (("input_grad", inputs), ("output_grad", output)):
                tensors = [
                    t
                    for t in (obj if isinstance(obj, (tuple, list)) else (obj,))
                    if isinstance(t, torch.Tensor)
                ]
                for i, tensor in enumerate(tensors):
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(entry, direction, i, len(tensors)))

        return hook

    @staticmethod
    def _grad_hook(entry: dict, direction: str, index: int, count: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            record = entry.setdefault(direction, {"config": f"tuple[{count}]"})
            record[str(index)] = _tensor_text(grad)

        return hook

    def write(self, root: str, rank: int) -> str:
        """Write ``module_struct/rank{R}/module_struct.json`` under root; returns its path."""
        directory = make_private_dir(os.path.join(root, "module_struct", f"rank{rank}"))
        path = os.path.join(directory, "module_struct.json")
        atomic_write_text(path, json.dumps(self.structure, indent=2))
        return path


class StackRecorder:
    """Records, per module, the call stack of its first forward (frames only; source read at write)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], squash: bool) -> None:
        self.modules = _module_names(chunks, squash)
        self.stacks: dict[str, list[tuple[str, int, str]]] = {}

    def register(self) -> list:
        return [module.register_forward_pre_hook(self._hook(name)) for name, module in self.modules]

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if name in self.stacks:
                return
            frames, frame = [], sys._getframe(2)
            while frame is not None:
                frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
                frame = frame.f_back
            self.stacks[name] = frames

        return hook

    def write(self, directory: str) -> str | None:
        """Write ``stack_info.csv`` (only if absent); returns its path or None."""
        path = os.path.join(directory, "stack_info.csv")
        if os.path.exists(path):
            return None
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["module_name", "stack_info"])
        for name, frames in self.stacks.items():
            blocks = []
            for filename, line, function in frames:
                code = linecache.getline(filename, line).strip()
                if code:
                    blocks.append(f"File {filename}, line {line}, in {function}, \n {code} \n")
            writer.writerow([name, "".join(blocks)])
        atomic_write_text(path, buffer.getvalue())
        return path
