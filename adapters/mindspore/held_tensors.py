"""Activation tensors of one direction held until their statistics are taken together.

PyNative runs every operation separately, so a chunk's forward tensors (or a step's activation
gradients) are described together, each distinct tensor once, by the statistics engine
(``adapters.mindspore.stats``); see ``adapters.mindspore.activations``.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import mindspore as ms
import numpy as np
from mindspore import ops

from adapters.mindspore.stats import StatEngine

#: the dtypes of tensors that are data, not computed values (token ids, labels, boolean masks)
_INTEGER_TYPES = frozenset((*ms.dtype.int_type, *ms.dtype.uint_type, ms.bool_))


class HeldTensors:
    """Tensors of one direction waiting for their statistics, with their row labels."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, int]] = []
        #: per row, whether its tensor holds integers or booleans or is a mask argument (data the
        #: rules leave alone)
        self.unjudged: list[bool] = []
        self.tensors: list[ms.Tensor] = []
        self.numel = 0
        #: statistics already taken this step: (rows, their unjudged flags, float64 matrix on the device).
        self.blocks: list[tuple[list[tuple[int, str, int]], list[bool], ms.Tensor]] = []

    def add(
        self,
        vpp: int,
        names: list[str],
        micro: int,
        tensors: list[ms.Tensor],
        masks: AbstractSet[int] = frozenset(),
    ) -> None:
        """Hold ``tensors`` for the rows ``names``; ``masks``: ids of those passed as a mask."""
        self.rows.extend((vpp, name, micro) for name in names)
        self.unjudged.extend(t.dtype in _INTEGER_TYPES or id(t) in masks for t in tensors)
        self.tensors.extend(tensors)
        self.numel += sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)

    def describe(self, engine: StatEngine) -> None:
        """Statistics of the held tensors, each distinct tensor measured once (a Cell's output
        is often the next Cell's input: the same tensor, held for two rows)."""
        if not self.tensors:
            return
        position: dict[int, int] = {}
        slots = [position.setdefault(id(t), len(position)) for t in self.tensors]
        if len(position) == len(self.tensors):
            matrix = engine.matrix(self.tensors)
        else:
            distinct = list({id(t): t for t in self.tensors}.values())
            matrix = ops.gather(engine.matrix(distinct), ms.Tensor(np.array(slots, dtype=np.int32)), 0)
        self.blocks.append((self.rows, self.unjudged, matrix))
        self.rows, self.unjudged, self.tensors, self.numel = [], [], [], 0
