"""Statistics of host arrays (monitor.stats.host_stats) against numpy in float64, on copies.

Every test runs through the one-pass kernel and through the numpy path used where the C
extension was not built.
"""

from __future__ import annotations

import numpy as np
import pytest

from monitor.stats import fused_stats, host_stats
from tests.reference_stats import ALL_OPS, NON_FINITE_VALUES, assert_same_number, numpy_stats

OPS = [*ALL_OPS, "id"]


@pytest.fixture(autouse=True, params=["kernel", "numpy"])
def path(request, monkeypatch):
    if request.param == "kernel":
        assert fused_stats.available(), "monitor.stats._fused_stats was not built (pip install -e .)"
    else:
        monkeypatch.setattr(fused_stats, "available", lambda: False)
    return request.param


def _check(arrays, ops=OPS, eps=1e-8, rel=1e-5):
    got = host_stats.array_matrix(arrays, ops, eps)
    assert got.shape == (len(arrays), len(ops)) and got.dtype == np.float64
    for row, array in zip(got, arrays):
        want = numpy_stats(np.array(array, dtype=np.float64), eps)
        want["id"] = float(np.asarray(array, dtype=np.float64).ravel()[0]) if array.size == 1 else np.nan
        for op, value in zip(ops, row):
            assert_same_number(value, want[op], rel=rel)


def test_arrays_of_every_kind_shape_and_size_keep_their_order():
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(7, 9)).astype(np.float32),
        rng.normal(size=300).astype(np.float64),
        rng.normal(size=(3, 40)).astype(np.float16),
        rng.integers(-5, 5, size=50).astype(np.int32),
        rng.random(20) < 0.3,
        np.zeros(0, np.float32),
        np.array([2.5], np.float32),
        rng.normal(size=(12, 10)).astype(np.float32)[:, ::3],  # not contiguous
        rng.normal(size=33).astype(np.float32),
    ]
    arrays[0][::4] = 0.0
    _check(arrays)


@pytest.mark.parametrize("values", list(NON_FINITE_VALUES.values()), ids=list(NON_FINITE_VALUES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_non_finite_values_follow_numpy(values, dtype):
    with np.errstate(over="ignore"):  # float16 holds the huge values as Inf
        array = np.array(values, dtype=dtype)
    _check([array])


def test_widened_arrays_fold_their_chunks_exactly(monkeypatch):
    monkeypatch.setattr(host_stats, "CHUNK", 100)
    rng = np.random.default_rng(1)
    half = rng.normal(size=1234).astype(np.float16)
    half[1000] = np.nan  # in a late chunk
    integers = rng.integers(-1000, 1000, size=777).astype(np.int64)
    _check([half, integers, rng.normal(size=555).astype(np.float16)])


def test_zeros_of_float16_are_compared_in_float32():
    values = np.array([0.0, 3e-8, 1e-3, -2e-9], np.float16)  # float16 flushes 3e-8 to 0 or a subnormal
    _check([values], eps=1e-7)


def test_no_arrays_give_an_empty_matrix():
    assert host_stats.array_matrix([], ALL_OPS).shape == (0, len(ALL_OPS))


def test_scalars_give_what_one_element_arrays_give():
    values = np.array([0.25, -3.0, 0.0, 1e-9, np.nan, np.inf])
    got = host_stats.scalar_matrix(values, OPS, 1e-8)
    want = host_stats.array_matrix([np.array([v]) for v in values], OPS, 1e-8)
    np.testing.assert_array_equal(got, want)


def test_one_tensors_row_matches_numpy_and_the_columns_of_many():
    array = np.random.default_rng(3).normal(size=1000).astype(np.float32)
    array[::7] = 0.0
    parts = fused_stats.stats(array, 1e-8)
    ops = ["zeros", "norm", "nans", "mean", "max", "min"]
    wide = array.astype(np.float64)
    expected = [
        (wide == 0).mean(),
        np.sqrt((wide * wide).sum()),
        0.0,
        wide.mean(),
        wide.max(),
        wide.min(),
    ]
    row = host_stats.kernel_row(parts, array.size, ops)
    assert all(type(value) is float for value in row)
    assert row == pytest.approx(expected, rel=1e-6)
    many = host_stats.columns(np.array([parts]), np.array([float(array.size)]), ops)
    assert row == many[0].tolist()
