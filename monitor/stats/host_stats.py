"""Statistics of host arrays, and the derivation of every op from the kernel's partial results.

Framework-free: an adapter whose tensors live in host memory hands their numpy views here
(MindSpore's ``asnumpy()`` of a CPU tensor is a view, not a copy); the torch adapter hands the
kernel tensor addresses itself and shares ``columns`` (many tensors) and ``kernel_row`` (one).

``array_matrix(arrays, ops, eps)``: float64 (len(arrays), len(ops)). float32, float64 and
bfloat16 arrays (numpy dtype named ``bfloat16``) are read in place by the one-pass kernel, all of
one kind in one call; float16 is widened to float32 in cache-sized chunks; integers and booleans
are widened to float64 chunk by chunk. Without the kernel, numpy does the same per chunk.

NaN/Inf policy (as the adapters'): min, max, norm and mean as numpy gives them on the same
data; ``nans`` counts NaN elements; ``zeros`` is the share of ``|x| < eps`` compared in float32
(float64 for float64 data); empty arrays give NaN for min/max/mean/zeros and 0 for norm/nans;
``id`` is the value of a one-element array, else NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from monitor.stats import fused_stats

#: the ops ``_derived`` gives, in its order, and where each lies
_DERIVED_OPS = ("min", "max", "mean", "norm", "zeros", "nans")
_POSITION = {op: index for index, op in enumerate(_DERIVED_OPS)}
#: the value of each op for an empty array
EMPTY_VALUE = {"norm": 0.0, "nans": 0.0}
#: a sum of squares below this per element may have lost the squares of values below about 1e-19
#: (under float32's normal range); it is taken again in float64 (as the C kernel's TINY_SQUARES)
TINY_SQUARES = 1e-30
#: elements per chunk where an array is widened (512 KiB of float32)
CHUNK = 1 << 17
_KINDS = {"float32": fused_stats.FLOAT32, "float64": fused_stats.FLOAT64, "bfloat16": fused_stats.BFLOAT16}


def _derived(parts: Sequence, numel: Any) -> tuple:
    """Every op of ``_DERIVED_OPS`` from the kernel's (min, max, sum, sum of squares, zero count,
    NaN count) and the element count: of one tensor (numbers) or of many at once (columns)."""
    low, high, total, squares, small, nans = parts
    return (low, high, total / numel, squares**0.5, small / numel, nans * 1.0)


def columns(
    parts: np.ndarray, numel: np.ndarray, ops: Sequence[str], identity: np.ndarray | None = None
) -> np.ndarray:
    """The (n, len(ops)) statistics of n kernel tuples (rows of ``parts``) and element counts."""
    every = _derived(parts.T, numel)
    return np.stack([identity if op == "id" else every[_POSITION[op]] for op in ops], axis=1)


def kernel_row(parts: tuple, numel: int, ops: Sequence[str]) -> list[float]:
    """One tensor's statistics in the order of ``ops`` (not ``id``) from its kernel tuple, as
    floats (a hook measures hundreds of tensors a step: no array per tensor)."""
    every = _derived(parts, numel)
    return [every[_POSITION[op]] for op in ops]


def float32_sums_lost(
    total: float, squares: float, numel: int, finite: bool | Callable[[], bool], nonzero: bool
) -> bool:
    """Whether float32 sums lost what float64 keeps, so that they are taken again in float64:
    finite values whose sum or squares overflowed (``finite`` says whether the values are; a
    callable is asked only then), or values so small, not all zero (``nonzero``), that their
    squares fell under float32's normal range (``TINY_SQUARES``)."""
    if not (math.isfinite(total) and math.isfinite(squares)):
        return finite() if callable(finite) else finite
    return nonzero and squares < numel * TINY_SQUARES


def _chunk_parts(array: np.ndarray, eps: float) -> tuple:
    """The kernel tuple of any non-empty array, widened chunk by chunk (float16, integers)."""
    flat = array.reshape(-1)
    wide = np.float64 if flat.dtype == np.float64 or flat.dtype.kind in "iub" else np.float32
    pieces = []
    for start in range(0, flat.size, CHUNK):
        chunk = flat[start : start + CHUNK].astype(wide)
        if fused_stats.available():
            pieces.append(fused_stats.stats(chunk, eps))
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            low, high = chunk.min(), chunk.max()
            total, squares = float(chunk.sum(dtype=wide)), float(np.dot(chunk, chunk))
            finite, nonzero = math.isfinite(low) and math.isfinite(high), low != 0 or high != 0
            if wide == np.float32 and float32_sums_lost(total, squares, chunk.size, finite, nonzero):
                double = chunk.astype(np.float64)
                total, squares = float(double.sum()), float(np.dot(double, double))
            pieces.append(
                (
                    low,
                    high,
                    total,
                    squares,
                    int(np.count_nonzero(np.abs(chunk) < wide(eps))),
                    int(np.count_nonzero(np.isnan(chunk))),
                )
            )
    lows, highs, totals, squares, smalls, nans = zip(*pieces)
    return (float(np.min(lows)), float(np.max(highs)), sum(totals), sum(squares), sum(smalls), sum(nans))


def array_matrix(arrays: Sequence[np.ndarray], ops: Sequence[str], eps: float = 1e-8) -> np.ndarray:
    """Statistics (rows: arrays, columns: ops) of host arrays, as float64."""
    ops = tuple(ops)
    n = len(arrays)
    parts = np.zeros((n, 6), dtype=np.float64)
    numel = np.array([a.size for a in arrays], dtype=np.float64)
    by_kind: dict[int, list[int]] = {}
    for i, array in enumerate(arrays):
        if array.size == 0:
            continue
        kind = _KINDS.get(array.dtype.name) if fused_stats.available() else None
        if kind is None:
            parts[i] = _chunk_parts(array, eps)
        else:
            by_kind.setdefault(kind, []).append(i)
    for kind, index in by_kind.items():
        flats = [np.ascontiguousarray(arrays[i]) for i in index]  # alive during the call
        if kind == fused_stats.BFLOAT16:
            flats = [f.view(np.int16) for f in flats]
        addresses = np.array([f.ctypes.data for f in flats], dtype=np.int64)
        counts = np.array([f.size for f in flats], dtype=np.int64)
        parts[index] = fused_stats.stats_many(addresses, counts, kind, eps)
    identity = None
    if "id" in ops:
        identity = np.array([float(a.reshape(-1)[0]) if a.size == 1 else np.nan for a in arrays])
    with np.errstate(invalid="ignore", divide="ignore"):
        out = columns(parts, numel, ops, identity)
    empty = numel == 0
    if empty.any():
        out[empty] = [EMPTY_VALUE.get(op, np.nan) for op in ops]
    return out


def scalar_matrix(values: np.ndarray, ops: Sequence[str], eps: float = 1e-8) -> np.ndarray:
    """Statistics (rows: values, columns: ops) of one-element float64 tensors given by their
    values, as ``array_matrix`` gives them, without a call per value."""
    v = np.asarray(values, dtype=np.float64)
    by_op = {
        "min": v,
        "max": v,
        "mean": v,
        "id": v,
        "norm": np.abs(v),
        "zeros": (np.abs(v) < eps).astype(np.float64),
        "nans": np.isnan(v).astype(np.float64),
    }
    return np.stack([by_op[op] for op in ops], axis=1).reshape(len(v), len(ops))


#: statistics that rescaling a tensor changes, unless they are zero
RESCALED_OPS = ("min", "max", "norm", "mean")
#: candidates ``probe_index`` picks among (the smallest of the first few)
PROBE_CANDIDATES = 16


def probe_index(rows: np.ndarray, ops: Sequence[str], sizes: Sequence[int]) -> int | None:
    """Which of several tensors measured earlier (``rows``, their statistics; ``sizes``, their
    element counts) to measure again to see whether they still hold those values: a change that
    leaves no other trace (a loss scaler's unscaling, a write through ``.data``) rescales every
    gradient alike, which one tensor shows. The smallest of the first few whose rescaled
    statistics are finite and not all zero; None where none is (nothing can be checked)."""
    columns = [i for i, op in enumerate(ops) if op in RESCALED_OPS]
    if not columns or not len(rows):
        return None
    values = np.asarray(rows, dtype=np.float64)[:, columns]
    usable = np.flatnonzero((np.isfinite(values) & (values != 0)).any(axis=1))[:PROBE_CANDIDATES]
    return min(usable.tolist(), key=lambda k: sizes[k]) if len(usable) else None
