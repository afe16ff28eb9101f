"""print_struct and stack_info outputs, framework-free: structure records, call stacks, their files.

The adapters record on each module's first call (what it received and returned, where it was
called from) and hand the results here, so that ``module_struct.json`` and ``stack_info.csv``
are written alike for every framework. Stacks are kept as (file, line, function) frames; their
source lines are read once, when the file is written, never per call.
"""

from __future__ import annotations

import csv
import io
import json
import linecache
import os
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from monitor.files import atomic_write_text, make_private_dir

Frame = tuple[str, int, str]


#: what a recorder reports a failure of its hooks to: ``on_error(part, exc)`` (the collection's
#: ``fail``, which logs it once and switches the part off)
OnError = Callable[[str, BaseException], None]


class HookGuard:
    """Contains the failures of one recorder's hooks: the first goes to ``on_error`` with its
    part's name, and every hook of the recorder does nothing from then on; the training's call
    never sees one."""

    def __init__(self, what: str, on_error: OnError) -> None:
        self.what = what
        self.on_error = on_error
        self.failed = False

    def wrap(self, hook: Callable[..., Any], passthrough: bool = False) -> Callable[..., Any]:
        """``hook`` guarded; with ``passthrough`` a failed or switched-off call returns its first
        argument (a gradient hook whose result replaces the gradient)."""

        def guarded(*args: Any) -> Any:
            if not self.failed:
                try:
                    return hook(*args)
                except Exception as exc:
                    self.failed = True
                    self.on_error(self.what, exc)
            return args[0] if passthrough else None

        return guarded


def describe(obj: Any, is_tensor: Callable[[Any], bool], tensor_text: Callable[[Any], str]) -> dict[str, Any]:
    """msprobe's structure record of one object.

    ``tensor_text(t)`` renders a tensor as ``size=(...), dtype=...``.
    """

    def item(value: Any) -> str:
        return tensor_text(value) if is_tensor(value) else str(type(value))

    if is_tensor(obj):
        return {"config": "tensor", "tensor": tensor_text(obj)}
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {"config": f"{kind}[{len(obj)}]", **{str(i): item(v) for i, v in enumerate(obj)}}
    if isinstance(obj, dict):
        return {"config": f"dict[{len(obj)}]", **{str(k): item(v) for k, v in obj.items()}}
    return {"config": str(type(obj))}


def record_grad(entry: dict[str, Any], direction: str, index: int, count: int, text: str) -> None:
    """Note the gradient of the ``index``-th of ``count`` tensors of ``direction`` (``input_grad``...)."""
    entry.setdefault(direction, {"config": f"tuple[{count}]"})[str(index)] = text


def write_structure(root: str, rank: int, structure: dict[str, dict[str, Any]]) -> str:
    """Write ``module_struct/rank{R}/module_struct.json`` under root atomically; returns its path."""
    directory = make_private_dir(os.path.join(root, "module_struct", f"rank{rank}"), under=root)
    path = os.path.join(directory, "module_struct.json")
    atomic_write_text(path, json.dumps(structure, indent=2))
    return path


def stack_frames(frame: FrameType | None) -> list[Frame]:
    """(file, line, function) of ``frame`` and every frame that called it, innermost first."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def write_stacks(directory: str, stacks: dict[str, list[Frame]]) -> str | None:
    """Write ``stack_info.csv`` (``module_name,stack_info``) only if absent; returns its path or None."""
    path = os.path.join(directory, "stack_info.csv")
    if os.path.exists(path):
        return None
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["module_name", "stack_info"])
    for name, frames in stacks.items():
        blocks = []
        for filename, line, function in frames:
            code = linecache.getline(filename, line).strip()
            if code:
                blocks.append(f"File {filename}, line {line}, in {function}, \n {code} \n")
        writer.writerow([name, "".join(blocks)])
    atomic_write_text(path, buffer.getvalue())
    return path


class StackRecorder:
    """stack_info: per module (or Cell), the call stack of its first forward; frames only, their
    source read when the file is written. Any framework whose modules take
    ``register_forward_pre_hook(hook(module, args))`` works."""

    def __init__(
        self,
        modules: Sequence[tuple[str, Any]],
        on_error: OnError,
        traced: Callable[[], bool] = lambda: False,
    ) -> None:
        """``modules``: (display name, module) pairs, in the order they are written; ``traced``:
        whether a compiler is tracing the hook rather than running it (then it records nothing)."""
        self.modules = list(modules)
        self.stacks: dict[str, list[Frame]] = {}
        self._guard = HookGuard("stack_info", on_error)
        self._traced = traced

    def register(self) -> list:
        return [module.register_forward_pre_hook(self._hook(name)) for name, module in self.modules]

    def _hook(self, name: str) -> Callable[[Any, Any], None]:
        def hook(module: Any, args: Any) -> None:
            if not self._traced() and name not in self.stacks:
                self.stacks[name] = stack_frames(sys._getframe(3))  # above the guard's frame

        return self._guard.wrap(hook)

    def write(self, directory: str) -> str | None:
        """Write ``stack_info.csv`` (only if absent); returns its path or None."""
        return write_stacks(directory, self.stacks)
