"""ur_distribution, the framework-free part: the buckets, the histogram kinds, host histograms of
Adam's update and of m/sqrt(v), and how they are handed to the writers.

For a parameter with Adam state after this step's update, with its optimizer's betas and eps:
``m_hat = m / (1 - beta1^t)``, ``v_hat = v / (1 - beta2^t)``, ``update = m_hat / (sqrt(v_hat) +
eps)`` and ``ratio = m_hat / sqrt(v_hat)``. Each is binned into 30 buckets over [-1, 1] (finite
values beyond fall into the edge buckets), with NaN and Inf counted separately, so one bad value
never breaks the histogram. Histograms are written to TensorBoard only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.naming import build_tag

BINS = 30
EDGES = np.linspace(-1.0, 1.0, BINS + 1)
KINDS = ("adam_update", "adam_ratio")


def host_counts(values: np.ndarray) -> np.ndarray:
    """[bucket counts..., NaN count, Inf count] of one host array."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = np.isfinite(flat)
    counts = np.histogram(np.clip(flat[finite], -1.0, 1.0), EDGES)[0]
    return np.concatenate([counts, [np.isnan(flat).sum(), np.isinf(flat).sum()]]).astype(np.float64)


def adam_histograms(
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    step: float,
    beta1: float,
    beta2: float,
    eps: float,
    bias_correction: bool = True,
) -> np.ndarray:
    """(2, BINS + 2): the counts of Adam's update and of m/sqrt(v) (host arrays, float64), with
    the moments bias-corrected where the optimizer corrects them (not MindSpore's
    AdamWeightDecay, nor a DeepSpeed or apex Adam with ``bias_correction`` off)."""
    m_hat = np.asarray(exp_avg, dtype=np.float64)
    root_v = np.sqrt(np.asarray(exp_avg_sq, dtype=np.float64))
    if bias_correction:
        m_hat, root_v = m_hat / (1.0 - beta1**step), root_v / np.sqrt(1.0 - beta2**step)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack([host_counts(m_hat / (root_v + eps)), host_counts(m_hat / root_v)])


def update_ratio_written(config: Any) -> bool:
    """Whether ``ur_distribution``'s histograms are written: asked for, in TensorBoard files (the
    only format that holds histograms)."""
    return bool(config.ur_distribution) and config.format == "tensorboard"


def submit_histograms(
    core: Any,
    step: int,
    rank: int,
    labels: Sequence[tuple[int, str]],
    counts: np.ndarray | Callable[[], np.ndarray],
) -> None:
    """Hand one step's histograms to the core: ``labels`` (vpp_stage, name) per row of
    ``counts`` (rows, 2, BINS + 2), one tag per kind; ``counts`` may be a function that
    completes their copy from an accelerator, called once, on the writer thread."""
    resolved = functools.cache(counts) if callable(counts) else (lambda: counts)
    for kind_index, kind in enumerate(KINDS):
        tags = [build_tag(vpp, name, rank, kind) for vpp, name in labels]
        core.submit_histograms(step, tags, EDGES, lambda k=kind_index: resolved()[:, k])
