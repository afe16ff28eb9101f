"""Per-step totals of collective calls: exact merging of per-tensor statistics (numpy only).

A collective argument may hold several tensors (a list, the tensors of P2POps) and a row of the
output covers every call of one (op, pre/post, argument index, call site) in one step. Both
merges are exact, as if the statistic were taken over the concatenation of all the data:
``norm`` = sqrt(sum of squares), ``min``/``max`` of the non-empty parts, ``mean`` and ``zeros``
weighted by element counts, ``nans`` summed, ``id`` the value when the whole row holds exactly
one element (else NaN), and ``calls`` the number of calls. NaN and Inf propagate as numpy
propagates them over the concatenated data; empty data gives NaN for min/max/mean/zeros/id and
0 for norm/nans (the convention of the adapters' statistics).

Framework-free: the torch and MindSpore adapters both merge and name their ``comm`` rows here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

#: running fields of one row; the first six are sums.
CALLS, NUMEL, SUMSQ, SUM, ZEROS, NANS, MIN, MAX = range(8)
_SUMS = slice(CALLS, NANS + 1)
_EMPTY = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, np.inf, -np.inf])

#: the per-tensor statistic (from stat_matrix) each output op is merged from.
_NEEDS = {"norm": "norm", "min": "min", "max": "max", "mean": "mean", "zeros": "zeros", "nans": "nans"}
_NEEDS["id"] = "mean"  # a row of exactly one element: its mean is its value


def row_name(op: str, phase: str, k: int, site: str | None) -> str:
    """Name of a ``comm`` row: ``{op}.{pre|post}_{k}``, with ``@{file}[{line}]`` of its call site if any."""
    return f"{op}.{phase}_{k}" + (f"@{site}" if site else "")


def stat_ops_for(ops: Sequence[str]) -> tuple[str, ...]:
    """The per-tensor statistics to compute so that ``ops`` can be merged exactly."""
    needed = {_NEEDS[op] for op in ops}
    return tuple(stat for stat in ("norm", "min", "max", "mean", "zeros", "nans") if stat in needed)


def summarise(stats: np.ndarray, numel: np.ndarray, stat_ops: Sequence[str]) -> np.ndarray:
    """Running fields of one call's argument from its tensors' statistics.

    Args:
        stats: (tensors, len(stat_ops)) float64, rows from ``stat_matrix``.
        numel: element count of each tensor.
        stat_ops: the columns of ``stats``.
    """
    part = _EMPTY.copy()
    part[CALLS] = 1.0
    part[NUMEL] = numel.sum()
    col = {op: stats[:, i] for i, op in enumerate(stat_ops)}
    if "norm" in col:
        part[SUMSQ] = np.sum(col["norm"] ** 2)
    if "nans" in col:
        part[NANS] = col["nans"].sum()
    full = numel > 0
    if not full.any():
        return part
    if "min" in col:
        part[MIN] = np.min(col["min"][full])
    if "max" in col:
        part[MAX] = np.max(col["max"][full])
    if "mean" in col:
        part[SUM] = np.sum(col["mean"][full] * numel[full])
    if "zeros" in col:
        part[ZEROS] = np.sum(col["zeros"][full] * numel[full])
    return part


def merge(total: np.ndarray, part: np.ndarray) -> None:
    """Fold one call's fields into a row's running fields (in place)."""
    total[_SUMS] += part[_SUMS]
    total[MIN] = np.minimum(total[MIN], part[MIN])
    total[MAX] = np.maximum(total[MAX], part[MAX])


def finish(fields: np.ndarray, ops: Sequence[str]) -> np.ndarray:
    """Output values (rows, len(ops) + 1) from running fields (rows, 8); the last column is ``calls``."""
    numel = fields[:, NUMEL]
    empty = numel == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(empty, np.nan, fields[:, SUM] / numel)
        columns = {
            "norm": np.sqrt(fields[:, SUMSQ]),
            "min": np.where(empty, np.nan, fields[:, MIN]),
            "max": np.where(empty, np.nan, fields[:, MAX]),
            "mean": mean,
            "zeros": np.where(empty, np.nan, fields[:, ZEROS] / numel),
            "nans": fields[:, NANS],
            "id": np.where(numel == 1, mean, np.nan),
        }
    return np.column_stack([*(columns[op] for op in ops), fields[:, CALLS]]).astype(np.float64)


class StepTotals:
    """The rows of one step: running fields per key, in the order keys were first seen."""

    def __init__(self) -> None:
        self._rows: dict[Hashable, np.ndarray] = {}

    def add(self, key: Hashable, part: np.ndarray) -> None:
        total = self._rows.get(key)
        if total is None:
            self._rows[key] = part.copy()
        else:
            merge(total, part)

    def __len__(self) -> int:
        return len(self._rows)

    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._rows)

    def values(self, ops: Sequence[str]) -> np.ndarray:
        """Output values of every row (see ``finish``)."""
        if not self._rows:
            return np.empty((0, len(ops) + 1))
        return finish(np.stack(list(self._rows.values())), ops)
