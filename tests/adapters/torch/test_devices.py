"""The accelerator path of the statistics and a training run on it, against numpy on host copies.

Accelerator tensors are reduced with torch's own device ops (``device_stats.device_block``: small
same-sized tensors stacked and reduced row by row, the others with a fused float64 norm over their
list and their own reductions) and reach the host in one asynchronous copy per step. Where a GPU is
present that path runs on it ("cuda"); everywhere the same device ops also run on CPU tensors
("device-ops"), so the machine without a GPU still checks their numbers; "cpu" is the host path, for
comparison.
"""

from __future__ import annotations

import pytest
import torch

import adapters.torch.stats as stats
from adapters.torch import device_stats
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
        monkeypatch.setattr(stats, "_cpu_block", device_stats.device_block)
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
    """Non-contiguous, empty, scalar, integer and half tensors in one call; counting pieces of
    a few elements so that their folding is exercised too."""
    monkeypatch.setattr(device_stats, "COUNT_CHUNK", 7)
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
    ]
    host[0][3, :] = 0.0
    tensors = [t.to(device) for t in host]
    for got, tensor in zip(_rows(tensors), host):
        assert_stats_close(got, host_copy(tensor), what=f"{tensor.dtype} {tuple(tensor.shape)}")


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


def test_same_sized_tensors_are_stacked_into_a_few_reductions(device, monkeypatch):
    """Thousands of small tensors of a few sizes (a mixture-of-experts model's experts and
    biases) cost a fixed number of reductions, not several per tensor: one per statistic and
    size (min and max together). The numbers first with matrices of a few rows, so that several
    are stacked, and tensors of their own beside them."""
    monkeypatch.setattr(device_stats, "STACK_ELEMENTS", 16 * 40)
    generator = torch.Generator().manual_seed(2)
    host = [torch.randn(16, generator=generator) * (i + 1) for i in range(300)]
    host += [torch.randn(4, 4, generator=generator) for _ in range(20)]  # the same size, another shape
    host += [torch.randn(9, generator=generator), torch.randn(70_000, generator=generator)]
    host[7][3], host[300][1, 1], host[-1][5] = float("nan"), 0.0, float("inf")
    tensors = [t.to(device) for t in host]
    for got, tensor in zip(_rows(tensors), host):
        assert_stats_close(got, host_copy(tensor))
    if stats.kernel_sweep(tensors) is not None:
        return  # the host path reads them all in one C call: no reductions to count
    monkeypatch.setattr(device_stats, "STACK_ELEMENTS", 1 << 24)
    assert _reductions(tensors[:320]) == _reductions(tensors[:320] * 10) < 10


def _reductions(tensors: list[torch.Tensor]) -> int:
    """How many reduction kernels one statistics call runs over ``tensors`` (torch's profiler)."""
    reducing = {"aten::aminmax", "aten::sum", "aten::linalg_vector_norm", "aten::count_nonzero"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        stats.stat_matrix(tensors, ALL_OPS)
    return sum(event.count for event in profile.key_averages() if event.key in reducing)
