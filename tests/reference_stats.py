"""The independent reference for every recorded statistic: numpy, in float64, on a copy."""

from __future__ import annotations

import numpy as np
import pytest

ALL_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]


def numpy_stats(array: np.ndarray, eps: float = 1e-8) -> dict[str, float]:
    """The reference computation: statistics of a numpy copy, in float64."""
    a = np.asarray(array, dtype=np.float64).ravel()
    if a.size == 0:
        return {"min": np.nan, "max": np.nan, "norm": 0.0, "mean": np.nan, "zeros": np.nan, "nans": 0.0}
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "min": float(np.min(a)),
            "max": float(np.max(a)),
            "norm": float(np.sqrt(np.sum(a * a))),
            "mean": float(np.mean(a)),
            "zeros": float(np.mean(np.abs(a) < eps)),
            "nans": float(np.isnan(a).sum()),
        }


def assert_stats_close(
    got: dict[str, float], array: np.ndarray, ops=ALL_OPS, eps: float = 1e-8, what: str = ""
):
    """Every op of ``got`` equals numpy's on ``array`` (float32 accumulation tolerance)."""
    want = numpy_stats(array, eps)
    scale = float(np.max(np.abs(array))) if np.size(array) and np.isfinite(array).all() else 0.0
    for op in ops:
        g, w = got[op], want[op]
        if np.isnan(w):
            assert np.isnan(g), f"{what} {op}: got {g}, numpy {w}"
        elif op == "mean":
            assert g == pytest.approx(w, rel=1e-5, abs=1e-6 * scale + 1e-12), f"{what} {op}"
        else:
            assert g == pytest.approx(w, rel=1e-5, abs=1e-12), f"{what} {op}: got {g}, numpy {w}"
