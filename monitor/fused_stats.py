"""One pass over a float buffer for min, max, sum, sum of squares, the count of |x| < eps and
(when needed) the NaN count.

The statistics of a CPU tensor otherwise take one library call per statistic (min, max, sum,
dot, and abs + compare + sum for the zero count): six or seven passes and as many dispatches.
The kernel (monitor/_fused_stats.c, built by setup.py at install) reads every element once,
vectorised, with the GIL released. The extension is optional: where it was not built (no C
compiler) or TRAINMON_NO_FUSED_STATS is set, ``available()`` is False and callers keep their
library-call path.

Accuracy: sums accumulate in the buffer's precision over blocks of 16K elements spread over 32
independent lanes and combine in double, so a float32 sum over millions of elements keeps ~7
significant digits. Min and max are exact (signed zeros and infinities included). A NaN makes
min, max, sum and sum of squares NaN, and only then are NaNs counted (a second pass).
"""

from __future__ import annotations

import os

import numpy as np

try:
    from monitor import _fused_stats
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
