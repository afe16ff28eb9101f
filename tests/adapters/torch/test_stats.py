"""CPU statistics against numpy, including non-finite values and odd inputs.

Every test runs twice: through the one-pass kernel (monitor.stats.fused_stats, a C extension) and
through the library-call path used where the extension was not built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import adapters.torch.stats as stats
from adapters.torch import in_place
from adapters.torch.row_buffer import RowBuffer
from monitor.stats import fused_stats
from tests.adapters.torch.helpers import ALL_OPS, numpy_stats
from tests.reference_stats import NON_FINITE_VALUES, assert_same_number, assert_stats_close


@pytest.fixture(autouse=True, params=["fused", "library"])
def path(request, monkeypatch):
    """Which CPU path computes the statistics."""
    if request.param == "fused":
        assert fused_stats.available(), "monitor.stats._fused_stats was not built (pip install -e .)"
    else:
        monkeypatch.setattr(fused_stats, "available", lambda: False)
    return request.param


def _stats(tensors, ops=ALL_OPS, eps=1e-8):
    matrix = stats.stat_matrix(tensors, ops, eps)
    assert matrix.shape == (len(tensors), len(ops)) and matrix.dtype == torch.float64
    return [dict(zip(ops, row)) for row in matrix.tolist()]


@pytest.mark.parametrize("values", list(NON_FINITE_VALUES.values()), ids=list(NON_FINITE_VALUES))
def test_non_finite_values_follow_numpy(values):
    array = np.array(values, dtype=np.float32)
    (got,) = _stats([torch.from_numpy(array.copy())])
    want = numpy_stats(array)
    for op in ALL_OPS:
        assert_same_number(got[op], want[op])


@pytest.mark.parametrize("case", ["tiny", "huge"])
def test_norm_alone_keeps_what_fp32_loses(case):
    """The default ops (norm alone) measure no min or max: the squares of tiny values, and of huge
    finite ones, are still taken again in float64 as numpy takes them."""
    array = np.array(NON_FINITE_VALUES[case], dtype=np.float32)
    (got,) = _stats([torch.from_numpy(array.copy())], ops=("norm",))
    assert_same_number(got["norm"], numpy_stats(array)["norm"])


def test_many_tensors_of_mixed_dtypes_and_shapes():
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(37, 5, generator=generator),
        torch.randn(3, generator=generator).to(torch.bfloat16),
        torch.randn(2, 3, 4, generator=generator, dtype=torch.float64),
        torch.randn(100, generator=generator).to(torch.float16),
        torch.randn(8, 8, generator=generator).t(),  # non-contiguous
    ]
    rows = _stats(tensors)
    for tensor, got in zip(tensors, rows):
        want = numpy_stats(tensor.to(torch.float64).numpy())
        for op in ALL_OPS:
            assert_same_number(got[op], want[op], rel=1e-5)


def test_empty_tensor_gives_nan_not_an_error():
    (got,) = _stats([torch.empty(0)])
    assert np.isnan(got["min"]) and np.isnan(got["max"]) and np.isnan(got["mean"]) and np.isnan(got["zeros"])
    assert got["norm"] == 0.0 and got["nans"] == 0.0


def test_integer_tensor_statistics():
    tensor = torch.tensor([3, -4, 0], dtype=torch.int64)
    (got,) = _stats([tensor])
    want = numpy_stats(tensor.numpy())
    for op in ALL_OPS:
        assert_same_number(got[op], want[op])


def test_counts_are_exact_when_taken_in_chunks(monkeypatch):
    monkeypatch.setattr(stats, "CPU_CHUNK", 7)
    array = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    array[::3] = 0.0
    array[::11] = np.nan
    (got,) = _stats([torch.from_numpy(array.copy())], ["zeros", "nans"], eps=1e-8)
    assert got["nans"] == np.isnan(array).sum()
    assert got["zeros"] == pytest.approx(np.mean(np.abs(array) < 1e-8))


def test_eps_sets_what_counts_as_zero():
    tensor = torch.tensor([0.0, 1e-4, -1e-4, 1e-2])
    (got,) = _stats([tensor], ["zeros"], eps=1e-3)
    assert got["zeros"] == 0.75


def test_id_op_is_the_value_of_a_scalar_and_nan_otherwise():
    rows = _stats([torch.tensor(2.5), torch.ones(3)], ["id"])
    assert rows[0]["id"] == 2.5 and np.isnan(rows[1]["id"])


def test_only_requested_ops_in_requested_order():
    tensor = torch.tensor([1.0, -2.0, 2.0])
    (got,) = _stats([tensor], ["max", "norm"])
    assert list(got) == ["max", "norm"] and got["max"] == 2.0 and got["norm"] == 3.0


def test_no_tensors_gives_an_empty_matrix():
    assert stats.stat_matrix([], ALL_OPS).shape == (0, len(ALL_OPS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zeros_of_half_types_with_an_eps_below_their_range(dtype):
    # 1e-8 rounds to 0 in fp16: a comparison in the tensor's own type would count nothing
    tensor = torch.tensor([0.0, 0.0, -0.0, 1.0, -2.0, 0.5, 0.0, 3.0], dtype=dtype)
    (got,) = _stats([tensor], ["zeros"], eps=1e-8)
    assert got["zeros"] == 0.5


def test_large_float32_tensor_keeps_seven_digits():
    # torch._foreach_norm / vector_norm lose ~3 digits over millions of float32 elements
    generator = torch.Generator().manual_seed(3)
    tensor = torch.randn(6_000_000, generator=generator) * 0.01 + 0.003
    (got,) = _stats([tensor], ["norm", "mean"])
    wide = tensor.numpy().astype(np.float64)
    assert got["norm"] == pytest.approx(np.sqrt(np.sum(wide * wide)), rel=1e-6)
    assert got["mean"] == pytest.approx(np.mean(wide), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_tensors_of_many_chunks_fold_exactly(monkeypatch, dtype):
    monkeypatch.setattr(stats, "CPU_CHUNK", 1000)
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(4321, generator=generator).to(dtype) for _ in range(3)]
    tensors[0][::5] = 0.0
    tensors[1][3000] = float("nan")  # in a later chunk
    tensors[2][4000] = float("-inf")
    for tensor, got in zip(tensors, _stats(tensors)):
        want = numpy_stats(tensor.to(torch.float64).numpy())
        for op in ALL_OPS:
            assert_same_number(got[op], want[op], rel=1e-5)


def test_a_row_buffer_keeps_the_latest_row_of_each_slot_in_the_order_put():
    generator = torch.Generator().manual_seed(11)
    tensors = [
        torch.randn(64, generator=generator),
        torch.randn(3, 5, generator=generator).t(),  # not contiguous
        torch.randn(40, generator=generator).to(torch.bfloat16),
        torch.randn(40, generator=generator).to(torch.float16),  # no in-place kernel: a library row
        torch.arange(-3, 9),  # integers
    ]
    tensors[0][5] = float("nan")
    buffer = RowBuffer(6, ALL_OPS, 1e-8)
    buffer.put(4, tensors[0])  # replaced below
    for slot, tensor in zip((2, 0, 5, 1, 4), tensors):
        buffer.put(slot, tensor)
    buffer.put(3, tensors[1])
    buffer.drop(3)
    order, matrix = buffer.take()
    assert order == [2, 0, 5, 1, 4] and matrix.shape == (5, len(ALL_OPS)) and matrix.dtype == torch.float64
    for row, tensor in zip(matrix.tolist(), tensors):
        want = numpy_stats(tensor.to(torch.float64).numpy())
        for op, value in zip(ALL_OPS, row):
            assert_same_number(value, want[op], rel=1e-5)
    assert buffer.take()[0] == []  # taken: empty again


@pytest.mark.parametrize("mixed", [False, True], ids=["one sweep", "mixed kinds"])
def test_a_row_buffer_measures_many_tensors_at_once_as_numpy_does(mixed):
    """put_many: plain fp32 tensors in one sweep; with other kinds among them (bf16, fp16,
    integers, a non-contiguous view), each goes where it can be read."""
    generator = torch.Generator().manual_seed(13)
    tensors = [torch.randn(n, generator=generator) for n in (64, 1, 300, 17)]
    tensors[2][7] = float("nan")
    if mixed:
        tensors += [
            torch.randn(3, 5, generator=generator).t(),
            torch.randn(40, generator=generator).to(torch.bfloat16),
            torch.randn(40, generator=generator).to(torch.float16),
            torch.arange(-3, 9),
        ]
    buffer = RowBuffer(len(tensors) + 1, ALL_OPS, 1e-8)
    buffer.put(3, torch.ones(3))  # replaced below, and moved to its new place in the order
    slots = [len(tensors) - k for k in range(len(tensors))]
    buffer.put_many(slots, tensors)
    order, matrix = buffer.take()
    assert order == slots
    for row, tensor in zip(matrix.tolist(), tensors):
        want = numpy_stats(tensor.to(torch.float64).numpy())
        for op, value in zip(ALL_OPS, row):
            assert_same_number(value, want[op], rel=1e-5)


def test_sign_shares_match_numpy_for_every_kind_and_count_a_nan_as_sign_zero():
    from tests.reference_stats import sign_agreement

    generator = torch.Generator().manual_seed(12)
    grads = [torch.randn(50, generator=generator) for _ in range(4)]
    moments = [torch.randn(50, generator=generator) for _ in range(4)]
    grads[0][::7] = 0.0
    grads[1], moments[1] = grads[1].to(torch.bfloat16), moments[1].to(torch.bfloat16)
    grads[2] = grads[2].double()  # float64 against a float32 moment: the library path
    moments[3][4] = float("nan")
    got = stats.sign_shares(grads, moments)
    for share, grad, moment in zip(got, grads, moments):
        # torch.sign (what msprobe uses, on CPU and CUDA) gives a NaN the sign 0
        want = sign_agreement(grad.double().nan_to_num(0.0).numpy(), moment.double().nan_to_num(0.0).numpy())
        assert float(share) == pytest.approx(want, abs=1e-12)


def _strided_views() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 5, 12, generator=generator)
    qkv[1, 2, 4] = -0.0
    qkv[0, 3, 5] = 0.0
    with_nan = torch.randn(3, 8, generator=generator)
    with_nan[2, 1] = float("nan")
    wide = torch.randn(2, 5, 3 * in_place.MIN_RUN, generator=generator)
    wide[1, 3, in_place.MIN_RUN + 7] = -0.0
    return {
        "wide split piece": wide.split(in_place.MIN_RUN, dim=2)[1],
        "split piece": qkv.split(4, dim=2)[1],
        "split piece as heads": qkv.split(4, dim=2)[2].view(2, 5, 2, 2),
        "transpose": torch.randn(2, 3, 4, 5, generator=generator).transpose(1, 2),
        "row slice": qkv[:, 1:4],
        "every other row": qkv[:, ::2],
        "column": qkv[:, :, 3],
        "expanded": torch.randn(3, 1, generator=generator).expand(3, 4),
        "bfloat16 split piece": qkv.to(torch.bfloat16).split(4, dim=2)[0],
        "nan in a later row": with_nan[:, 2:6],
        "infinity in a split piece": torch.tensor([[1.0, float("inf"), 2.0, 3.0]] * 3)[:, 1:3],
    }


@pytest.mark.parametrize("name", list(_strided_views()))
def test_strided_views_read_in_place_match_numpy_on_a_copy(name):
    view = _strided_views()[name]
    assert not view.is_contiguous()
    got = dict(zip(ALL_OPS, stats.tensor_stats(view, ALL_OPS)))
    assert_stats_close(got, view.float().contiguous().numpy(), what=name)


def test_strided_views_are_read_in_place_not_copied(monkeypatch):
    """The layout the kernel gets for the views an attention block makes, checked by reading the
    memory it names: only elements of the view, each once."""
    views = _strided_views()
    for name in ("split piece", "split piece as heads", "transpose", "row slice", "bfloat16 split piece"):
        view = views[name]
        run, rows, stride = in_place.row_layout(view)
        base = view.data_ptr()
        size = view.element_size()
        addresses = {base + (r * stride + i) * size for r in range(rows) for i in range(run)}
        offsets = (sum(i * s for i, s in zip(index, view.stride())) for index in np.ndindex(*view.shape))
        want = {base + offset * size for offset in offsets}
        assert addresses == want, name
    for name in ("every other row", "column", "expanded"):
        assert in_place.row_layout(views[name]) is None, name


def test_views_with_long_runs_go_to_the_kernel_where_they_lie(monkeypatch, path):
    calls = []
    original = fused_stats.stats_rows
    monkeypatch.setattr(fused_stats, "stats_rows", lambda *args: calls.append(args[1:4]) or original(*args))
    views = _strided_views()
    stats.tensor_stats(views["wide split piece"], ALL_OPS)
    stats.tensor_stats(views["transpose"], ALL_OPS)
    stats.tensor_stats(views["split piece"], ALL_OPS)  # runs of 4: copied, one call is cheaper
    in_place_reads = [(in_place.MIN_RUN, 10, 3 * in_place.MIN_RUN), (120, 1, 120)]
    assert calls == (in_place_reads if path == "fused" else [])  # the library path reads no address
