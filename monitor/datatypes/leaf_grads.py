"""Gradient hooks on leaf tensors that a module (or Cell) returns or receives, such as a Parameter
(Megatron's linear layers return their bias for a fused add later).

A computed tensor lives for one forward and backward pass, and so does a hook registered on it.
A leaf outlives them: a hook on it fires in every later backward pass it takes part in, so one
registered per micro-step measured each micro-batch's gradient under the rows of every earlier
micro-step (and step) again, piling up rows and hooks for the run's whole life. Here each leaf
gets one hook per step, handing each backward pass that reaches it the rows of the oldest
micro-step whose gradient has not come: backward passes run in the order of their forwards, also
under pipeline schedules. The adapter watches only in forwards that record gradients (not the
first pass of a reentrant activation checkpoint, nor an evaluation). Limits: a forward that
records gradients but that no backward pass follows (a micro-batch skipped on a NaN loss) shifts
the step's later rows of these leaves by one micro-step; and a reentrant checkpoint recomputed
under a pipeline schedule names its rows after the latest forward's micro-step, as every
activation row of such a recompute is named. The hooks are removed when the step ends.

Framework-free: a tensor is anything with ``register_hook(fn)`` whose handle has ``remove()``;
the hook gives the gradient back unchanged (MindSpore requires it, torch accepts it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

#: a row of the activations: (vpp_stage, name, micro_step)
Row = tuple[int, str, int]


@dataclasses.dataclass
class _Leaf:
    tensor: weakref.ref
    tag: Any
    #: per micro-step still waiting for its gradient, oldest first: ((vpp_stage, micro_step), rows)
    pending: collections.deque[tuple[tuple[int, int], list[Row]]] = dataclasses.field(
        default_factory=collections.deque
    )
    handle: Any = None


class LeafGradients:
    """The step's hooks on leaf tensors; ``measure(rows, tag, grad)`` takes a gradient's rows."""

    def __init__(self, measure: Callable[[list[Row], Any, Any], None]) -> None:
        self.measure = measure
        self._leaves: dict[int, _Leaf] = {}

    def watch(self, tensor: Any, row: Row, tag: Any) -> None:
        """Have ``row`` filled with the gradient ``tensor`` gets in its micro-step's backward pass."""
        leaf = self._leaves.get(id(tensor))
        if leaf is None or leaf.tensor() is not tensor:
            leaf = self._leaves[id(tensor)] = _Leaf(weakref.ref(tensor), tag)
            leaf.handle = tensor.register_hook(functools.partial(self._fired, leaf))
        micro = (row[0], row[2])
        if leaf.pending and leaf.pending[-1][0] == micro:
            leaf.pending[-1][1].append(row)
        else:
            leaf.pending.append((micro, [row]))

    def _fired(self, leaf: _Leaf, grad: Any) -> Any:
        if leaf.pending:
            _, rows = leaf.pending.popleft()
            self.measure(rows, leaf.tag, grad)
        return grad

    def remove(self) -> None:
        """Remove every hook (the step ended, or the monitor stops)."""
        for leaf in self._leaves.values():
            leaf.handle.remove()
        self._leaves.clear()
