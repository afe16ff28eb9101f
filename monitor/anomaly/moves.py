"""How a data type's norms moved at a step, each against its own recent level: together (the
common move, clipping's or a loss scale's), and the one tensor that moved against a common fall.

The detector keeps the levels and flags ``MovedAlone`` from these; :mod:`monitor.anomaly.root`
words its evidence with the ratios they give each record.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from monitor.anomaly.root import ALONE_FACTOR
from monitor.datatypes.tasks import task_of_tags, tasks_of_prefix

#: the tasks of the gradients the optimizer takes (reduced, after clipping)
_REDUCED_TASKS = frozenset(tasks_of_prefix("grad_reduced"))
#: a data type's norms moved together when this many of them, and half of those known, lie
#: within a factor TOGETHER_FACTOR of their median move
MIN_TOGETHER, TOGETHER_FACTOR = 3, 2.0


def common_move(moves: np.ndarray) -> float:
    """The median move (log) of a data type's norms where they moved together (see
    MIN_TOGETHER), else NaN: a rank holding three pieces under ZeRO, one moved x483 and two
    their ordinary x1.5 and x2.2, is no rescaling of every tensor alike."""
    known = moves[np.isfinite(moves)]
    if known.size < MIN_TOGETHER:
        return math.nan
    common = float(np.median(known))
    near = int(np.count_nonzero(np.abs(known - common) <= math.log(TOGETHER_FACTOR)))
    return common if near >= max(MIN_TOGETHER, known.size / 2) else math.nan


def is_rescaled(record: Any) -> bool:
    """Whether a record's values are the gradients the optimizer takes, after clipping (their
    tags' task is reduced gradients'): the local ones are read before it, so a common fall there
    is no clipping but, say, a network whose units died, where the one tensor still moving is no
    culprit."""
    return task_of_tags(record.rows.tags) in _REDUCED_TASKS


def moved_alone(
    moves: np.ndarray, common: float, flagged: np.ndarray, level: np.ndarray, index: np.ndarray | None
) -> tuple[int, float] | None:
    """(row, baseline) of the norm that moved against its data type's common move, when that
    common move (the median over every row) is a fall by ALONE_FACTOR or more and was flagged
    somewhere: clipping or a loss scaler's back-off then shrank every tensor alike, and the
    tensor that caused it may itself look ordinary (clipped back to the usual size) while every
    other one is flagged; else None. A common rise has no such cause: the one tensor that stayed
    while the rest grew (a learning rate blowing up) is no culprit."""
    known = np.flatnonzero(np.isfinite(moves))
    limit = math.log(ALONE_FACTOR)
    if common > -limit:
        return None
    excess = np.abs(moves[known] - common)
    order = np.argsort(excess)[::-1]
    best, runner_up = excess[order[0]], excess[order[1]]
    row = int(known[order[0]])
    if best < limit or best - runner_up < limit or row in set(flagged.tolist()):
        return None
    return row, math.exp(float(level[row if index is None else index[row]]))
