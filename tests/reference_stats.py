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
    got: dict[str, float],
    array: np.ndarray,
    ops=ALL_OPS,
    eps: float = 1e-8,
    what: str = "",
    rel: float = 1e-5,
):
    """Every op of ``got`` equals numpy's on ``array`` (float32 accumulation tolerance, or ``rel``
    where the reference sums in another order, as a tensor-parallel matmul does)."""
    want = numpy_stats(array, eps)
    scale = float(np.max(np.abs(array))) if np.size(array) and np.isfinite(array).all() else 0.0
    for op in ops:
        g, w = got[op], want[op]
        if np.isnan(w):
            assert np.isnan(g), f"{what} {op}: got {g}, numpy {w}"
        elif op == "mean":
            assert g == pytest.approx(w, rel=rel, abs=rel * 0.1 * scale + 1e-12), f"{what} {op}"
        else:
            assert g == pytest.approx(w, rel=rel, abs=1e-12), f"{what} {op}: got {g}, numpy {w}"


#: non-finite, near-zero and huge inputs whose statistics must follow numpy's, by test id
NON_FINITE_VALUES = {
    "nan": [1.0, float("nan"), -3.0, 0.0],
    "inf": [1.0, float("inf"), -3.0],
    "-inf": [1.0, float("-inf"), 2.0],
    "inf-inf": [float("inf"), float("-inf")],
    "all-nan": [float("nan")] * 4,
    "zeros": [0.0, 0.0, 1e-9, -1e-9, 2.0],
    # finite, but their squares and sum overflow float32: numpy's float64 norm and mean are finite
    "huge": [3e38, 3e38, -1e37, 2.0],
    # normal float32, but their squares fall below its normal range
    "tiny": [1e-20, -3e-20, 2e-21, 0.0],
}


def assert_same_number(got: float, want: float, rel: float = 1e-6) -> None:
    """``got`` equals numpy's ``want``: NaN for NaN, the same infinity, else within ``rel``."""
    if np.isnan(want):
        assert np.isnan(got)
    elif np.isinf(want):
        assert got == want
    else:
        assert got == pytest.approx(want, rel=rel, abs=1e-12)


def sign_agreement(grad: np.ndarray, moment: np.ndarray) -> float:
    """The mg_direction reference: the share of elements where gradient and moment agree in sign."""
    g = np.sign(np.asarray(grad, dtype=np.float64))
    m = np.sign(np.asarray(moment, dtype=np.float64))
    return ((g * m).sum() / m.size + 1) / 2


def assert_mg_direction_row(row: dict[str, float], expected: float, what: str = "") -> None:
    """An mg_direction row describes one number: its mean, min and max are it, its norm is its size."""
    assert row["mean"] == pytest.approx(expected, abs=1e-12), what
    assert row["min"] == row["max"] == pytest.approx(expected, abs=1e-12)
    assert row["norm"] == pytest.approx(abs(expected), abs=1e-12)


def assert_plain_floats(metrics: dict[str, dict[str, float]]) -> None:
    """Metrics are there and every value is a built-in float (not a numpy or framework scalar)."""
    assert metrics
    assert all(type(v) is float for ops in metrics.values() for v in ops.values())


def update_histogram_reference(
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    step: float,
    betas: tuple[float, float],
    eps: float,
    bias_correction: bool = True,
) -> dict[str, tuple[np.ndarray, int]]:
    """ur_distribution's reference, per kind: numpy's 30 bucket counts over [-1, 1] of the finite
    values (those beyond in the edge buckets) and the NaN count, of Adam's update and of
    m/sqrt(v), the moments bias-corrected as the optimizer corrects them (or not)."""
    beta1, beta2 = betas
    m_hat = np.asarray(exp_avg, dtype=np.float64)
    root_v = np.sqrt(np.asarray(exp_avg_sq, dtype=np.float64))
    if bias_correction:
        m_hat, root_v = m_hat / (1 - beta1**step), root_v / np.sqrt(1 - beta2**step)
    edges = np.linspace(-1, 1, 31)
    with np.errstate(invalid="ignore", divide="ignore"):
        kinds = {"adam_update": m_hat / (root_v + eps), "adam_ratio": m_hat / root_v}
    return {
        kind: (np.histogram(np.clip(v[np.isfinite(v)], -1, 1), edges)[0], int(np.isnan(v).sum()))
        for kind, v in kinds.items()
    }


def read_histograms(output_dir: str) -> dict[tuple[str, int], tuple[np.ndarray, int]]:
    """{(tag, step): (bucket counts, NaN count)} of the TensorBoard histograms under output_dir,
    read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, SCALARS, EventAccumulator

    events = EventAccumulator(output_dir, size_guidance={HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    found = {}
    for tag in events.Tags()["histograms"]:
        nans = {e.step: int(e.value) for e in events.Scalars(f"{tag}_nans")}
        for event in events.Histograms(tag):
            found[(tag, event.step)] = (np.asarray(event.histogram_value.bucket), nans.get(event.step, 0))
    return found


def expected_attention(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """l2 attention features: per head of batch 0 of (batch, seq, heads, dim) Q and K, [softmax_max,
    entropy] of the causal softmax of QK^T / sqrt(d), in float64."""
    q, k = q[0].transpose(1, 0, 2).astype(np.float64), k[0].transpose(1, 0, 2).astype(np.float64)  # (h, s, d)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    seq = scores.shape[-1]
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return np.stack([p.max(axis=-1).mean(axis=-1), -plogp.sum(axis=-1).mean(axis=-1)], axis=1)
