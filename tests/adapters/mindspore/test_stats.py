"""The batched statistics engine against numpy, including non-finite values, packs and pieces."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np

import adapters.mindspore.stats as stats
from tests.reference_stats import ALL_OPS, NON_FINITE_VALUES, assert_same_number, numpy_stats, sign_agreement

OPS = [*ALL_OPS, "id"]
#: the shared non-finite cases, plus single values and float32's largest number next to an infinity
CASES = {
    **NON_FINITE_VALUES,
    "one-nan": [float("nan")],
    "all-inf": [float("inf")] * 2,
    "all--inf": [float("-inf")],
    "max-inf": [np.finfo(np.float32).max, float("inf")],
}


@pytest.fixture(autouse=True, params=["host", "device-ops"])
def path(request, monkeypatch):
    """Which path computes the statistics: the CPU back-end's host kernel, or the device
    operators that Ascend and GPU use (run here on the CPU to check their numbers)."""
    monkeypatch.setattr(stats, "host_memory", lambda: request.param == "host")
    return request.param


def _stats(arrays, dtypes=None, ops=OPS, eps=1e-8):
    dtypes = dtypes or [None] * len(arrays)
    tensors = [ms.Tensor(a) if d is None else ms.Tensor(a, d) for a, d in zip(arrays, dtypes)]
    matrix = stats.StatEngine(ops, eps).matrix(tensors)
    assert matrix.dtype == ms.float64 and tuple(matrix.shape) == (len(arrays), len(ops))
    return [dict(zip(ops, row)) for row in matrix.asnumpy().tolist()]


def _want(array: np.ndarray) -> dict[str, float]:
    want = numpy_stats(array)
    want["id"] = float(np.asarray(array, dtype=np.float64).ravel()[0]) if np.size(array) == 1 else np.nan
    return want


@pytest.mark.parametrize("values", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "alone"])
def test_non_finite_values_follow_numpy(values, packed, monkeypatch, path):
    if not packed:
        monkeypatch.setattr(stats, "PACK_MAX", 0)
    array = np.array(values, dtype=np.float32)
    neighbour = np.array([5.0, -7.0], dtype=np.float32)  # shares the pack: must stay unaffected
    got, other = _stats([array, neighbour])
    for op in OPS:
        if path == "device-ops" and values is CASES["huge"] and op in ("norm", "mean"):
            # the device operators sum in float32, as the framework's own norm does (documented)
            assert got[op] == float("inf")
            continue
        if path == "device-ops" and values is CASES["tiny"] and op == "norm":
            assert got[op] < _want(array)[op]  # squares under float32's normal range are lost there
            continue
        assert_same_number(got[op], _want(array)[op])
        assert_same_number(other[op], _want(neighbour)[op])


def test_many_tensors_of_mixed_dtypes_shapes_and_empties_keep_their_order():
    rng = np.random.default_rng(0)
    arrays = [
        rng.normal(size=(37, 5)).astype(np.float32),
        np.zeros((0,), np.float32),
        rng.normal(size=3).astype(np.float32),
        rng.normal(size=(2, 3, 4)),
        rng.normal(size=100).astype(np.float32),
        np.array([2.5], np.float32),
        np.array([3, -4, 0], np.int32),
        rng.normal(size=(8, 8)).astype(np.float32),
    ]
    dtypes = [None, None, ms.bfloat16, ms.float64, ms.float16, None, None, None]
    rows = _stats(arrays, dtypes)
    for array, dtype, got in zip(arrays, dtypes, rows):
        reference = ms.Tensor(array, dtype).astype(ms.float64).asnumpy() if dtype else array
        want = _want(reference)
        for op in OPS:
            assert_same_number(got[op], want[op], rel=1e-5)


def test_empty_tensor_gives_nan_not_an_error():
    (got,) = _stats([np.zeros((0, 3), np.float32)])
    assert np.isnan(got["min"]) and np.isnan(got["max"]) and np.isnan(got["mean"]) and np.isnan(got["zeros"])
    assert got["norm"] == 0.0 and got["nans"] == 0.0


@pytest.mark.parametrize(
    ("pack_max", "group", "chunk"),
    [(1 << 16, 40, 1 << 24), (0, 1 << 22, 7), (5, 12, 9)],
    ids=["several-packs", "pieces", "packs-and-pieces"],
)
def test_packs_and_pieces_give_the_same_numbers(monkeypatch, pack_max, group, chunk):
    monkeypatch.setattr(stats, "PACK_MAX", pack_max)
    monkeypatch.setattr(stats, "GROUP", group)
    monkeypatch.setattr(stats, "CHUNK", chunk)
    rng = np.random.default_rng(1)
    arrays = [rng.normal(size=n).astype(np.float32) for n in (3, 20, 17, 1, 64, 8)]
    arrays[2][[0, 5, 9]] = [0.0, np.nan, 0.0]
    arrays[4][10] = np.inf
    rows = _stats(arrays)
    for array, got in zip(arrays, rows):
        want = _want(array)
        for op in OPS:
            assert_same_number(got[op], want[op], rel=1e-5)


def test_sign_agreement_matches_numpy_across_packs_and_pieces(monkeypatch):
    monkeypatch.setattr(stats, "PACK_MAX", 10)
    monkeypatch.setattr(stats, "CHUNK", 16)
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=n).astype(np.float32) for n in (5, 40, 7)]
    moments = [rng.normal(size=n).astype(np.float32) for n in (5, 40, 7)]
    moments[0][1] = 0.0
    engine = stats.StatEngine(["norm"], 1e-8)
    got = engine.sign_agreement([ms.Tensor(g) for g in grads], [ms.Tensor(m) for m in moments]).asnumpy()
    want = [sign_agreement(g, m) for g, m in zip(grads, moments)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_scalar_matrix_equals_the_statistics_of_one_element_tensors():
    values = np.array([0.25, -2.0, 0.0, np.nan, np.inf])
    engine = stats.StatEngine(OPS, 1e-8)
    got = engine.scalar_matrix(ms.Tensor(values)).asnumpy()
    want = engine.matrix([ms.Tensor(np.array([v])) for v in values]).asnumpy()
    np.testing.assert_array_equal(got, want)
