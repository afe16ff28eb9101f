"""A real 2-process MindSpore data-parallel job (msrun, mccl on CPU) with a DistributedGradReducer.

The job also makes PyNative AllReduce / Broadcast / AllGather calls of its own, whose ``comm``
statistics are checked against numpy. (MindSpore has no CPU kernel for ReduceScatter.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import glob
import json
import os

import mindspore as ms
import numpy as np
import pandas as pd

from tests.adapters.mindspore.msrun import run_msrun
from tests.reference_stats import assert_stats_close

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_worker.py")
RANKS = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the job once; return each rank's result, its numpy copies and its CSV rows."""
    workdir = tmp_path_factory.mktemp("msrun")
    run_msrun(WORKER, workdir, RANKS)
    ranks = []
    for rank in range(RANKS):
        with open(workdir / f"result{rank}.json", encoding="utf-8") as handle:
            result = json.load(handle)
        copies = dict(np.load(workdir / f"result{rank}.npz"))
        frames = {
            prefix: pd.concat(
                pd.read_csv(path)
                for path in sorted(glob.glob(os.path.join(result["output_dir"], f"{prefix}_[0-9]*.csv")))
            )
            for prefix in (
                "grad_unreduced",
                "grad_reduced",
                "param_origin",
                "param_updated",
                "exp_avg",
                "other",
                "comm",
            )
        }
        ranks.append({**result, "copies": copies, "frames": frames, "workdir": workdir})
    return ranks


def _row(frame: pd.DataFrame, name: str, step: int) -> dict[str, float]:
    (row,) = frame[(frame["name"] == name) & (frame["step"] == step)].to_dict("records")
    return row


def test_every_rank_writes_its_own_complete_outputs(job):
    assert [r["rank"] for r in job] == [0, 1] and {r["size"] for r in job} == {RANKS}
    assert job[0]["output_dir"] != job[1]["output_dir"]
    for result in job:
        rank = result["rank"]
        assert f"-rank{rank}-" in os.path.basename(result["output_dir"])
        files = sorted(os.listdir(result["output_dir"]))
        prefixes = (
            "grad_unreduced",
            "grad_reduced",
            "param_origin",
            "param_updated",
            "exp_avg",
            "exp_avg_sq",
        )
        expected = sorted(
            [f"{p}_{s}-{s}.csv" for p in (*prefixes, "other", "comm") for s in range(result["steps"])]
            + ["trainmon_run.json"]
        )
        assert files == expected
        with open(os.path.join(result["output_dir"], "trainmon_run.json"), encoding="utf-8") as handle:
            info = json.load(handle)
        assert (info["framework"], info["framework_version"]) == ("mindspore", ms.__version__)
        assert (info["rank"], info["world_size"], info["root_modules"]) == (rank, RANKS, ["Net"])
        for prefix, frame in result["frames"].items():
            if prefix != "comm":
                assert len(frame) == len(result["names"]) * result["steps"]
        assert os.path.isdir(
            os.path.join(os.path.dirname(result["output_dir"]), "anomaly_detected", f"rank{rank}")
        )


def test_unreduced_gradients_are_each_ranks_own_and_reduced_the_mean(job):
    for result in job:
        copies, frames = result["copies"], result["frames"]
        for step in range(result["steps"]):
            for j, name in enumerate(result["names"]):
                local = copies[f"local/{step}/{j}"]
                reduced = copies[f"reduced/{step}/{j}"]
                mean = np.mean([r["copies"][f"local/{step}/{j}"].astype(np.float64) for r in job], axis=0)
                np.testing.assert_allclose(reduced, mean, rtol=1e-5, atol=1e-7)  # the reducer reduced
                what = f"rank {result['rank']} step {step} {name}"
                unreduced_row = _row(frames["grad_unreduced"], name, step)
                reduced_row = _row(frames["grad_reduced"], name, step)
                assert_stats_close(unreduced_row, local, what=f"{what} unreduced")
                assert_stats_close(reduced_row, reduced, what=f"{what} reduced")
                assert unreduced_row["norm"] != reduced_row["norm"]
    for step in range(job[0]["steps"]):
        first, second = (r["frames"]["grad_unreduced"] for r in job)
        assert not np.allclose(
            first[first["step"] == step].sort_values("name")["norm"],
            second[second["step"] == step].sort_values("name")["norm"],
        )


def test_parameters_and_moments_match_numpy_on_every_rank(job):
    for result in job:
        copies, frames = result["copies"], result["frames"]
        for step in range(result["steps"]):
            for j, name in enumerate(result["names"]):
                what = f"rank {result['rank']} step {step} {name}"
                for prefix in ("param_origin", "param_updated", "exp_avg"):
                    got = _row(frames[prefix], name, step)
                    assert_stats_close(got, copies[f"{prefix}/{step}/{j}"], what=f"{what} {prefix}")
                    if prefix != "exp_avg":
                        continue
                mg = _row(frames["other"], name, step)["mean"]
                if step == 0:
                    assert mg == 1.0
                else:
                    g = np.sign(copies[f"reduced/{step}/{j}"].astype(np.float64))
                    m = np.sign(copies[f"exp_avg/{step - 1}/{j}"].astype(np.float64))
                    assert mg == pytest.approx(((g * m).sum() / m.size + 1) / 2, rel=1e-5)


#: the job's own collective calls per step: op -> indices of its calls (see dp_worker.py).
CALLS = {"AllReduce": [0, 1], "Broadcast": [2], "AllGather": [3]}


def _call_data(copies: dict, io: str, calls: list[int], op: str, step: int) -> np.ndarray:
    """All tensors of the given calls' inputs or outputs at one step, concatenated (float64)."""
    arrays = [
        copies[key].astype(np.float64).ravel()
        for i in calls
        for key in sorted(k for k in copies if k.startswith(f"cc_{io}_{i}_{op}/{step}/"))
    ]
    return np.concatenate(arrays)


def test_collective_statistics_match_numpy_over_each_steps_calls(job):
    ops = ["min", "max", "norm", "mean", "zeros", "nans"]
    for result in job:
        copies, frame = result["copies"], result["frames"]["comm"]
        assert list(frame.columns) == ["vpp_stage", "name", "step", *ops, "calls"]
        for step in range(result["steps"]):
            names = set(frame[frame["step"] == step]["name"])
            # the AllGather primitive was created after set_monitor: wrapped from the second step on
            seen = [op for op in CALLS if op != "AllGather" or step > 0]
            assert names == {f"{op}.{phase}_0" for op in seen for phase in ("pre", "post")}
            for op in seen:
                for phase, io in (("pre", "in"), ("post", "out")):
                    row = _row(frame, f"{op}.{phase}_0", step)
                    data = _call_data(copies, io, CALLS[op], op, step)
                    assert_stats_close(row, data, ops, what=f"rank {result['rank']} step {step} {op} {phase}")
                    assert row["calls"] == len(CALLS[op])
    for result in job:  # wrapped per instance while monitored, their own class again after stop()
        assert result["wrapped"] == [True] * 4  # the reducer's AllReduce too (it still reduced: above)
        assert result["restored"] == [True] * 4
    for step in range(job[0]["steps"]):  # the collectives really ran: AllReduce summed the ranks' inputs
        for result in job:
            summed = sum(_call_data(r["copies"], "in", [1], "AllReduce", step) for r in job)
            np.testing.assert_allclose(
                _call_data(result["copies"], "out", [1], "AllReduce", step), summed, rtol=1e-5, atol=1e-7
            )


def _line_of(text: str) -> int:
    with open(WORKER, encoding="utf-8") as handle:
        (line,) = [i for i, source in enumerate(handle, start=1) if text in source]
    return line


def test_cc_codeline_keeps_only_the_matching_call_site(job):
    site = f"dp_worker.py[{_line_of('return all_reduce(loss.reshape(1))')}]"
    ops = ["min", "max", "norm", "mean", "zeros", "nans"]
    for result in job:
        rank = result["rank"]
        assert len(result["codeline"]) == result["steps"]
        for step, latest in enumerate(result["codeline"]):
            tag = f"0:AllReduce.post_0@{site}/rank{rank}/comm"
            assert set(latest) == {tag}  # the other AllReduce, Broadcast and AllGather calls are left out
            data = _call_data(result["copies"], "out", [0], "AllReduce", step)
            assert_stats_close(latest[tag], data, ops, what=f"rank {rank} step {step}")
            assert latest[tag]["calls"] == 1


def test_cc_log_only_logs_each_call_once_and_stops_after_the_first_step(job):
    site = f"dp_worker.py[{_line_of('return all_reduce(loss.reshape(1))')}]"
    for result in job:
        log = result["log_only"]
        assert log["stopped_at"] == 0
        all_gather, all_reduce = sorted(log["messages"])
        assert all_reduce.startswith("trainmon: collective AllReduce (group size 2; Float32[1]) called from:")
        assert f"{site}   _summed_loss" in all_reduce
        assert all_gather.startswith("trainmon: collective AllGather (group size 2; Float32[12, 16]) called")
        for left_out in ("mindspore/nn/cell.py", "adapters/mindspore/cc_wrap.py"):  # frames not shown
            assert left_out not in all_reduce + all_gather
