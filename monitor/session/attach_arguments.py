"""The checks of ``TrainerMon.set_monitor``'s arguments, each failing with the argument named."""

from __future__ import annotations

from typing import Any


def framework_of(model: Any) -> str:
    """'torch' or 'mindspore', from the model's class hierarchy (no framework import)."""
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    for cls in type(first).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if root in ("torch", "mindspore"):
            return root
    raise TypeError(
        f"set_monitor: model: expected a torch.nn.Module, a mindspore.nn.Cell or a list of them, "
        f"got {type(first).__name__}"
    )


def msprobe_argument_order(grad_acc_steps: Any, optimizer: Any) -> tuple[Any, Any]:
    """``(grad_acc_steps, optimizer)`` from either of msprobe's orders: ``(model, grad_acc_steps,
    optimizer)`` (1.2.2) or ``(model, optimizer, grad_acc_steps)`` (later versions)."""
    if not isinstance(grad_acc_steps, int) and (optimizer is None or isinstance(optimizer, int)):
        return (1 if optimizer is None else optimizer), grad_acc_steps
    return grad_acc_steps, optimizer


def check_counts(grad_acc_steps: Any, start_iteration: Any) -> None:
    """Raises ValueError unless grad_acc_steps >= 1 and start_iteration >= 0 are integers."""
    if isinstance(grad_acc_steps, bool) or not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
        raise ValueError(
            f"set_monitor: grad_acc_steps: expected an integer >= 1, got {_brief(grad_acc_steps)}"
        )
    if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
        raise ValueError(
            f"set_monitor: start_iteration: expected an integer >= 0, got {_brief(start_iteration)}"
        )


def _brief(value: Any, limit: int = 120) -> str:
    """``repr(value)``, or where that is long (a bound method of an engine prints the whole
    model) its type and the start of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{type(value).__name__} {text[:limit].splitlines()[0]}..."


def check_compilation(framework: str, graph_mode: Any, compiled: Any) -> None:
    """Raises ValueError for a ``graph_mode`` (MindSpore's) or ``compiled`` (PyTorch's) that is not
    a bool, or given for the other framework."""
    if graph_mode is not None and not isinstance(graph_mode, bool):
        raise ValueError(f"set_monitor: graph_mode: expected true, false or None, got {graph_mode!r}")
    if not isinstance(compiled, bool):
        raise ValueError(f"set_monitor: compiled: expected true or false, got {compiled!r}")
    if framework != "torch" and compiled:
        raise ValueError(
            "set_monitor: compiled: PyTorch only (a MindSpore step compiled with jit: "
            f"graph_mode=True), got {compiled!r}"
        )
    if framework == "torch" and graph_mode is not None:
        raise ValueError(
            "set_monitor: graph_mode: MindSpore only (torch.compile runs the monitor's hooks: "
            f"leave it out), got {graph_mode!r}"
        )
