"""``RowBuffer``: statistics rows of tensors measured one at a time, by slot, with no Python
object per tensor (the gradient hooks of thousands of parameters)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from adapters.torch.in_place import in_place, kernel_parts, kernel_sweep
from adapters.torch.staged_stats import StagedRow
from adapters.torch.stats import stack_rows, stat_matrix, tensor_stats
from monitor.stats import fused_stats
from monitor.stats.host_stats import columns


class RowBuffer:
    """Statistics rows of tensors measured one at a time (a hook per parameter) or many at once
    (``put_many``: the gradients of a backward pass), by slot.

    A CPU tensor's kernel tuple goes straight into a preallocated float64 array: no Python
    object per tensor outlives the call, so hooks on thousands of parameters neither pay for
    building rows nor wake the garbage collector, whose passes grow with the number of live
    objects. Other tensors (accelerators, integer types, the ``id`` op) keep the row
    ``tensor_stats`` gives (an accelerator's: a ``StagedRow``, measured with its peers later).
    ``take`` returns the rows in the order they were put; a slot put again moves to the end.
    """

    def __init__(self, size: int, ops: Sequence[str], eps: float) -> None:
        self.ops = tuple(ops)
        self.eps = eps
        self._raw = np.empty((size, 6), dtype=np.float64)
        self._numel = np.zeros(size, dtype=np.float64)
        self._order: dict[int, None] = {}
        self._other: dict[int, list[float] | torch.Tensor | StagedRow] = {}
        self._direct = "id" not in self.ops

    def put(self, slot: int, t: torch.Tensor) -> None:
        """Measure ``t`` into ``slot`` (replacing what the slot held)."""
        self._order.pop(slot, None)
        self._order[slot] = None
        found = in_place(t) if self._direct else None
        if found is not None:
            flat, kind = found
            fused_stats.stats_into(flat.data_ptr(), flat.numel(), kind, self.eps, self._raw, slot)
            self._numel[slot] = flat.numel()
            self._other.pop(slot, None)
        else:
            self._other[slot] = tensor_stats(t, self.ops, self.eps)

    def put_many(self, slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """``put`` of each tensor into its slot, in order; the tensors the kernel reads in place
        go through one call per element kind."""
        order, other = self._order, self._other
        for slot in slots:
            order.pop(slot, None)
            order[slot] = None
        swept = kernel_sweep(tensors) if self._direct and tensors else None
        if swept is not None:  # the common case, in one sweep
            if other:
                for slot in slots:
                    other.pop(slot, None)
            self._raw[slots] = kernel_parts(*swept, self.eps)
            self._numel[slots] = swept[2]
            return
        direct: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        elsewhere: tuple[list[int], list[torch.Tensor]] = ([], [])
        for slot, t in zip(slots, tensors):
            found = in_place(t) if self._direct else None
            if found is None:
                elsewhere[0].append(slot)
                elsewhere[1].append(t)
                continue
            if other:
                other.pop(slot, None)
            kind_slots, flats = direct.setdefault(found[1], ([], []))
            kind_slots.append(slot)
            flats.append(found[0])
        if elsewhere[0]:  # accelerator tensors: one packed call (a few launches) for all of them
            matrix = stat_matrix(elsewhere[1], self.ops, self.eps)
            rows = matrix.tolist() if matrix.device.type == "cpu" else matrix.unbind(0)
            other.update(zip(elsewhere[0], rows))
        for kind, (kind_slots, flats) in direct.items():
            counts = [t.numel() for t in flats]
            self._raw[kind_slots] = kernel_parts(kind, [t.data_ptr() for t in flats], counts, self.eps)
            self._numel[kind_slots] = counts

    def clear(self) -> None:
        """Forget every row."""
        self._order, self._other = {}, {}

    def drop(self, slot: int) -> None:
        """Forget the slot's row."""
        self._order.pop(slot, None)
        self._other.pop(slot, None)

    def take(self) -> tuple[list[int], torch.Tensor]:
        """The slots in the order they were put and their (n, len(ops)) rows; the buffer empties."""
        order, other = list(self._order), self._other
        self._order, self._other = {}, {}
        width = len(self.ops)
        if not order:
            return order, torch.empty((0, width), dtype=torch.float64)
        direct = [slot for slot in order if slot not in other] if other else order
        values = columns(self._raw[direct], self._numel[direct], self.ops) if direct else None
        if not other:
            return order, torch.from_numpy(values)
        rows = dict(zip(direct, values.tolist())) if direct else {}
        return order, stack_rows([other[slot] if slot in other else rows[slot] for slot in order], width)
