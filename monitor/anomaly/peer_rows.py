"""The statistics of one block of (tensor x step) rows x ranks for the cross-rank analysis.

Per row: the median of the finite values, their median magnitude (``size``), each value's peers'
median (the median of the OTHER finite values of its row) and its distance to it
(``deviation``), and the median of those distances (``mad``). Rows where every rank holds a
finite value (the usual case) take a fast path: the compiled kernel (monitor/anomaly/_peer_rows.c)
on rows sorted by numpy, or where it was not built, three numpy partitions; the others sort each
row with its missing and non-finite values last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:
    from monitor.anomaly import _peer_rows
except ImportError:  # built without a C compiler: numpy partitions instead
    _peer_rows = None

#: finite values a row needs for a verdict on a value's size: of two ranks neither can be told
#: to be the odd one, and of three each rank's peers are two whose median is their mean, so an
#: outlier lifts the other two ranks' deviations to half its own and the step's MAD with them:
#: no value can then lie more than about 2 MADs off
MIN_RANKS = 4
#: ranks holding a tensor that a NaN/Inf verdict needs: the non-finite one and one finite peer
MIN_RANKS_NONFINITE = 2


def _order_stat(sorted_rows: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of the first ``count`` entries of each sorted row (NaN where count is 0)."""
    low = np.take_along_axis(sorted_rows, np.maximum((count - 1) // 2, 0)[:, None], axis=1)[:, 0]
    high = np.take_along_axis(sorted_rows, np.maximum(count // 2 - (count == 0), 0)[:, None], axis=1)[:, 0]
    return np.where(count > 0, (low + high) / 2.0, np.nan)


@dataclass
class PeerStats:
    """Per row (a tensor at a step) and column (a rank) of one block."""

    finite: np.ndarray
    count: np.ndarray
    median: np.ndarray
    size: np.ndarray
    peers: np.ndarray
    deviation: np.ndarray
    mad: np.ndarray


def peer_stats(values: np.ndarray, present: np.ndarray) -> PeerStats:
    """Median, leave-one-out peer medians, deviations and MAD of a (rows x ranks) block.

    Only finite present values take part; a NaN/Inf value's peers are all finite values of its row.
    Rows where every rank holds a finite value (the usual case) take a selection-based fast path.
    """
    finite = present & np.isfinite(values)
    count = finite.sum(axis=1)
    median, size, mad = np.empty(len(values)), np.empty(len(values)), np.empty(len(values))
    peers, deviation = np.empty(values.shape), np.empty(values.shape)
    full = count == values.shape[1] if values.shape[1] >= MIN_RANKS else np.zeros(len(values), dtype=bool)
    for rows, method in ((full, _full_rows), (~full, _partial_rows)):
        if rows.all():
            median, size, peers, deviation, mad = method(values, finite, count)
        elif rows.any():
            median[rows], size[rows], peers[rows], deviation[rows], mad[rows] = method(
                values[rows], finite[rows], count[rows]
            )
    return PeerStats(finite, count, median, size, peers, deviation, mad)


def _full_rows(values: np.ndarray, finite: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, ...]:
    """peer_stats of rows with n >= MIN_RANKS finite values: three order statistics per row suffice."""
    if not len(values):  # no such row (a run of fewer ranks): nothing to order, whatever n is
        empty = np.empty(0)
        return empty, empty, np.empty(values.shape), np.empty(values.shape), empty
    if _peer_rows is not None:
        values = np.ascontiguousarray(values, dtype=np.float64)
        rows, n = values.shape
        median, size, mad = np.empty(rows), np.empty(rows), np.empty(rows)
        peers, deviation = np.empty((rows, n)), np.empty((rows, n))
        _peer_rows.full_rows(rows, n, values, np.sort(values, axis=1), median, size, peers, deviation, mad)
        return median, size, peers, deviation, mad
    n = values.shape[1]
    middle = n // 2
    if n % 2 == 0:  # removing a value of the lower half leaves the upper middle, and vice versa
        part = np.partition(values, (middle - 1, middle), axis=1)
        low, high = part[:, middle - 1 : middle], part[:, middle : middle + 1]
        median = (low + high)[:, 0] / 2.0
        peers = np.where(values <= low, high, low)
    else:
        part = np.partition(values, (middle - 1, middle, middle + 1), axis=1)
        below, centre, above = (part[:, i : i + 1] for i in (middle - 1, middle, middle + 1))
        median = centre[:, 0]
        peers = np.where(values < centre, (centre + above) / 2.0, (below + centre) / 2.0)
        peers = np.where(values == centre, (below + above) / 2.0, peers)
    middles = (middle - 1 + n % 2, middle)
    if values.min(initial=0.0) >= 0:  # norms, shares, counts: the magnitudes are the values
        size = median
    else:
        size = np.partition(np.abs(values), middles, axis=1)[:, middles].mean(axis=1)
    deviation = np.abs(values - peers)
    mad = np.partition(deviation, middles, axis=1)[:, middles].mean(axis=1)
    return median, size, peers, deviation, mad


def _partial_rows(values: np.ndarray, finite: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, ...]:
    """peer_stats of rows with missing or non-finite values: sorted rows, per-row order statistics."""
    clean = np.where(finite, values, np.nan)
    order = np.argsort(clean, axis=1, kind="stable")  # NaN last
    ranked = np.take_along_axis(clean, order, axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(np.arange(values.shape[1]), order.shape), axis=1)
    median = _order_stat(ranked, count)
    # the median of the count - 1 others: indices into the sorted row with this rank's entry removed
    last = values.shape[1] - 1
    low, high = ((count[:, None] - 2) // 2), ((count[:, None] - 1) // 2)
    low = np.clip(low + (low >= position), 0, last)
    high = np.clip(high + (high >= position), 0, last)
    peers = (np.take_along_axis(ranked, low, axis=1) + np.take_along_axis(ranked, high, axis=1)) / 2.0
    peers = np.where(finite, peers, median[:, None])
    deviation = np.where(finite, np.abs(values - peers), np.nan)
    size = _order_stat(np.sort(np.abs(clean), axis=1), count)
    mad = _order_stat(np.sort(deviation, axis=1), count)
    return median, size, peers, deviation, mad
