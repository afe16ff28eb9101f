"""One pass over a float buffer for min, max, sum, sum of squares, the count of |x| < eps and
(when needed) the NaN count.

The statistics of a CPU tensor otherwise take one library call per statistic (min, max, sum,
dot, and abs + compare + sum for the zero count): six or seven passes and as many dispatches.
The kernel (monitor/stats/_fused_stats.c, built by setup.py at install) reads every element once,
vectorised, with the GIL released. The extension is optional: where it was not built (no C
compiler) or TRAINMON_NO_FUSED_STATS is set, ``available()`` is False and callers keep their
library-call path. ``stats_at``, ``stats_rows`` and ``stats_many`` read memory by address (a
tensor's data pointer) instead of a buffer object: one call per hook, or one call for a whole
step's tensors.

Accuracy: sums accumulate in the buffer's precision over blocks of 16K elements spread over 32
independent lanes and combine in double, so a float32 sum over millions of elements keeps ~7
significant digits. Min and max are exact (signed zeros and infinities included). A NaN makes
min, max, sum and sum of squares NaN, and only then are NaNs counted (a second pass).
"""

from __future__ import annotations

import os

import numpy as np

try:
    from monitor.stats import _fused_stats
except ImportError:  # built without a C compiler: the library-call path is used
    _fused_stats = None

_SWITCHED_OFF = bool(os.environ.get("TRAINMON_NO_FUSED_STATS"))  # read once: this is a hot path


def available() -> bool:
    """Whether the compiled kernel is there and not switched off (TRAINMON_NO_FUSED_STATS=1 at import)."""
    return _fused_stats is not None and not _SWITCHED_OFF


def stats(
    array: np.ndarray, eps: float, bfloat16: bool = False
) -> tuple[float, float, float, float, int, int]:
    """(min, max, sum, sum of squares, count of |x| < eps, NaN count) of a non-empty C-contiguous
    float32/float64 array (any shape), or with ``bfloat16`` of an int16 array holding bfloat16
    bit patterns (numpy has no bfloat16). Requires ``available()``."""
    return _fused_stats.stats(array, eps, bfloat16)


#: element kinds of the address entries
FLOAT32, FLOAT64, BFLOAT16 = 0, 1, 2


def stats_at(address: int, count: int, kind: int, eps: float) -> tuple[float, float, float, float, int, int]:
    """The ``stats`` tuple of ``count`` (> 0) contiguous elements of ``kind`` at ``address``: memory
    the caller keeps alive while this runs (a tensor it holds). No buffer object is made, which
    matters where it runs once per parameter (a gradient hook). Requires ``available()``."""
    return _fused_stats.stats_rows(address, count, 1, count, kind, eps)


def stats_rows(
    address: int, run: int, rows: int, stride: int, kind: int, eps: float
) -> tuple[float, float, float, float, int, int]:
    """The ``stats_at`` tuple of ``rows`` runs of ``run`` contiguous elements, ``stride`` (>= run)
    elements apart: a strided view (a piece of a split, a slice of rows) read in place instead
    of copied first. Requires ``available()``."""
    return _fused_stats.stats_rows(address, run, rows, stride, kind, eps)


def stats_into(address: int, count: int, kind: int, eps: float, out: np.ndarray, row: int) -> None:
    """``stats_at`` written into row ``row`` of a float64 (rows, 6) array (bounds checked): a hook
    measuring one tensor makes no object at all. Requires ``available()``."""
    _fused_stats.stats_into(address, count, kind, eps, out, row)


def stats_many(addresses: np.ndarray, counts: np.ndarray, kind: int, eps: float) -> np.ndarray:
    """Float64 (n, 6): the ``stats`` tuple of each of n buffers of one kind, in one call with the
    GIL released (int64 addresses and counts > 0; memory the caller keeps alive). One call for a
    whole step's tensors: no Python work per tensor. Requires ``available()``."""
    out = np.empty((len(addresses), 6), dtype=np.float64)
    _fused_stats.stats_many(addresses, counts, kind, eps, out)
    return out


def sign_sums_many(first: np.ndarray, second: np.ndarray, counts: np.ndarray, kind: int) -> np.ndarray:
    """Float64 (n,): for each pair of buffers of one kind, the sum of sign(x) * sign(y) over their
    elements (the sign of a NaN is 0, as torch.sign gives it), in one call with the GIL released: how far a
    gradient and a moment agree in sign. Requires ``available()``."""
    out = np.empty(len(first), dtype=np.float64)
    _fused_stats.sign_sums_many(first, second, counts, kind, out)
    return out
