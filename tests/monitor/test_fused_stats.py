"""The one-pass statistics kernel (the C extension) against numpy in float64, on copies.

The README's install builds the extension: its absence fails here instead of testing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from monitor.stats import fused_stats


@pytest.fixture(scope="module", autouse=True)
def _kernel_compiled():
    assert fused_stats.available(), (
        "monitor.stats._fused_stats was not built (pip install -e . with a C compiler)"
    )


def _reference(array: np.ndarray, eps: float) -> tuple:
    wide = array.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return (
            wide.min(),
            wide.max(),
            wide.sum(),
            float(np.sum(wide * wide)),
            int(np.count_nonzero(np.abs(array) < array.dtype.type(eps))),
            int(np.isnan(array).sum()),
        )


def _check(array: np.ndarray, eps: float = 1e-8, rel: float = 1e-6) -> None:
    got = fused_stats.stats(array, eps)
    want = _reference(array, eps)
    for name, g, w in zip(("min", "max", "sum", "squares", "zeros", "nans"), got, want):
        if np.isnan(w):
            assert np.isnan(g), name
        elif name in ("min", "max", "zeros", "nans"):
            assert g == w, name  # exact
        else:
            assert g == pytest.approx(w, rel=rel, abs=1e-9), name


BLOCK = 16384  # the kernel's block of elements between float64 folds (_fused_stats.BLOCK)
LANES = 32


def test_block_and_lanes_are_what_the_edge_cases_assume():
    from monitor.stats import _fused_stats

    assert (_fused_stats.BLOCK, _fused_stats.LANES) == (BLOCK, LANES)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 2, LANES - 1, LANES + 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_sizes_around_the_block_edges(dtype, size):
    rng = np.random.default_rng(size)
    array = rng.normal(size=size).astype(dtype)
    array[:: max(1, size // 7)] = 0.0
    _check(array)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_min_and_max_are_exact_for_signs_zeros_and_infinities(dtype):
    cases = [
        [-0.0, 0.0],
        [-1.5, -0.25, -7.0],
        [np.inf, 1.0],
        [-np.inf, 1.0, np.inf],
        [np.finfo(dtype).tiny / 4, -np.finfo(dtype).tiny / 4],  # subnormals
        [np.finfo(dtype).max, -np.finfo(dtype).max],
    ]
    for values in cases:
        array = np.array(values, dtype=dtype)
        low, high, *_ = fused_stats.stats(array, 1e-8)
        assert (low, high) == (array.min(), array.max()), values


def test_nan_anywhere_gives_nan_min_max_and_its_count():
    array = np.random.default_rng(0).normal(size=2 * BLOCK + 3).astype(np.float32)
    array[[5, BLOCK + 1, -1]] = np.nan
    _check(array)
    low, high, total, squares, _, nans = fused_stats.stats(array, 1e-8)
    assert np.isnan(low) and np.isnan(high) and np.isnan(total) and np.isnan(squares) and nans == 3


def test_infinities_without_nan_count_no_nan():
    array = np.array([1.0, np.inf, -np.inf, 2.0], dtype=np.float32)
    low, high, _, squares, _, nans = fused_stats.stats(array, 1e-8)
    assert (low, high, squares, nans) == (-np.inf, np.inf, np.inf, 0)


def test_eps_is_a_strict_bound():
    eps = np.float32(1e-3)
    array = np.array([0.0, eps, -eps, np.nextafter(eps, np.float32(0)), 1.0], dtype=np.float32)
    assert fused_stats.stats(array, float(eps))[4] == 2


def test_large_float32_sums_keep_seven_digits():
    # one float32 accumulator over 6M elements would lose ~3 digits here
    array = (np.random.default_rng(1).normal(size=6_000_000) * 0.01 + 0.003).astype(np.float32)
    _check(array, rel=1e-6)


def test_any_shape_of_contiguous_buffer_is_read_flat():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7
    _check(array)


@pytest.mark.parametrize(
    "bad",
    [np.zeros(3, np.int32), np.zeros(0, np.float32), np.zeros(4, np.float16)],
    ids=["int32", "empty", "float16"],
)
def test_other_buffers_are_refused_with_a_clear_error(bad):
    with pytest.raises(TypeError, match="float32/float64"):
        fused_stats.stats(bad, 1e-8)


def test_non_contiguous_buffers_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        fused_stats.stats(np.zeros((4, 4), np.float32)[:, 1], 1e-8)


def test_bfloat16_bit_patterns_are_widened_exactly():
    rng = np.random.default_rng(7)
    wide = rng.normal(size=3 * BLOCK + 11).astype(np.float32)
    wide[::9] = 0.0
    wide[5], wide[6] = -np.inf, np.float32(np.finfo(np.float32).tiny / 8)  # infinity, subnormal
    bits = (wide.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the upper half of a float32
    values = (bits.astype(np.uint32) << 16).view(np.float32)  # what those bits mean, independently
    got = fused_stats.stats(bits.view(np.int16), 1e-8, bfloat16=True)
    want = _reference(values, 1e-8)
    assert got[0] == want[0] and got[1] == want[1] and got[4:] == want[4:]
    assert np.isnan(got[2]) == np.isnan(want[2])  # -inf: the sum is -inf, squares inf
    assert got[3] == want[3] == np.inf


def test_bfloat16_needs_16_bit_integers():
    with pytest.raises(TypeError, match="bfloat16"):
        fused_stats.stats(np.zeros(4, np.float32), 1e-8, bfloat16=True)


def test_bfloat16_sums_match_numpy():
    wide = np.random.default_rng(8).normal(size=2 * BLOCK + 3).astype(np.float32) * 0.01 + 0.003
    bits = (wide.view(np.uint32) >> 16).astype(np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    got = fused_stats.stats(bits.view(np.int16), 1e-8, bfloat16=True)
    want = _reference(values, 1e-8)
    assert got[2] == pytest.approx(want[2], rel=1e-6)
    assert got[3] == pytest.approx(want[3], rel=1e-6)


def test_many_buffers_in_one_call_match_numpy_one_by_one():
    rng = np.random.default_rng(9)
    arrays = [rng.normal(size=n).astype(np.float32) for n in (1, 31, 257, BLOCK + 5)]
    arrays[1][::3] = 0.0
    arrays[2][7] = np.nan
    arrays[3][9] = -np.inf
    addresses = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
    counts = np.array([a.size for a in arrays], dtype=np.int64)
    got = fused_stats.stats_many(addresses, counts, fused_stats.FLOAT32, 1e-8)
    assert got.shape == (4, 6) and got.dtype == np.float64
    for row, array in zip(got, arrays):
        want = _reference(array, 1e-8)
        for name, g, w in zip(("min", "max", "sum", "squares", "zeros", "nans"), row, want):
            if np.isnan(w):
                assert np.isnan(g), name
            elif name in ("min", "max", "zeros", "nans"):
                assert g == w, name
            else:
                assert g == pytest.approx(w, rel=1e-6), name


def test_an_address_entry_reads_float64_and_bfloat16_in_place():
    wide = np.random.default_rng(10).normal(size=1000)
    assert fused_stats.stats_at(wide.ctypes.data, wide.size, fused_stats.FLOAT64, 1e-8) == pytest.approx(
        _reference(wide, 1e-8), rel=1e-12
    )
    bits = (wide.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    got = fused_stats.stats_at(bits.ctypes.data, bits.size, fused_stats.BFLOAT16, 1e-8)
    assert got == pytest.approx(_reference(values, 1e-8), rel=1e-6)


def test_address_entries_refuse_bad_arguments_before_reading_anything():
    array = np.ones(4, np.float32)
    address = np.array([array.ctypes.data], dtype=np.int64)
    with pytest.raises(ValueError, match="kind"):
        fused_stats.stats_at(array.ctypes.data, 4, 7, 1e-8)
    with pytest.raises(ValueError, match="n > 0"):
        fused_stats.stats_at(array.ctypes.data, 0, fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="non-null"):
        fused_stats.stats_at(0, 4, fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="run <= stride"):  # overlapping rows
        fused_stats.stats_rows(array.ctypes.data, 2, 2, 1, fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="address space"):  # offsets beyond any address
        fused_stats.stats_rows(array.ctypes.data, 2, 2**40, 2**40, fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="run > 0"):
        fused_stats.stats_rows(array.ctypes.data, 0, 1, 1, fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="kind"):
        fused_stats.stats_rows(array.ctypes.data, 2, 2, 2, 7, 1e-8)
    with pytest.raises(ValueError, match="counts > 0"):
        fused_stats.stats_many(address, np.array([0], dtype=np.int64), fused_stats.FLOAT32, 1e-8)
    with pytest.raises(ValueError, match="2 counts"):
        fused_stats.stats_many(address, np.array([4, 4], dtype=np.int64), fused_stats.FLOAT32, 1e-8)
    with pytest.raises(TypeError, match="64-bit integer"):
        fused_stats.stats_many(
            address.astype(np.int32), np.array([4], dtype=np.int64), fused_stats.FLOAT32, 1e-8
        )


def test_rows_of_a_strided_layout_match_numpy_on_the_rows_and_keep_signed_zeros():
    grid = np.arange(-30, 30, dtype=np.float32).reshape(6, 10) / 7
    grid[2, 0], grid[4, 1] = -0.0, 0.0
    got = fused_stats.stats_rows(grid.ctypes.data, 4, 6, 10, fused_stats.FLOAT32, 1e-8)
    rows = grid[:, :4].astype(np.float64)
    assert got[:2] == (rows.min(), rows.max())
    assert got[2:4] == pytest.approx((rows.sum(), (rows * rows).sum()), rel=1e-6)
    assert got[4:] == ((rows == 0).sum(), 0)
    only_zeros = np.array([[0.0, -0.0], [-0.0, 0.0]], dtype=np.float32)
    low, high = fused_stats.stats_rows(only_zeros.ctypes.data, 1, 2, 2, fused_stats.FLOAT32, 1e-8)[:2]
    assert (np.signbit(low), np.signbit(high)) == (True, False)


def test_one_row_ignores_its_stride_and_long_rows_match_numpy():
    array = np.random.default_rng(12).normal(size=(5, 6000)).astype(np.float32)
    whole = fused_stats.stats(np.ascontiguousarray(array[0, :5000]), 1e-8)
    for stride in (0, 1, 5000):  # one run: any stride, even 0, reads just that run
        assert fused_stats.stats_rows(array.ctypes.data, 5000, 1, stride, fused_stats.FLOAT32, 1e-8) == whole
    got = fused_stats.stats_rows(array.ctypes.data, 5000, 5, 6000, fused_stats.FLOAT32, 1e-8)
    rows = array[:, :5000].astype(np.float64)  # runs of 20 KB: longer than the prefetch distance
    assert got[:2] == (rows.min(), rows.max())
    assert got[2:4] == pytest.approx((rows.sum(), (rows * rows).sum()), rel=1e-5)
    assert got[4:] == (0, 0)


def test_a_row_written_into_an_array_equals_the_tuple_and_rows_are_bounds_checked():
    array = np.random.default_rng(11).normal(size=300).astype(np.float32)
    out = np.full((3, 6), -1.0)
    fused_stats.stats_into(array.ctypes.data, array.size, fused_stats.FLOAT32, 1e-8, out, 1)
    assert out[1].tolist() == list(fused_stats.stats(array, 1e-8))
    assert (out[[0, 2]] == -1.0).all()  # the other rows untouched
    for row in (-1, 3):
        with pytest.raises(ValueError, match="row"):
            fused_stats.stats_into(array.ctypes.data, array.size, fused_stats.FLOAT32, 1e-8, out, row)
    with pytest.raises(ValueError, match="float64"):
        fused_stats.stats_into(
            array.ctypes.data, array.size, fused_stats.FLOAT32, 1e-8, out.astype(np.float32), 0
        )
