"""Optimizer back-ends: for a parameter, where are its exp_avg, exp_avg_sq and step hooks.

One back-end per optimizer family, picked by class name. The generic one serves every
torch.optim optimizer whose state uses the keys ``exp_avg`` / ``exp_avg_sq`` (Adam, AdamW,
NAdam, RAdam, ...); others report no moments.
"""

from __future__ import annotations

from typing import Any

import torch


def hookable_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch.optim.Optimizer to hook: the object itself or the one it wraps (``.optimizer``).

    Raises:
        TypeError: nothing in the chain is a torch optimizer.
    """
    current, seen = optimizer, 0
    while current is not None and seen < 4:
        if isinstance(current, torch.optim.Optimizer):
            return current
        current, seen = getattr(current, "optimizer", None), seen + 1
    raise TypeError(
        f"set_monitor: optimizer: expected a torch.optim.Optimizer (or a wrapper with .optimizer), "
        f"got {type(optimizer).__name__}"
    )


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer's own count of updates (``state[p]["step"]`` of Adam-like optimizers), if any."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            return int(step)
    return None


class GenericBackend:
    """Moments from ``optimizer.state[param]``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def moment(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        """``exp_avg`` / ``exp_avg_sq`` of a parameter, or None before its first update."""
        state = self.optimizer.state.get(param)
        if not state:
            return None
        value = state.get(key)
        return value if isinstance(value, torch.Tensor) else None


BACKENDS: dict[str, type] = {}


def optimizer_backend(optimizer: torch.optim.Optimizer) -> GenericBackend:
    """The back-end registered for the optimizer's class name, else the generic one."""
    return BACKENDS.get(type(optimizer).__name__, GenericBackend)(optimizer)
