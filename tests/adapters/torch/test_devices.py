"""The accelerator path of the statistics and a training run on it, against numpy on host copies.

Accelerator tensors are reduced with torch's own device ops (``device_stats.device_block``: packed
into a few buffers cut into pieces, each statistic of every piece one segmented reduction; a
hook's tensor staged first, ``staged_stats``) and reach the host in one asynchronous copy per
step. Where a GPU is present that path runs on it ("cuda"); everywhere the same device ops also
run on CPU tensors ("device-ops"), so the machine without a GPU still checks their numbers; "cpu"
is the host path, for comparison.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import adapters.torch.stats as stats
from adapters.torch import device_stats, row_buffer, staged_stats
from monitor import TrainerMon
from tests.integrations.reads import CONFIG, StepReads, compare, host_copy, written_rows
from tests.reference_stats import (
    ALL_OPS,
    NON_FINITE_VALUES,
    assert_same_number,
    assert_stats_close,
    numpy_stats,
)
from tests.training import MLP

PATHS = ["cpu", "device-ops"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=PATHS)
def device(request, monkeypatch) -> str:
    """The device tensors are made on; "device-ops" routes CPU tensors through the device path."""
    if request.param == "device-ops":
        monkeypatch.setattr(stats, "kernel_sweep", lambda tensors: None)
        monkeypatch.setattr(stats, "kernel_tuple", lambda t, eps: None)
        monkeypatch.setattr(stats, "_staged", lambda t: True)
        monkeypatch.setattr(stats, "_cpu_block", device_stats.device_block)
        monkeypatch.setattr(row_buffer, "in_place", lambda t: None)
        monkeypatch.setattr(row_buffer, "kernel_sweep", lambda tensors: None)
        return "cpu"
    return request.param


def _rows(tensors: list[torch.Tensor], ops=ALL_OPS) -> list[dict[str, float]]:
    matrix = stats.stat_matrix(tensors, ops)
    assert matrix.shape == (len(tensors), len(ops)) and matrix.device == tensors[0].device
    values, fetch = stats.to_host(matrix)
    values = fetch() if values is None else values
    return [dict(zip(ops, row)) for row in values.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("values", list(NON_FINITE_VALUES.values()), ids=list(NON_FINITE_VALUES))
def test_non_finite_tiny_and_huge_values_follow_numpy(request, device, dtype, values):
    """Sums of squares in float64: vanishing values keep their norm, huge finite ones stay
    finite. On the device path a sum beyond float32's range (the "huge" case's mean) is the one
    documented exception: it comes out Inf there, where the host path takes it again."""
    tensor = torch.tensor(values, dtype=dtype, device=device)
    (got,) = _rows([tensor])
    want = numpy_stats(host_copy(tensor))
    device_path = request.node.callspec.params["device"] != "cpu"
    wide = dtype in (torch.float32, torch.bfloat16)  # float16 holds no such value: Inf already
    for op in ALL_OPS:
        if op == "mean" and values is NON_FINITE_VALUES["huge"] and wide and device_path:
            assert got[op] == float("inf")
            continue
        assert_same_number(got[op], want[op])


def test_many_tensors_of_mixed_dtypes_shapes_and_layouts(device, monkeypatch):
    """Non-contiguous, empty, scalar, integer, half and float64 tensors in one call, in pieces
    and buffers of a few elements so that their folding is exercised too; the tensors measured
    are left as they were."""
    monkeypatch.setattr(device_stats, "PIECE", 7)
    monkeypatch.setattr(device_stats, "PACK_ELEMENTS", 70)
    generator = torch.Generator().manual_seed(0)
    host = [
        torch.randn(37, 5, generator=generator),
        torch.randn(6, 9, generator=generator).t(),
        torch.randn(64, generator=generator).to(torch.bfloat16),
        torch.randn(3, 4, 5, generator=generator).to(torch.float16),
        torch.zeros(0),
        torch.tensor(2.5),
        torch.randint(-5, 5, (23,), generator=generator),
        torch.randn(50, generator=generator).masked_fill(torch.arange(50) % 9 == 0, float("nan")),
        torch.randn(45, generator=generator, dtype=torch.float64),
        torch.randint(0, 2, (31,), generator=generator).bool(),
    ]
    host[0][3, :] = 0.0
    tensors = [t.to(device, copy=True) for t in host]
    for dtype in {t.dtype for t in tensors}:  # one dtype at a time too: the common case's own path
        of_dtype = [(t, h) for t, h in zip(tensors, host) if t.dtype == dtype and t.numel()]
        for got, (_, tensor) in zip(_rows([t for t, _ in of_dtype]), of_dtype):
            assert_stats_close(got, host_copy(tensor), what=f"{tensor.dtype} {tuple(tensor.shape)}")
    for got, tensor in zip(_rows(tensors), host):
        assert_stats_close(got, host_copy(tensor), what=f"{tensor.dtype} {tuple(tensor.shape)}")
    for tensor, original in zip(tensors, host):
        torch.testing.assert_close(tensor.cpu(), original, rtol=0, atol=0, equal_nan=True)
    identity = _rows(tensors, ops=["id"])  # msprobe's "id" alone: the value of one-element tensors
    assert identity[5]["id"] == 2.5
    assert all(np.isnan(row["id"]) for row, t in zip(identity, host) if t.numel() != 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_run_records_every_data_type_as_numpy_reads_it(device, dtype, tmp_path, monkeypatch):
    """Gradients (each micro-batch's sum and the one the step uses), parameters before and after
    the update and Adam's moments, all on the device, against the test's own host copies."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP().to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reads = StepReads(model)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        for _ in range(2):
            batch = torch.randn(5, 6, generator=generator).to(device=device, dtype=dtype)
            model(batch).float().pow(2).mean().backward()
        reads.before_update(step)
        optimizer.step()
        reads.after_update(step, optimizer)
        optimizer.zero_grad(set_to_none=True)
    mon.stop()
    reads.remove()
    (rank_dir,) = [p for p in tmp_path.rglob("*") if p.is_dir() and any(p.glob("*.csv"))]
    compared = compare(reads.steps, written_rows(str(rank_dir)), what=f"{device} {dtype}")
    assert compared == 3 * 6 * len(list(model.parameters())) * len(ALL_OPS)


def test_tensors_of_any_size_are_packed_into_a_few_reductions(request, device, monkeypatch):
    """Thousands of tensors (a mixture-of-experts model's experts and biases, beside a large
    embedding) cost a fixed number of reductions, not several per tensor: a few per buffer they
    are packed into. The numbers first with buffers and pieces of a few dozen elements, so that
    tensors span pieces and buffers, then the count with the real sizes."""
    monkeypatch.setattr(device_stats, "PACK_ELEMENTS", 16 * 40)
    monkeypatch.setattr(device_stats, "PIECE", 24)
    generator = torch.Generator().manual_seed(2)
    host = [torch.randn(16, generator=generator) * (i + 1) for i in range(300)]
    host += [torch.randn(4, 4, generator=generator) for _ in range(20)]
    host += [torch.randn(9, generator=generator), torch.randn(70_000, generator=generator)]
    host += [torch.randn(30, 50, generator=generator).t(), torch.full((100,), -3.0), torch.zeros(50)]
    host[7][3], host[300][1, 1], host[321][5], host[321][60_000] = (
        float("nan"),
        0.0,
        float("inf"),
        float("nan"),
    )
    tensors = [t.to(device) for t in host]
    for got, tensor in zip(_rows(tensors), host):
        assert_stats_close(got, host_copy(tensor))
    if request.node.callspec.params["device"] == "cpu":
        return  # the host path reads them with its C kernel: no reductions to count
    monkeypatch.setattr(device_stats, "PACK_ELEMENTS", 1 << 24)
    monkeypatch.setattr(device_stats, "PIECE", 1 << 16)
    # one per statistic on the buffer's pieces, one per statistic to combine pieces into tensors
    assert _reductions(tensors) == _reductions(tensors * 10) == 2 * len(ALL_OPS)


def _reductions(tensors: list[torch.Tensor]) -> int:
    """How many reductions one statistics call runs over ``tensors`` (torch's profiler). A fused
    norm over a list counts once: on a GPU it is one launch per chunk of the list, where torch's
    CPU fallback takes each tensor's norm in turn."""
    reducing = {"aten::aminmax", "aten::sum", "aten::linalg_vector_norm", "aten::count_nonzero"}
    reducing |= {"aten::segment_reduce", "aten::_foreach_norm"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        stats.stat_matrix(tensors, ALL_OPS)
    return sum(
        1 for event in profile.events() if event.name in reducing and not _under(event, "aten::_foreach_norm")
    )


def _under(event, name: str) -> bool:
    """Whether a profiler event ran inside an event called ``name``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def test_tensors_measured_one_at_a_time_are_measured_as_they_were_when_staged(device, monkeypatch):
    """Hooks' tensors (activations, a micro-batch's gradients) are copied into a staging buffer
    and measured with their peers later: each row is the tensor as it was at its hook, though
    it changed in place since; batches seal when full (buffers of a few dozen elements here), a
    tensor larger than a buffer is measured at once, and half types are widened exactly."""
    monkeypatch.setattr(device_stats, "PACK_ELEMENTS", 100)
    monkeypatch.setattr(device_stats, "PIECE", 16)
    generator = torch.Generator().manual_seed(3)
    host = [torch.randn(n, generator=generator) * (n + 1) for n in (7, 40, 33, 1, 90, 64, 250, 12)]
    host[1][4], host[4][0], host[6][9] = float("nan"), 0.0, float("-inf")
    host[5] = host[5].to(torch.bfloat16)
    tensors = [t.to(device, copy=True) for t in host]
    rows = []
    for t in tensors:
        rows.append(stats.tensor_stats(t, ALL_OPS))
        t.mul_(-3.0)  # changed once its hook returned: the row keeps what the hook saw
    matrix = stats.stack_rows(rows, len(ALL_OPS))
    values, fetch = stats.to_host(matrix)
    values = fetch() if values is None else values
    for row, tensor in zip(values.tolist(), host):
        assert_stats_close(
            dict(zip(ALL_OPS, row)), host_copy(tensor), what=f"{tensor.dtype} {tensor.numel()}"
        )


def test_hooks_on_several_threads_share_a_stager_and_a_dropped_batch_lets_its_buffer_go(device, monkeypatch):
    """Forward hooks run on the training thread and backward hooks on autograd's: rows staged
    from both at once are each their own tensor's. Rows nobody reads (a step abandoned) do not
    keep their buffer."""
    monkeypatch.setattr(device_stats, "PACK_ELEMENTS", 64)
    generator = torch.Generator().manual_seed(4)
    host = [torch.randn(1 + k % 17, generator=generator) + k for k in range(200)]
    tensors = [t.to(device) for t in host]
    rows: list = [None] * len(tensors)

    def stage(start: int) -> None:
        for k in range(start, len(tensors), 2):
            rows[k] = stats.tensor_stats(tensors[k], ALL_OPS)

    threads = [threading.Thread(target=stage, args=(start,)) for start in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    values, fetch = stats.to_host(stats.stack_rows(rows, len(ALL_OPS)))
    values = fetch() if values is None else values
    for row, tensor in zip(values.tolist(), host):
        assert_stats_close(dict(zip(ALL_OPS, row)), host_copy(tensor))
    if not isinstance(stats.tensor_stats(tensors[0], ALL_OPS), staged_stats.StagedRow):
        return  # the host path measures at once: nothing staged
    stager = staged_stats._STAGERS[(tensors[0].device, torch.float32, tuple(ALL_OPS), 1e-8)]
    assert stager._open() is None  # the row just made and dropped took its batch with it
