"""What every anomaly rule shares: the state type, which columns a rule judges, and when a norm
that vanished was more than rounding noise."""

from __future__ import annotations

import numpy as np

State = dict[str, np.ndarray]


def op_columns(ops: tuple[str, ...] | None, op_names: tuple[str, ...]) -> np.ndarray:
    """Boolean row vector: which columns a rule looks at (``None``: all of them)."""
    return np.array([ops is None or op in ops for op in op_names], dtype=bool)[None, :]


#: a level this far below its record's median level is rounding noise: its vanishing is no sign
VANISHED_FLOOR = 1e-6


def above_rounding_noise(levels: np.ndarray, judged: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Which of ``cells`` have a level above ``VANISHED_FLOOR`` times the median level of their
    column's judged rows: a norm that vanishes from there is a dead layer, one that was 1e-9 of
    the others' (a gradient the data leaves at zero but for rounding) merely rounded to zero."""
    visible = np.ones(levels.shape, dtype=bool)
    usable = judged & np.isfinite(levels)  # a level a NaN/Inf entered tells nothing of the size
    for column in np.flatnonzero((cells & usable).any(axis=0)):
        typical = np.median(levels[usable[:, column], column])
        visible[:, column] = ~(levels[:, column] <= VANISHED_FLOOR * typical)
    return visible
