"""Collective statistics (cc_distribution) on two real gloo ranks, plus the pure pieces in-process.

Every recorded number is checked against numpy over copies of the same tensors made in the
worker around each call: a row's statistics are numpy's over the concatenation of all the data
of all the calls it covers, and ``calls`` is their number.
"""

from __future__ import annotations

import csv
import gc
import glob
import logging
import os
import sys
import time
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

from adapters.torch.cc_callsite import CallSites
from adapters.torch.cc_wrap import COLLECTIVES, CallInfo
from adapters.torch.stats import stat_matrix
from monitor.collectives.totals import StepTotals, stat_ops_for, summarise
from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import ALL_OPS, assert_stats_close, numpy_stats

C10D = dist.distributed_c10d


def _originals() -> dict[str, tuple]:
    return {name: (getattr(dist, name, None), getattr(C10D, name, None)) for name in COLLECTIVES}


def _assert_restored(originals: dict[str, tuple]) -> None:
    for name, (public, internal) in originals.items():
        assert getattr(dist, name, None) is public, f"torch.distributed.{name} not restored"
        assert getattr(C10D, name, None) is internal, f"distributed_c10d.{name} not restored"


class Expected:
    """The reference: numpy copies of every measured argument, per row name."""

    def __init__(self) -> None:
        self.rows: dict[str, list[np.ndarray]] = {}

    def add(self, name: str, value) -> None:
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        data = np.concatenate([t.detach().numpy().astype(np.float64).ravel() for t in tensors])
        self.rows.setdefault(name, []).append(data)

    def call(self, op: str, fn, *args, **kwargs):
        """Run a synchronous collective, recording copies of its tensor arguments before and after."""
        tensor_like = [a for a in args if isinstance(a, (torch.Tensor, list))]
        for k, a in enumerate(tensor_like):
            self.add(f"{op}.pre_{k}", a)
        result = fn(*args, **kwargs)
        for k, a in enumerate(tensor_like):
            self.add(f"{op}.post_{k}", a)
        return result

    def check(self, got: dict[str, dict[str, float]], rank: int, ops=ALL_OPS) -> None:
        names = {tag.split("/")[0].removeprefix("0:") for tag in got}
        assert names == set(self.rows), f"rank {rank}: rows {sorted(names)} != {sorted(self.rows)}"
        for name, parts in self.rows.items():
            row = got[f"0:{name}/rank{rank}/comm"]
            assert row["calls"] == len(parts), f"{name} calls"
            assert_stats_close(row, np.concatenate(parts), ops=ops, what=f"rank {rank} {name}")


def _wait_completed(work) -> None:
    """Let an async collective finish without calling wait() on its handle."""
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "async collective did not complete"
        time.sleep(0.001)


def _model_and_optimizer():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, optimizer) -> None:
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# -- worker 1: statistics of every kind of call, steps, CSV, restore --------------------------


def _collected_step_0(rank: int, peer: int, expect: Expected) -> None:
    # two sync all_reduce calls, one async waited, one async completed without wait(): one row
    for size, scale in ((4, 1.0), (6, -2.5)):
        t = (torch.arange(size, dtype=torch.float32) - 1) * scale * (rank + 1)
        expect.call("all_reduce", dist.all_reduce, t)
    t = torch.linspace(-1, 1, 5) * (rank + 3)
    expect.add("all_reduce.pre_0", t)
    dist.all_reduce(t, async_op=True).wait()
    expect.add("all_reduce.post_0", t)
    t.mul_(100)  # measured at completion: later changes do not count
    t = torch.full((3,), 0.5 + rank)
    expect.add("all_reduce.pre_0", t)
    work = dist.all_reduce(t, async_op=True)
    _wait_completed(work)  # measured through work.get_future(), never waited on
    expect.add("all_reduce.post_0", t)
    t.mul_(100)

    b = torch.tensor([float("nan"), 1.0, 0.0]) if rank == 0 else torch.zeros(3)
    expect.call("broadcast", dist.broadcast, b, src=0)
    gathered = [torch.zeros(2) for _ in range(2)]
    expect.call("all_gather", dist.all_gather, gathered, torch.tensor([1.0, -2.0]) * (rank + 1))
    out = torch.zeros(4, dtype=torch.float64)
    expect.call(
        "all_gather_into_tensor",
        dist.all_gather_into_tensor,
        out,
        torch.tensor([3.0, -1.0], dtype=torch.float64),
    )
    scattered = torch.zeros(2)
    expect.call("reduce_scatter_tensor", dist.reduce_scatter_tensor, scattered, torch.arange(4.0) + rank)
    expect.call("reduce", dist.reduce, torch.tensor([2.0, 0.0, -7.0]) * (rank + 1), dst=0)
    if rank == 0:
        expect.call("send", dist.send, torch.tensor([1.0, 2.0, 3.0]), 1)
    else:
        expect.call("recv", dist.recv, torch.zeros(3), 0)

    buffer = torch.tensor([4.0, -4.0]) if rank == 0 else torch.zeros(2)
    op = "isend" if rank == 0 else "irecv"
    expect.add(f"{op}.pre_0", buffer)
    (dist.isend(buffer, 1) if rank == 0 else dist.irecv(buffer, 0)).wait()  # gloo: no future, polled
    expect.add(f"{op}.post_0", buffer)

    send, recv = torch.tensor([10.0 + rank, 0.0]), torch.zeros(2)
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    expect.add("batch_isend_irecv.pre_0", [send, recv])
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    expect.add("batch_isend_irecv.post_0", [send, recv])


def _stats_worker(rank: int, world_size: int, workdir: str) -> None:
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "out")
    if os.environ.get("STATS_COPY") == "deferred":  # as on an accelerator: the values arrive later
        import adapters.torch.collectives as collectives

        collectives.to_host = lambda matrix: (None, matrix.numpy)
    originals = _originals()
    peer = 1 - rank
    config = {
        "cc_distribution": {"enable": True, "cc_pre_hook": True},
        "ops": ALL_OPS,
        "format": "csv",
        "step_interval": 2,
    }
    mon = TrainerMon(config)
    model, optimizer = _model_and_optimizer()
    mon.set_monitor(model, 1, optimizer)
    assert dist.all_reduce is not originals["all_reduce"][0]
    assert C10D.all_reduce is dist.all_reduce

    expect = Expected()
    _collected_step_0(rank, peer, expect)
    if os.environ.get("STATS_COPY") == "deferred":  # what waits for the step's end holds no tensor
        t = torch.tensor([2.0, -6.0]) * (rank + 1)
        expect.call("all_reduce", dist.all_reduce, t)
        kept = weakref.ref(t.untyped_storage())  # alive while any view of the data is
        del t
        gc.collect()
        assert kept() is None, "the monitor kept a call's tensor until the step's end"
    _step(model, optimizer)
    step0 = mon._core.latest.latest("comm")
    expect.check(step0, rank)

    # step 1 is not collected: nothing of it may show up in step 2
    t = torch.ones(5)
    dist.all_reduce(t)
    late = dist.all_reduce(torch.ones(2), async_op=True)
    _step(model, optimizer)
    late.wait()

    expect2 = Expected()
    expect2.call("all_reduce", dist.all_reduce, torch.tensor([1.0, -3.0]) * (rank + 1))
    # a p2p work still pending when the step is written is dropped, not moved to a later step
    buffer = torch.ones(2) if rank == 0 else torch.zeros(2)
    expect2.add("isend.pre_0" if rank == 0 else "irecv.pre_0", buffer)  # issued in step 2: inputs count
    pending = dist.isend(buffer, 1) if rank == 0 else dist.irecv(buffer, 0)
    _step(model, optimizer)
    pending.wait()
    dist.all_reduce(torch.ones(1))  # step 3, not collected
    expect2.check(mon._core.latest.latest("comm"), rank)
    out_dir = mon.output_dir
    mon.stop()
    _assert_restored(originals)
    save_result(
        workdir,
        rank,
        {
            "dir": out_dir,
            "rows": {step: sorted(e.rows) for step, e in ((0, expect), (2, expect2))},
            "values": {
                f"{step}/{tag.split('/')[0].removeprefix('0:')}": row
                for step, got in ((0, step0),)
                for tag, row in got.items()
            },
        },
    )


def _read_csv(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames), list(reader)


@pytest.mark.parametrize("copy", ["host", "deferred"])
def test_statistics_steps_csv_and_restore(tmp_path, copy):
    """Every kind of call against the test's own numpy statistics, on the host and with the copy
    of each call's statistics arriving later, as on an accelerator (merged at the step's end)."""
    results = run_ranks(_stats_worker, 2, str(tmp_path), env={"STATS_COPY": copy})
    for rank, result in enumerate(results):
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(result["dir"], "comm_*.csv")))
        assert files == ["comm_0-0.csv", "comm_2-2.csv"], f"rank {rank}: {files}"
        for step in (0, 2):
            header, rows = _read_csv(os.path.join(result["dir"], f"comm_{step}-{step}.csv"))
            assert header == ["vpp_stage", "name", "step", *ALL_OPS, "calls"]
            assert sorted(r["name"] for r in rows) == result["rows"][str(step)]
            assert {r["step"] for r in rows} == {str(step)} and {r["vpp_stage"] for r in rows} == {"0"}
            for row in rows:
                assert row["calls"].isdigit(), row  # exact integer, not 4.0
                if step == 0:
                    want = result["values"][f"0/{row['name']}"]
                    assert int(row["calls"]) == want["calls"]
                    for op in ALL_OPS:
                        assert float(row[op]) == pytest.approx(want[op], rel=1e-5, nan_ok=True), (row, op)


# -- worker 2: two monitors, cc_codeline, failures, cc_log_only -------------------------------


def _filtered_site(t: torch.Tensor) -> int:
    line = sys._getframe().f_lineno + 1
    dist.all_reduce(t)
    return line


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _two_monitors(rank: int, originals: dict) -> None:
    from monitor import TrainerMon

    mon_a = TrainerMon({"cc_distribution": {"enable": True}, "ops": ["norm"], "format": "api"})
    wrapper = dist.all_reduce
    mon_b = TrainerMon({"cc_distribution": {"enable": True}, "ops": ["max"], "format": "api"})
    assert dist.all_reduce is wrapper and C10D.all_reduce is wrapper  # not wrapped twice
    assert wrapper.__wrapped__ is originals["all_reduce"][0]
    model, optimizer = _model_and_optimizer()
    mon_a.set_monitor(model, 1, optimizer)
    mon_b.set_monitor(model, 1, optimizer)
    t = torch.tensor([3.0, -4.0]) * (rank + 1)
    dist.all_reduce(t)
    _step(model, optimizer)
    tag = f"0:all_reduce.post_0/rank{rank}/comm"
    assert mon_a._core.latest.latest("comm") == {tag: {"norm": pytest.approx(15.0), "calls": 1.0}}
    assert mon_b._core.latest.latest("comm") == {tag: {"max": pytest.approx(9.0), "calls": 1.0}}
    mon_a.stop()
    assert dist.all_reduce is wrapper  # mon_b still listens
    t = torch.tensor([1.0, 2.0])
    dist.all_reduce(t)
    _step(model, optimizer)
    assert mon_b._core.latest.latest("comm") == {tag: {"max": pytest.approx(4.0), "calls": 1.0}}
    mon_b.stop()
    _assert_restored(originals)


def _codeline(rank: int, originals: dict) -> None:
    from monitor import TrainerMon

    mon = TrainerMon(
        {
            "cc_distribution": {"enable": True, "cc_codeline": [r"_filtered_site"]},
            "ops": ALL_OPS,
            "format": "api",
        }
    )
    model, optimizer = _model_and_optimizer()
    mon.set_monitor(model, 1, optimizer)
    dist.all_reduce(torch.ones(3))  # not from a matching call site: left out
    t = torch.tensor([1.0, 0.0, -2.0]) * (rank + 1)
    line = _filtered_site(t)
    kept = t.numpy().copy()
    dist.broadcast(torch.ones(2), src=0)  # left out
    _step(model, optimizer)
    got = mon._core.latest.latest("comm")
    tag = f"0:all_reduce.post_0@test_collectives.py[{line}]/rank{rank}/comm"
    assert list(got) == [tag]
    assert got[tag]["calls"] == 1
    assert_stats_close(got[tag], kept, what="cc_codeline row")
    mon.stop()
    _assert_restored(originals)


def _failure_is_contained(rank: int, originals: dict) -> None:
    """A failure inside the monitor (injected: nothing real fails here) leaves the collectives intact."""
    import adapters.torch.collectives as collectives
    from monitor import TrainerMon

    def broken(*args, **kwargs):
        raise RuntimeError("injected statistics failure")

    mon = TrainerMon({"cc_distribution": {"enable": True, "cc_pre_hook": True}, "format": "api"})
    model, optimizer = _model_and_optimizer()
    mon.set_monitor(model, 1, optimizer)
    records = _Records()
    logging.getLogger("trainmon").addHandler(records)
    collectives.stat_matrix = broken
    try:
        for _ in range(2):
            t = torch.tensor([1.0, 2.0]) * (rank + 1)
            dist.all_reduce(t)
            assert t.tolist() == [3.0, 6.0]
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            assert t.tolist() == [6.0, 12.0]
        _step(model, optimizer)
    finally:
        collectives.stat_matrix = stat_matrix
        logging.getLogger("trainmon").removeHandler(records)
    assert [m for m in records.messages if "failed" in m] == [
        "trainmon: comm failed and is switched off (RuntimeError('injected statistics failure')); "
        "training continues"
    ]
    assert mon._core.latest.latest("comm") == {}
    mon.stop()
    _assert_restored(originals)


def _log_only(rank: int, originals: dict) -> list[str]:
    from monitor import CollectivesLogged, TrainerMon

    mon = TrainerMon({"cc_distribution": {"enable": True, "cc_log_only": True}, "format": "api"})
    model, optimizer = _model_and_optimizer()
    mon.set_monitor(model, 1, optimizer)
    records = _Records()
    logging.getLogger("trainmon").addHandler(records)
    try:
        for _ in range(3):
            line = sys._getframe().f_lineno + 1
            dist.all_reduce(torch.ones(4))
        dist.all_gather_into_tensor(torch.zeros(4, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        model(torch.ones(1, 3)).sum().backward()
        with pytest.raises(CollectivesLogged):
            optimizer.step()
    finally:
        logging.getLogger("trainmon").removeHandler(records)
    logged = [m for m in records.messages if m.startswith("trainmon: collective ")]
    assert len(logged) == 2, logged  # one per distinct (op, stack), however often it is called
    assert logged[0].startswith(
        "trainmon: collective all_reduce (group size 2; arg 0: float32[4]) called from:"
    )
    assert f"test_collectives.py[{line}]   _log_only" in logged[0]
    assert "arg 0: float64[4]; arg 1: float64[2]" in logged[1]
    assert (
        "distributed_c10d" not in logged[0] and "   wrapper" not in logged[0]
    )  # our frames and torch's left out
    mon.stop()
    _assert_restored(originals)
    return logged


def _bounded_and_released(rank: int, originals: dict) -> None:
    """Beyond MAX_PENDING outstanding async calls the rest are dropped; nothing is kept afterwards."""
    import adapters.torch.collectives as collectives
    from monitor import TrainerMon

    mon = TrainerMon({"cc_distribution": {"enable": True}, "ops": ["norm"], "format": "api"})
    model, optimizer = _model_and_optimizer()
    mon.set_monitor(model, 1, optimizer)
    records = _Records()
    logging.getLogger("trainmon").addHandler(records)
    collectives.MAX_PENDING = 4  # the bound itself, made small so that the test stays small
    try:
        buffers = [torch.full((2,), float(i)) if rank == 0 else torch.zeros(2) for i in range(6)]
        works = [dist.isend(b, 1) if rank == 0 else dist.irecv(b, 0) for b in buffers]
        for work in works:
            work.wait()
        _step(model, optimizer)
    finally:
        collectives.MAX_PENDING = 1024
        logging.getLogger("trainmon").removeHandler(records)
    got = mon._core.latest.latest("comm")
    op = "isend" if rank == 0 else "irecv"
    first = np.concatenate([b.numpy() for b in buffers[:4]])
    assert list(got) == [f"0:{op}.post_0/rank{rank}/comm"]
    assert got[f"0:{op}.post_0/rank{rank}/comm"]["calls"] == 4
    assert got[f"0:{op}.post_0/rank{rank}/comm"]["norm"] == pytest.approx(np.linalg.norm(first))
    assert len([m for m in records.messages if "more than 4 asynchronous collectives" in m]) == 1
    refs = [weakref.ref(b.untyped_storage()) for b in buffers]  # alive while any view of the data is
    del buffers, works, work  # the loop variable holds the last work, which holds its tensor
    gc.collect()
    assert all(ref() is None for ref in refs), "the monitor kept tensors of finished calls"
    mon.stop()
    _assert_restored(originals)


def _features_worker(rank: int, world_size: int, workdir: str) -> None:
    originals = _originals()
    _two_monitors(rank, originals)
    _bounded_and_released(rank, originals)
    _codeline(rank, originals)
    _failure_is_contained(rank, originals)
    logged = _log_only(rank, originals)
    save_result(workdir, rank, {"logged": logged})


def test_two_monitors_codeline_failures_and_log_only(tmp_path):
    results = run_ranks(_features_worker, 2, str(tmp_path))
    assert all(len(r["logged"]) == 2 for r in results)


# -- in-process: the pure pieces --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_totals_merge_equals_numpy_over_the_concatenation(seed):
    rng = np.random.default_rng(seed)
    totals = StepTotals()
    ops = ("min", "max", "norm", "mean", "zeros", "nans", "id")
    stat_ops = stat_ops_for(ops)
    data = []
    for _ in range(5):  # calls
        tensors = [
            torch.tensor(rng.choice([0.0, 1.5, -2.0, 3.25], size=n), dtype=torch.float32)
            for n in rng.integers(0, 5, size=3)  # some empty
        ]
        if seed == 3:
            tensors[0] = torch.tensor([np.nan, 1.0])
        stats = stat_matrix(tensors, stat_ops).numpy()
        numel = np.array([t.numel() for t in tensors], dtype=np.float64)
        totals.add("row", summarise(stats, numel, stat_ops))
        data += [t.numpy().astype(np.float64) for t in tensors]
    got = dict(zip((*ops, "calls"), totals.values(ops)[0]))
    flat = np.concatenate(data)
    assert got["calls"] == 5
    assert_stats_close(got, flat)
    assert np.isnan(got["id"]) if flat.size != 1 else got["id"] == flat[0]


def test_totals_of_empty_data_follow_the_stat_convention():
    totals = StepTotals()
    stat_ops = stat_ops_for(ALL_OPS)
    empty = torch.zeros(0)
    totals.add("row", summarise(stat_matrix([empty], stat_ops).numpy(), np.zeros(1), stat_ops))
    got = dict(zip((*ALL_OPS, "calls"), totals.values(ALL_OPS)[0]))
    want = {**numpy_stats(np.zeros(0)), "calls": 1.0}
    assert got.keys() == want.keys()
    for op, value in want.items():
        assert value == got[op] or (np.isnan(value) and np.isnan(got[op])), op


def test_call_arguments_in_parameter_order_however_passed():
    out, inp = torch.zeros(4), torch.ones(2)
    params = ("output_tensor", "input_tensor", "group", "async_op")
    by_keyword = CallInfo("all_gather_into_tensor", params, (), {"input_tensor": inp, "output_tensor": out})
    positional = CallInfo("all_gather_into_tensor", params, (out, inp), {})
    for call in (by_keyword, positional):
        groups = call.tensor_groups()
        assert [k for k, _ in groups] == [0, 1]
        assert groups[0][1][0] is not out and groups[0][1][0].data_ptr() == out.data_ptr()
        assert groups[1][1][0].shape == (2,)


def test_unmeasurable_dtypes_are_left_out_and_complex_is_measured_as_real_pairs():
    call = CallInfo(
        "all_gather", ("tensor_list", "tensor"), ([torch.ones(2, dtype=torch.bool)], torch.ones(2)), {}
    )
    assert [(k, len(ts)) for k, ts in call.tensor_groups()] == [(0, 0), (1, 1)]
    assert call.skipped == {torch.bool}
    complex_call = CallInfo("all_reduce", ("tensor",), (torch.ones(3, dtype=torch.complex64),), {})
    assert complex_call.tensor_groups()[0][1][0].shape == (3, 2)


def _site_helper(sites: CallSites):
    return sites.frames(), sys._getframe().f_lineno


def test_call_sites_render_the_reference_stack_and_pick_the_matching_frame():
    sites = CallSites([r"_site_helper"])
    frames, line = _site_helper(sites)
    stack = sites.stack(frames)
    first = stack.split(";")[0]
    assert first == f"{__file__}[{line}]   _site_helper"
    assert sites.site(frames) == f"test_collectives.py[{line}]"
    assert CallSites([r"no_such_function"]).site(frames) is None
    assert CallSites().site(frames) == f"test_collectives.py[{line}]"  # no patterns: innermost frame
    assert all("torch/nn/modules/module.py" not in part for part in stack.split(";"))
