"""The trainmon plugin's JSON and binary routes on real run directories (no browser).

The plugin object is the one TensorBoard builds; its WSGI routes are called with werkzeug's test
client. Expected values come from the files themselves, read here with the csv module or
TensorBoard's EventAccumulator.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

import dashboards.plugin.sources as sources_module
import dashboards.plugin.store as store_module
from monitor import TrainerMon
from monitor.anomaly.analyse import main as analyse_main
from monitor.record import RowSet, StepRecord
from monitor.writers.tensorboard import TensorBoardWriter
from tests.dashboards.conftest import (
    DEMO_SPIKE,
    DEMO_STEPS,
    NAMES,
    OPS,
    Api,
    anomaly_records,
    generated_value,
    incident_documents,
    rank_dir,
    read_csv_rows,
    same,
    write_run,
)
from tests.extras import OUTPUT_FORMATS


@pytest.fixture
def fresh(monkeypatch):
    """No waiting between directory scans (live-update tests)."""
    monkeypatch.setattr(sources_module, "REFRESH_SECONDS", 0.0)
    monkeypatch.setattr(store_module, "DISCOVERY_SECONDS", 0.0)


# -- the demo's outputs ---------------------------------------------------------------------------


def test_an_empty_runs_list_says_whether_the_logdir_is_missing_or_one_ranks_directory(tmp_path):
    """What the tab tells a user whose TensorBoard shows nothing: a logdir that does not exist,
    or one rank's directory where the output directory holding them was meant."""
    missing = Api(tmp_path / "nowhere").json("/runs")
    assert missing["runs"] == [] and missing["logdir"] == {"exists": False, "rank_directory": False}
    rank = write_run(tmp_path / "out")[0]
    inside = Api(rank).json("/runs")
    assert inside["runs"] == [] and inside["logdir"] == {"exists": True, "rank_directory": True}
    assert Api(tmp_path / "out").json("/runs")["logdir"] == {"exists": True, "rank_directory": False}


def test_a_runs_id_stays_while_its_ranks_write(tmp_path):
    """The page keeps what the user looks at by the run's id: ranks started within one second
    must not swap the id as each one's directory changes (written in turn by a live run)."""
    root = tmp_path / "out"
    write_run(root, ranks=(0, 1))
    ids = []
    for rank, stamp in ((1, 1_000_000), (0, 2_000_000), (1, 3_000_000)):
        os.utime(rank_dir(root, rank), (stamp, stamp))
        (run,) = Api(root).json("/runs")["runs"]
        ids.append(run["id"])
    assert ids == [f".#{rank_dir(root, 0).name}"] * 3, ids


def test_runs_lists_both_demo_formats_with_their_data_types(demo_runs):
    runs = Api(demo_runs["csv"].parent).runs()
    assert set(runs) == {"demo_csv", "demo_tensorboard"}
    assert runs["demo_csv"]["format"] == "csv" and runs["demo_tensorboard"]["format"] == "tensorboard"
    csv_dir = rank_dir(demo_runs["csv"])
    prefixes = {p.name.rsplit("_", 1)[0] for p in csv_dir.glob("*.csv")}
    for run in runs.values():
        assert set(run["prefixes"]) == prefixes
        assert run["ranks"] == [0]
        for entry in run["prefixes"].values():
            assert entry["first_step"] == 0 and entry["last_step"] == DEMO_STEPS - 1
            assert {"norm", "min", "max"} <= set(entry["ops"])


def test_landing_is_the_first_anomaly_and_anomalies_follow_the_analysis_cli(demo_runs, tmp_path):
    api = Api(demo_runs["csv"].parent)
    run = api.runs()["demo_csv"]
    listed = api.json("/anomalies", run=run["id"])
    records = anomaly_records(demo_runs["csv"])
    assert listed["total"] == len(records) > 0 and run["anomalies"] == len(records)
    assert (
        analyse_main(["-d", str(demo_runs["csv"] / "anomaly_detected"), "-k", "100000", "-o", str(tmp_path)])
        == 0
    )
    cli = list(json.loads((tmp_path / "anomaly_analyse.json").read_text()).values())
    assert [(a["tag"], a["op"], a["step"], a["rank"]) for a in listed["items"]] == [
        (r["tag_name"], r["op"], r["step"], r["rank"]) for r in cli
    ]
    first = listed["items"][0]
    assert first["step"] == DEMO_SPIKE
    # the demo's run has one incident (incidents.json): the tab opens on its root
    (document,) = incident_documents(demo_runs["csv"]).values()
    (incident,) = document["incidents"]
    root = incident["root"]
    assert incident["onset_step"] == DEMO_SPIKE and run["incidents"] == 1
    assert run["landing"] == {
        "prefix": root["prefix"],
        "op": root["op"],
        "rank": 0,
        "anomaly": None,
        "incident": 1,
    }


@pytest.mark.parametrize("prefix", ["grad_reduced", "grad_unreduced", "exp_avg_sq"])
def test_csv_heatmap_holds_every_csv_value_in_model_order(demo_runs, prefix):
    api = Api(demo_runs["csv"].parent)
    run = api.runs()["demo_csv"]
    rows = read_csv_rows(rank_dir(demo_runs["csv"]), prefix)
    model_order = list(
        dict.fromkeys(r["name"] for r in read_csv_rows(rank_dir(demo_runs["csv"]), "param_origin"))
    )
    for op in ("norm", "min"):
        view = api.heatmap(run=run["id"], prefix=prefix, op=op, rank=0, cols=100)
        assert view["steps"] == list(range(DEMO_STEPS)) and not view["sampled"]
        assert (
            view["rows"] == model_order
        )  # grad_unreduced is written in backward order; shown in model order
        assert view["present"].all()
        for row in rows:
            got = view["values"][view["rows"].index(row["name"]), view["steps"].index(row["step"])]
            assert same(got, row["values"][op]), (row, op)


def test_tensorboard_heatmap_equals_what_tensorboard_reads(demo_runs):
    api = Api(demo_runs["csv"].parent)
    run = api.runs()["demo_tensorboard"]
    accumulator = EventAccumulator(str(rank_dir(demo_runs["tensorboard"])), size_guidance={SCALARS: 0})
    accumulator.Reload()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="max", rank=0)
    assert view["present"].all() and view["steps"] == list(range(DEMO_STEPS))
    checked = 0
    for tag in accumulator.Tags()["scalars"]:
        if not tag.endswith("/post_grad_max"):
            continue
        name = tag.split("/")[0].split(":", 1)[1]
        for event in accumulator.Scalars(tag):
            got = view["values"][view["rows"].index(name), view["steps"].index(event.step)]
            assert np.float32(got) == np.float32(event.value)
            checked += 1
    assert checked == len(view["rows"]) * DEMO_STEPS > 0


def test_series_and_tag_view_match_the_csv(demo_runs):
    api = Api(demo_runs["csv"].parent)
    run = api.runs()["demo_csv"]
    rows = [
        r for r in read_csv_rows(rank_dir(demo_runs["csv"]), "exp_avg") if r["name"] == "layers.1.proj.weight"
    ]
    query = dict(run=run["id"], prefix="exp_avg", op="norm", vpp=0, name="layers.1.proj.weight", micro=-1)
    series = api.json("/series", **query)
    assert series["ranks"] == [0] and series["steps"] == [r["step"] for r in rows]
    assert series["values"] == [[r["values"]["norm"] for r in rows]]
    tag_view = api.heatmap(mode="tag", **query)
    assert tag_view["rows"] == ["rank 0"] and tag_view["values"][0].tolist() == series["values"][0]


# -- generated runs -------------------------------------------------------------------------------


def test_nan_inf_and_missing_cells_are_told_apart(tmp_path):
    special = {
        (0, "grad_reduced", 2, 1, "norm"): float("nan"),
        (0, "grad_reduced", 3, 2, "norm"): float("inf"),
        (0, "grad_reduced", 4, 0, "norm"): float("-inf"),
    }
    write_run(tmp_path, special=special, skip={(0, "grad_reduced", 5): [3]})
    api = Api(tmp_path)
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    rows = read_csv_rows(next(tmp_path.glob("*-rank0-*")), "grad_reduced")
    assert len(rows) == 4 * 6 - 1
    for row in rows:
        got = view["values"][view["rows"].index(row["name"]), row["step"]]
        assert same(got, row["values"]["norm"])
    values, present = view["values"], view["present"]
    assert math.isnan(values[1, 2]) and values[2, 3] == math.inf and values[0, 4] == -math.inf
    assert present[1, 2] and present[2, 3] and present[0, 4]
    assert not present[3, 5] and present.sum() == len(rows)


def test_parquet_heatmap_holds_every_value_the_files_hold(tmp_path, fresh):
    """format parquet: every value as pyarrow reads it from the files, NaN, Inf and missing cells
    told apart, rows of several merged files and a step file, micro-steps as their own rows."""
    from monitor.writers.parquet import ParquetWriter

    special = {
        (0, "grad_reduced", 2, 1, "norm"): float("nan"),
        (0, "grad_reduced", 3, 2, "norm"): float("inf"),
    }
    write_run(
        tmp_path, fmt="parquet", window=2, steps=range(5), special=special, skip={(0, "grad_reduced", 4): [3]}
    )
    expected = {  # what write_run wrote
        (name, step, op): special.get(
            (0, "grad_reduced", step, row, op), generated_value(0, 0, step, row, op)
        )
        for step in range(5)
        for row, name in enumerate(NAMES)
        for op in OPS
        if (step, row) != (4, 3)
    }
    assert len(expected) == (4 * 5 - 1) * 4
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert run["format"] == "parquet" and run["prefixes"]["grad_reduced"]["last_step"] == 4
    for op in ("norm", "max", "nans"):
        view = api.heatmap(run=run["id"], prefix="grad_reduced", op=op, rank=0)
        assert view["steps"] == list(range(5)) and view["rows"] == list(NAMES)
        for (name, step, value_op), value in expected.items():
            if value_op == op:
                assert same(view["values"][view["rows"].index(name), step], value), (name, step, op)
        assert view["present"].sum() == 4 * 5 - 1 and not view["present"][3, 4]
    micro_dir = tmp_path / "Jan02_03-04-05-rank1-00000001"
    writer = ParquetWriter(micro_dir, 1)
    rows = RowSet.build([0, 0], ["a", "a"], 1, "actv", micro_steps=[0, 1])
    writer.write(StepRecord("actv", 0, ("norm",), rows, np.array([[1.5], [2.5]])))
    writer.close()
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="actv", op="norm", rank=1)
    assert view["rows"] == ["a:0", "a:1"] and view["values"][:, 0].tolist() == [1.5, 2.5]


def test_sampling_keeps_first_last_and_anomaly_steps(tmp_path):
    write_run(tmp_path, steps=range(200), anomalies=[(0, "grad_reduced", 137, 2, "norm")])
    api = Api(tmp_path)
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0, cols=20)
    assert view["sampled"] and len(view["steps"]) <= 20
    assert view["steps"][0] == 0 and view["steps"][-1] == 199 and 137 in view["steps"]
    assert view["anomaly_cells"] == [[2, view["steps"].index(137), 0]]
    full = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0, lo=130, hi=149, cols=50)
    assert full["steps"] == list(range(130, 150)) and not full["sampled"]


def test_many_anomalies_do_not_blow_the_column_budget(tmp_path):
    flagged = [(0, "grad_reduced", step, 1, "norm") for step in range(50, 200)]
    write_run(tmp_path, steps=range(200), anomalies=flagged)
    api = Api(tmp_path)
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0, cols=20)
    assert len(view["steps"]) <= 20 and {50, 51, 52, 53, 54} <= set(view["steps"])  # the earliest ones
    assert len(view["anomaly_cells"]) == len(set(view["steps"]) & set(range(50, 200)))


def test_tag_view_puts_ranks_in_rows(tmp_path):
    write_run(tmp_path, ranks=(0, 1, 2), fmt="tensorboard", prefixes=("grad_reduced", "exp_avg"))
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert run["ranks"] == [0, 1, 2] and run["format"] == "tensorboard"
    query = dict(run=run["id"], prefix="exp_avg", op="min", vpp=0, name="layers.0.fc2.weight", micro=-1)
    view = api.heatmap(mode="tag", **query)
    assert view["rows"] == ["rank 0", "rank 1", "rank 2"]
    for rank in range(3):
        accumulator = EventAccumulator(
            str(next(tmp_path.glob(f"*-rank{rank}-*"))), size_guidance={SCALARS: 0}
        )
        accumulator.Reload()
        events = accumulator.Scalars(f"0:layers.0.fc2.weight/rank{rank}/exp_avg_min")
        assert [e.step for e in events] == view["steps"]
        assert [np.float32(e.value) for e in events] == [np.float32(v) for v in view["values"][rank]]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_rank_missing_its_last_window_does_not_hide_the_other_ranks_steps(tmp_path, fmt):
    """One tag on every rank: the steps were chosen on the lowest rank alone, so rank 1's steps
    4-5 vanished from the view and the line chart when rank 0 lost its last file."""
    dirs = write_run(tmp_path, ranks=(0, 1), steps=range(6), window=2, fmt=fmt)
    if fmt == "csv":
        (dirs[0] / "grad_reduced_4-5.csv").unlink()
    else:
        (dirs[0] / "values" / "data_type=grad_reduced" / "steps-0000000004-0000000005.parquet").unlink()
    api = Api(tmp_path)
    (run,) = api.runs().values()
    query = dict(run=run["id"], prefix="grad_reduced", op="norm", vpp=0, name=NAMES[0], micro=-1)
    view = api.heatmap(mode="tag", **query)
    assert view["steps"] == list(range(6))
    assert view["present"][0].tolist() == [True] * 4 + [False] * 2 and view["present"][1].all()
    assert api.json("/series", **query)["steps"] == list(range(6))
    for directory in dirs.values():  # a window no rank has a file for: empty, not an error
        for part in [*directory.glob("grad_reduced_2-3.csv"), *directory.glob("values/*/steps-0000000002-*")]:
            part.unlink()
    assert Api(tmp_path).json("/series", **query, lo=2, hi=3)["steps"] == []


def test_anomaly_filters_by_rank_and_data_type(tmp_path):
    found = [(0, "grad_reduced", 3, 1, "norm"), (1, "exp_avg", 2, 0, "max"), (1, "grad_reduced", 1, 3, "min")]
    write_run(tmp_path, ranks=(0, 1), prefixes=("grad_reduced", "exp_avg"), anomalies=found)
    api = Api(tmp_path)
    (run,) = api.runs().values()
    everything = api.json("/anomalies", run=run["id"])
    assert [(a["rank"], a["step"]) for a in everything["items"]] == [(1, 1), (1, 2), (0, 3)]  # step first
    assert everything["counts"] == {
        "rank": [[0, 1], [1, 2]],
        "prefix": [["exp_avg", 1], ["grad_reduced", 2]],
        "rule": [["AnomalyNan", 3]],  # the rule named in write_run's messages
    }
    by_rank = api.json("/anomalies", run=run["id"], rank=1)
    assert [(a["rank"], a["prefix"]) for a in by_rank["items"]] == [(1, "grad_reduced"), (1, "exp_avg")]
    both = api.json("/anomalies", run=run["id"], rank=1, prefix="exp_avg")
    assert [(a["step"], a["op"], a["row"]) for a in both["items"]] == [
        (2, "max", [0, "embedding.weight", -1])
    ]
    assert both["matching"] == 1 and both["total"] == 3
    # AnomalyDump always writes incidents.json; these hand-made anomalies belong to no incident
    assert run["incidents"] == 0
    assert run["landing"] == {
        "prefix": "grad_reduced",
        "op": "min",
        "rank": 1,
        "anomaly": 0,
        "incident": None,
    }


def test_an_older_run_whose_anomaly_files_a_newer_one_replaced_says_so(tmp_path):
    """Two runs into one output directory: the newer run's anomaly files replace the older's
    (kept aside as ``.earlier-<time>``), so the older run lists none and says why."""
    write_run(tmp_path, anomalies=[(0, "grad_reduced", 3, 1, "norm")])
    write_run(tmp_path, anomalies=[(0, "grad_reduced", 2, 0, "norm")], stamp="Jan02_03-05-05")
    assert list((tmp_path / "anomaly_detected" / "rank0").glob("anomaly.json.earlier-*"))
    runs = sorted(Api(tmp_path).runs().values(), key=lambda run: run["name"])
    assert [(run["replaced"], run["anomalies"], run["newest"]) for run in runs] == [
        (True, 0, False),
        (False, 1, True),
    ]
    plain = tmp_path / "without_anomaly_files"  # nothing was replaced: neither says so
    write_run(plain)
    write_run(plain, stamp="Jan02_03-05-05")
    runs = sorted(Api(plain).runs().values(), key=lambda run: run["name"])
    assert [(run["replaced"], run["newest"]) for run in runs] == [(False, False), (False, True)]


def test_landing_without_anomalies_opens_the_newest_data(tmp_path):
    write_run(tmp_path, prefixes=("exp_avg",), steps=range(3))
    write_run(tmp_path, prefixes=("grad_reduced",), steps=range(5), stamp="Jan02_03-04-06", ranks=(1,))
    (run,) = Api(tmp_path).runs().values()
    assert run["landing"] == {
        "prefix": "grad_reduced",
        "op": "norm",
        "rank": 1,
        "anomaly": None,
        "incident": None,
    }
    assert run["incidents"] is None  # no anomaly files at all


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_new_steps_appear_while_the_run_goes_on(tmp_path, fresh, fmt):
    dirs = write_run(tmp_path, fmt=fmt, steps=range(3), window=10)
    api = Api(tmp_path)
    (run,) = api.runs().values()
    before = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert before["steps"] == [0, 1, 2]
    names = ["embedding.weight", "layers.0.fc1.weight", "layers.0.fc2.weight", "head.weight"]
    rows = RowSet.build([0] * 4, names, 0, "post_grad")
    values = np.arange(16, dtype=float).reshape(4, 4) + 1000.0
    if fmt == "csv":  # the same file grows (window of 10 steps): size and mtime change
        from monitor.writers.csv import CsvWriter

        writer = CsvWriter(dirs[0], 6, 10)
    elif fmt == "parquet":  # a step file next to the merged one
        from monitor.writers.parquet import ParquetWriter

        writer = ParquetWriter(dirs[0], 0)
    else:
        writer = TensorBoardWriter(dirs[0])
    writer.write(StepRecord("grad_reduced", 3, ("norm", "min", "max", "nans"), rows, values))
    writer.close()
    (after_run,) = api.runs().values()
    assert after_run["version"] != run["version"]
    assert after_run["prefixes"]["grad_reduced"]["last_step"] == 3
    after = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert after["steps"] == [0, 1, 2, 3]
    assert after["values"][:, 3].tolist() == [1000.0, 1004.0, 1008.0, 1012.0]
    assert np.array_equal(after["values"][:, :3], before["values"])


def test_a_csv_window_that_filled_up_after_it_was_read_is_read_again(tmp_path, fresh):
    """A window's file is read while its steps are still being written; its last step lands
    as the next window's file appears. The next look reads it again: no step of it stays missing."""
    from monitor.writers.csv import CsvWriter

    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    directory.mkdir()
    rows = RowSet.build([0, 0], ["a.weight", "b.weight"], 0, "post_grad")
    writer = CsvWriter(directory, 6, 2)  # windows of two steps: steps 0-1, then 2-3
    writer.write(StepRecord("grad_reduced", 0, ("norm",), rows, np.array([[1.0], [2.0]])))
    writer.end_step(0)  # flushed
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)["steps"] == [0]
    for step in (1, 2):
        writer.write(StepRecord("grad_reduced", step, ("norm",), rows, np.array([[1.0], [2.0]]) + step))
        writer.end_step(step)
    writer.close()
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert view["steps"] == [0, 1, 2] and view["values"][:, 1].tolist() == [2.0, 3.0]


def test_a_stray_newest_csv_file_does_not_hide_its_data_type(tmp_path):
    """A file named like the newest window but holding no monitor rows: the data type is still
    listed and shown from the files that can be read."""
    directory = write_run(tmp_path, steps=range(4))[0]
    (directory / "grad_reduced_50-59.csv").write_text("junk\nmore junk\n")
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert run["prefixes"]["grad_reduced"]["last_step"] == 3
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert view["steps"] == [0, 1, 2, 3]


@pytest.mark.parametrize("fault", ["cut short", "other columns"])
def test_an_unreadable_newest_parquet_file_does_not_hide_its_data_type(tmp_path, fault):
    """The ops come from the newest file that can be read: a newest file cut short by a disk
    fault, or a stray one of other columns, hid the rank's whole data type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = write_run(tmp_path, fmt="parquet", steps=range(4))[0]
    newest = directory / "values" / "data_type=grad_reduced" / "step-0000000003.parquet"
    if fault == "cut short":
        newest.write_bytes(newest.read_bytes()[:-100])
    else:
        pq.write_table(pa.table({"a": [1.0]}), newest)
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert "norm" in run["prefixes"]["grad_reduced"]["ops"]
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert view["steps"] == [0, 1, 2] and view["skipped"] == 1


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_unreadable_files_are_skipped_not_fatal(tmp_path, fmt):
    directory = write_run(tmp_path, fmt=fmt, steps=range(4))[0]
    if fmt == "csv":
        (directory / "grad_reduced_2-2.csv").write_text("something,else\n1,2\n")  # not a monitor file
    elif fmt == "parquet":  # one step's file cut short
        part = directory / "values" / "data_type=grad_reduced" / "step-0000000002.parquet"
        part.write_bytes(part.read_bytes()[:-100])
    else:
        (event_file,) = directory.glob("events.out.tfevents.*")
        data = bytearray(event_file.read_bytes())
        data[-10] ^= 0xFF  # inside the last record's data: its checksum no longer matches
        event_file.write_bytes(bytes(data))
    api = Api(tmp_path)
    (run,) = api.runs().values()
    view = api.heatmap(run=run["id"], prefix="grad_reduced", op="norm", rank=0)
    assert view["steps"] == ([0, 1, 2] if fmt == "tensorboard" else [0, 1, 3]) and view["skipped"] == 1
    assert view["present"].all()


# -- requests that must be refused ----------------------------------------------------------------


def test_path_traversal_and_links_out_of_the_logdir_are_refused(tmp_path):
    outside = tmp_path / "outside"
    secret = write_run(outside, anomalies=[(0, "grad_reduced", 1, 0, "norm")])[0]
    logdir = tmp_path / "logdir"
    write_run(logdir / "real")
    (logdir / "linked_root").symlink_to(outside, target_is_directory=True)  # a root behind a link
    (logdir / "real" / "Jan02_03-04-05-rank5-00000005").symlink_to(secret, target_is_directory=True)
    real_rank = next((logdir / "real").glob("*-rank0-*"))
    (real_rank / "exp_avg_0-0.csv").symlink_to(next(secret.glob("grad_reduced_0-0.csv")))
    api = Api(logdir)
    runs = api.runs()
    assert list(runs) == ["real"]
    assert runs["real"]["ranks"] == [0] and set(runs["real"]["prefixes"]) == {"grad_reduced"}
    for run_id in ("../outside", "linked_root", "/etc", "../../../../etc/passwd", "linked_root#x", "real#x"):
        response = api.get("/heatmap", run=run_id, prefix="grad_reduced", op="norm", rank=0)
        assert response.status_code == 404 and "no run" in response.get_json()["error"]
    response = api.get("/anomalies", run="linked_root")
    assert response.status_code == 404
    response = api.get("/heatmap", run=runs["real"]["id"], prefix="exp_avg", op="norm", rank=0)
    assert response.status_code == 404  # the symlinked CSV file is not read


@pytest.mark.parametrize(
    ("query", "code", "words"),
    [
        ({}, 400, "run: required"),
        ({"prefix": "nope", "op": "norm"}, 404, "prefix"),
        ({"prefix": "grad_reduced", "op": "entropy"}, 404, "op"),
        ({"prefix": "grad_reduced", "op": "norm", "cols": "0"}, 400, "cols"),
        ({"prefix": "grad_reduced", "op": "norm", "lo": "5", "hi": "2"}, 400, "steps 5 to 2: the range is"),
        (  # the range's end left empty: the run's last step, named as such
            {"prefix": "grad_reduced", "op": "norm", "lo": "100"},
            400,
            "steps 100 to 5: the range is empty (grad_reduced has steps 0-5)",
        ),
        ({"prefix": "grad_reduced", "op": "norm", "rank": "x"}, 400, "rank: expected an integer"),
        ({"prefix": "grad_reduced", "op": "norm", "rank": "7"}, 404, "rank: 7"),
        ({"prefix": "grad_reduced", "op": "norm", "mode": "tag"}, 400, "name: required"),
    ],
)
def test_bad_parameters_get_a_clear_error(tmp_path, query, code, words):
    write_run(tmp_path)
    api = Api(tmp_path)
    if query:
        query = {"run": next(iter(api.runs().values()))["id"], **query}
    response = api.get("/heatmap", **query)
    assert response.status_code == code and words in response.get_json()["error"]


def test_static_files_are_a_fixed_list(tmp_path):
    api = Api(tmp_path)
    assert not api.plugin.is_active()  # nothing under the logdir yet
    for name in ("index.js", "heatmap.js", "chart.js", "dom.js", "lists.js", "style.css"):
        response = api.get(f"/{name}")
        assert response.status_code == 200 and len(response.get_data()) > 500
    assert set(api.apps) == {
        "/index.js",
        "/heatmap.js",
        "/chart.js",
        "/dom.js",
        "/lists.js",
        "/style.css",
        "/runs",
        "/anomalies",
        "/incidents",
        "/heatmap",
        "/series",
    }
    assert os.path.basename(api.plugin.frontend_metadata().es_module_path) == "index.js"


class _Doubler(torch.nn.Module):
    """A root module with a child, so the heatmap holds root and child rows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x) * 2


@pytest.mark.parametrize("fmt", ["csv", "tensorboard"])
def test_root_module_rows_show_its_class_and_files_keep_msprobe_names(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    model = _Doubler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {
        "xy_distribution": True,
        "all_xy": True,
        "ops": ["norm"],
        "format": fmt,
        "alert": {"dump": True},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    for step in range(2):
        model(torch.full((2, 3), math.nan if step else 1.0)).sum().backward()  # a NaN input at step 1
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    directory = rank_dir(tmp_path)
    info = json.loads((directory / "trainmon_run.json").read_text())
    assert info["framework"] == "torch" and info["framework_version"] == torch.__version__
    assert (info["rank"], info["world_size"], info["root_modules"]) == (0, 1, ["_Doubler"])
    if fmt == "csv":
        assert {row["name"] for row in read_csv_rows(directory, "actv")} >= {".input", ".output"}
    api = Api(tmp_path)
    (run,) = api.runs().values()
    rows = api.heatmap(run=run["id"], prefix="actv", op="norm", rank=0)["rows"]
    assert set(rows) == {"_Doubler.input:0", "_Doubler.output:0", "inner.input:0", "inner.output:0"}
    # the side lists name a root module's rows as the heatmap does, beside the files' tag
    labels = {item["tag"]: item["label"] for item in api.json("/anomalies", run=run["id"])["items"]}
    assert labels["0:.input:0/rank0/actv"] == "_Doubler.input:0"
    assert labels["0:inner.input:0/rank0/actv"] == "inner.input:0"
    (incident,) = api.json("/incidents", run=run["id"])["incidents"]
    assert (incident["root"]["tag"], incident["root"]["label"]) == (
        "0:.input:0/rank0/actv",
        "_Doubler.input:0",
    )


def test_a_late_parquet_file_does_not_hide_the_newest_steps(tmp_path):
    """A record of the last step that came after its window was merged: its file sorts last, but
    the data type's ops are those of its steps' files."""
    from monitor.writers.parquet import ParquetWriter

    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    writer = ParquetWriter(directory, 0, merge_steps=2)
    rows = RowSet.build([0, 0], ["a", "b"], 0, "post_grad")
    for step in range(6):
        writer.write(StepRecord("grad_reduced", step, ("norm", "max"), rows, np.full((2, 2), float(step))))
        writer.end_step(step)
    writer.end_step(6)  # a step without this data type: the window of steps 4-5 is merged
    while writer.idle():
        pass
    late = RowSet.build([0], ["c"], 0, "post_grad")
    writer.write(StepRecord("grad_reduced", 5, ("min",), late, np.array([[-1.0]])))
    writer.end_step(6)
    writer.close()
    names = sorted(p.name for p in (directory / "values" / "data_type=grad_reduced").iterdir())
    assert names[-1].startswith("steps-") and any(name.startswith("late-") for name in names)
    (run,) = Api(tmp_path).runs().values()
    info = run["prefixes"]["grad_reduced"]
    assert info["last_step"] == 5 and {"norm", "max"} <= set(info["ops"])
