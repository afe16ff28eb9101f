"""Four real gloo ranks: per-rank outputs, de-duplication over parallel groups, anomalies per rank.

Part 1: DDP over the world (dp_group = WORLD) with a pipeline-like group {0,1} {2,3} passed as
``process_group``; rank 2's loss is scaled by 1e4 at step 6, a gradient spike that only rank 2
sees before the reduction. Every rank must write every collected step; only data-parallel rank
0 writes the reduced gradients; the anomaly files carry each rank's own rank, pp_stage and
group_mates; the analysis ranks rank 2's step-6 unreduced gradient first.

Part 2: tensor parallel 2 x data parallel 2 (tp groups {0,1} {2,3}, dp groups {0,2} {1,3}), with
the first layer's parameters marked ``tensor_model_parallel`` the way Megatron marks its shards:
reduced gradients of replicated parameters come from tp rank 0 of dp rank 0 only, shards from
every tp rank of dp rank 0.
"""

from __future__ import annotations

import csv
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from monitor.anomaly.analyse import main as analyse_main
from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import MLP, assert_stats_close, make_batches

pytestmark = pytest.mark.distributed

STEPS, SPIKE_STEP, SPIKE_RANK, WINDOW = 8, 6, 2, 4
PARAMS = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "layers.2.weight"]
PARAMS += ["layers.2.bias", "norm.weight", "norm.bias"]
SHARDED = ["layers.0.weight", "layers.0.bias"]
TARGET = torch.linspace(-1.0, 1.0, 4)  # a regression target: every layer gets a real gradient


def _train_ddp(rank: int, workdir: str, pp_group) -> dict:
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "dp")
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "cc_distribution": {"enable": True},
        "ops": ["norm", "max"],
        "step_count_per_record": WINDOW,
        "alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"warmup": 3}}], "dump": True},
    }
    mon = TrainerMon(config, process_group=pp_group)  # before the first collective of the run
    mon.set_monitor(model, 1, optimizer, dp_group=dist.group.WORLD)
    for step, (x,) in enumerate(make_batches(STEPS, 1, seed=100 + rank)):
        loss = (model(x) - TARGET).pow(2).mean()
        (loss * (1e4 if (step, rank) == (SPIKE_STEP, SPIKE_RANK) else 1.0)).backward()
        mean_loss = loss.detach().reshape(1)
        dist.all_reduce(mean_loss)  # the usual logging all_reduce: seen as a comm row
        optimizer.step()
        optimizer.zero_grad()
        got = mon._core.latest.latest("comm")[f"0:all_reduce.post_0/rank{rank}/comm"]
        assert got["calls"] == 1
        assert_stats_close(got, mean_loss.numpy().copy(), ops=["norm", "max"], what=f"step {step} comm")
    out = mon.output_dir
    mon.stop()
    return {"dir": out}


def _train_tp_dp(rank: int, workdir: str, tp_group, dp_group) -> dict:
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "tp")
    tp_rank, dp_rank = dist.get_group_rank(tp_group, rank), dist.get_group_rank(dp_group, rank)
    torch.manual_seed(0)
    module = MLP()
    torch.manual_seed(1 + tp_rank)  # shards differ between tp ranks, replicated parameters do not
    for name, param in module.named_parameters():
        if name in SHARDED:
            param.tensor_model_parallel = True
            torch.nn.init.normal_(param.data)
    model = DistributedDataParallel(module, process_group=dp_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm"]})
    mon.set_monitor(model, 1, optimizer, tp_group=tp_group, dp_group=dp_group)
    for (x,) in make_batches(2, 1, seed=100 + dp_rank):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    out = mon.output_dir
    mon.stop()
    return {"dir": out}


def _worker(rank: int, world_size: int, workdir: str) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # pipeline-like in part 1, tp in part 2
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    result = {"dp": _train_ddp(rank, workdir, pairs[rank // 2])}
    result["tp"] = _train_tp_dp(rank, workdir, pairs[rank // 2], columns[rank % 2])
    save_result(workdir, rank, result)


def _files(directory: str, prefix: str) -> list[str]:
    """The CSV windows of one data type (``exp_avg_0-3.csv``, not ``exp_avg_sq_0-3.csv``)."""
    pattern = re.compile(re.escape(prefix) + r"_\d+-\d+\.csv")
    return sorted(name for name in os.listdir(directory) if pattern.fullmatch(name))


def _rows(directory: str, prefix: str) -> dict[int, list[str]]:
    """step -> row names, from every CSV window of one data type."""
    steps: dict[int, list[str]] = {}
    for path in (os.path.join(directory, name) for name in _files(directory, prefix)):
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                steps.setdefault(int(row["step"]), []).append(row["name"])
    return steps


def _anomalies(root: str, rank: int) -> list[dict]:
    with open(os.path.join(root, "anomaly_detected", f"rank{rank}", "anomaly.json")) as handle:
        return list(json.load(handle).values())


def test_four_ranks_outputs_dedup_and_anomalies(tmp_path):
    results = run_ranks(_worker, 4, str(tmp_path))
    every_step = list(range(STEPS))
    windows = [f"{a}-{a + WINDOW - 1}" for a in range(0, STEPS, WINDOW)]
    dp_root = str(tmp_path / "dp")
    assert len(os.listdir(dp_root)) == 4 + 1  # one directory per rank, plus anomaly_detected
    for rank, result in enumerate(results):
        directory = result["dp"]["dir"]
        assert f"-rank{rank}-" in os.path.basename(directory)
        for prefix in ("grad_unreduced", "exp_avg", "exp_avg_sq", "comm"):
            rows = _rows(directory, prefix)
            assert sorted(rows) == every_step, f"rank {rank} {prefix}: steps {sorted(rows)}"
            want = ["all_reduce.post_0"] if prefix == "comm" else PARAMS
            assert all(sorted(names) == sorted(want) for names in rows.values()), (rank, prefix)
            assert _files(directory, prefix) == [f"{prefix}_{w}.csv" for w in windows]
        reduced = _rows(directory, "grad_reduced")
        if rank == 0:
            assert sorted(reduced) == every_step and all(
                sorted(n) == sorted(PARAMS) for n in reduced.values()
            )
        else:
            assert reduced == {}, f"dp rank {rank} must not write reduced gradients"

        records = _anomalies(dp_root, rank)
        for record in records:
            assert record["rank"] == rank
            assert record["pp_stage"] == rank % 2
            assert record["group_mates"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
            assert record["step"] >= SPIKE_STEP, record  # nothing flagged before the spike
        local = [r for r in records if r["tag_name"].endswith("/acc_grad")]
        if rank == SPIKE_RANK:  # most of its own gradients jumped by ~1e4 (the rule decides which)
            assert len({r["tag_name"] for r in local if r["step"] == SPIKE_STEP}) >= len(PARAMS) // 2
        else:  # the others see it only after the reduction, in the optimizer state or reduced grads
            assert local == []

    anomaly_dir = os.path.join(dp_root, "anomaly_detected")
    assert analyse_main(["-d", anomaly_dir, "-k", "3"]) == 0
    with open(os.path.join(anomaly_dir, "anomaly_analyse.json")) as handle:
        top = list(json.load(handle).values())
    assert len(top) == 3
    assert (top[0]["rank"], top[0]["step"]) == (SPIKE_RANK, SPIKE_STEP)
    assert top[0]["tag_name"].endswith("/acc_grad")

    for rank, result in enumerate(results):
        directory = result["tp"]["dir"]
        assert sorted(_rows(directory, "grad_unreduced")) == [0, 1]
        reduced = _rows(directory, "grad_reduced")
        tp_rank, dp_rank = rank % 2, rank // 2
        if dp_rank != 0:
            want = []
        elif tp_rank == 0:
            want = PARAMS
        else:
            want = SHARDED
        assert {step: sorted(names) for step, names in reduced.items()} == (
            {0: sorted(want), 1: sorted(want)} if want else {}
        ), f"rank {rank}"
