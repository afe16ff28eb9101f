"""The plugin's /incidents route, and the new filters of /anomalies, on files of the real writers.

The incident runs are written by write_run(..., detect=True): the monitor's own Detector and
AnomalySink write anomaly.json and incidents.json. Expectations are what was injected there
(INCIDENT_RUN: where the NaN and Inf are, which ranks, which steps), or the files read with json.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dashboards.plugin.incidents as incidents_module
import dashboards.plugin.store as store_module
from dashboards.plugin.incidents import IncidentReader
from monitor.anomaly.analyse import main as analyse_main
from tests.dashboards.conftest import INCIDENT_RUN, NAMES, Api, write_run

#: what INCIDENT_RUN injected: (onset step, ranks, state, root tag, root op, record tags)
FIRST = (
    3,
    [0, 1],
    "closed",
    "0:layers.0.fc1.weight/rank0/acc_grad",
    "norm",
    {
        "0:layers.0.fc1.weight/rank0/acc_grad",
        "0:layers.0.fc1.weight/rank0/post_grad",
        "0:layers.0.fc1.weight/rank1/post_grad",
    },
)
SECOND = (9, [1], "open", "0:head.weight/rank1/exp_avg", "max", {"0:head.weight/rank1/exp_avg"})


@pytest.fixture(scope="module")
def incident_run(tmp_path_factory):
    """(Api, run, logdir) for a run written with INCIDENT_RUN."""
    logdir = tmp_path_factory.mktemp("incident_run")
    write_run(logdir, **INCIDENT_RUN)
    api = Api(logdir)
    (run,) = api.runs().values()
    return api, run, logdir


def _summary(incident: dict) -> tuple:
    root = incident["root"]
    return (
        incident["onset_step"],
        incident["ranks"],
        incident["state"],
        root["tag"],
        root["op"],
        {item["tag"] for item in incident["items"]},
    )


def test_incidents_are_merged_over_ranks_earliest_first_with_root_and_evidence(incident_run):
    api, run, _ = incident_run
    body = api.json("/incidents", run=run["id"])
    assert body["files"] == 2 and body["total"] == body["matching"] == 2
    assert [_summary(i) for i in body["incidents"]] == [FIRST, SECOND]
    first, second = body["incidents"]
    assert [i["id"] for i in body["incidents"]] == [1, 2]
    # rank 0 saw the local gradient, rank 1 only the reduced one: the evidence names rank 0 alone
    assert any("only rank 0" in line for line in first["evidence"])
    assert first["last_abnormal_step"] == 4  # the NaN stayed on rank 0 at step 4
    assert first["records"] == first["tensors"] == 3 and second["records"] == 1
    root = first["root"]
    assert root["rule"] == "NonFinite" and root["value"] == "NaN" and root["rank"] == 0
    # the heatmap cell of each record: data type, row and op of what was injected
    assert (root["prefix"], root["row"], root["op"]) == (
        "grad_unreduced",
        [0, "layers.0.fc1.weight", -1],
        "norm",
    )
    assert first["items"][first["root_index"]]["tag"] == root["tag"]
    assert {(i["prefix"], i["rank"], i["step"]) for i in first["items"]} == {
        ("grad_unreduced", 0, 3),
        ("grad_reduced", 0, 3),
        ("grad_reduced", 1, 3),
    }
    assert second["root"]["value"] == "Infinity" and second["root"]["row"] == [0, "head.weight", -1]
    assert body["skipped_files"] == body["skipped_incidents"] == body["skipped_records"] == 0


def test_runs_count_incidents_and_land_on_the_first_root(incident_run):
    api, run, _ = incident_run
    assert run["incidents"] == 2 and run["anomalies"] == 4  # 3 + 1 records
    assert run["landing"] == {
        "prefix": "grad_unreduced",
        "op": "norm",
        "rank": 0,
        "anomaly": None,
        "incident": 1,
    }
    view = api.heatmap(run=run["id"], prefix="grad_unreduced", op="norm", rank=0)
    assert view["rows"] == list(NAMES)  # written in this order
    assert view["anomaly_cells"] == [[NAMES.index("layers.0.fc1.weight"), view["steps"].index(3), 0]]


def test_the_tab_and_the_analysis_cli_name_the_same_incidents(incident_run, tmp_path):
    api, run, logdir = incident_run
    out = tmp_path / "out"
    assert analyse_main(["-d", str(logdir / "anomaly_detected"), "-o", str(out)]) == 0
    cli = json.loads((out / "incidents_analyse.json").read_text())["incidents"]
    tab = api.json("/incidents", run=run["id"])["incidents"]
    assert [(i["onset_step"], i["ranks"], i["state"], i["root"]["tag_name"], i["evidence"]) for i in cli] == [
        (i["onset_step"], i["ranks"], i["state"], i["root"]["tag"], i["evidence"]) for i in tab
    ]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (
            {"rank": 0},
            [(3, {"0:layers.0.fc1.weight/rank0/acc_grad", "0:layers.0.fc1.weight/rank0/post_grad"})],
        ),
        ({"rank": 1}, [(3, {"0:layers.0.fc1.weight/rank1/post_grad"}), (9, SECOND[5])]),
        ({"prefix": "exp_avg"}, [(9, SECOND[5])]),
        ({"prefix": "grad_unreduced"}, [(3, {FIRST[3]})]),
        ({"prefix": "grad_reduced", "rank": 1}, [(3, {"0:layers.0.fc1.weight/rank1/post_grad"})]),
        ({"rule": "NonFinite"}, [(3, FIRST[5]), (9, SECOND[5])]),
        ({"rule": "AnomalyZScore"}, []),
        # a step range keeps the incidents abnormal in it: the first is still abnormal at step 4,
        # the second from step 9 to the end
        ({"step_min": 4}, [(3, FIRST[5]), (9, SECOND[5])]),
        ({"step_min": 5}, [(9, SECOND[5])]),
        ({"step_min": 10, "step_max": 10}, [(9, SECOND[5])]),
        ({"step_max": 8}, [(3, FIRST[5])]),
        ({"step_min": 3, "step_max": 3}, [(3, FIRST[5])]),
        ({"step_min": 4, "step_max": 8}, [(3, FIRST[5])]),
        ({"step_min": 5, "step_max": 8}, []),
    ],
)
def test_incident_filters(incident_run, query, expected):
    api, run, _ = incident_run
    body = api.json("/incidents", run=run["id"], **query)
    assert [(i["onset_step"], {a["tag"] for a in i["items"]}) for i in body["incidents"]] == expected
    assert body["matching"] == len(expected) and body["total"] == 2
    for incident in body["incidents"]:
        assert incident["matching_records"] == len(incident["items"])


def test_limits_cut_incidents_and_records_and_say_so(incident_run):
    api, run, _ = incident_run
    body = api.json("/incidents", run=run["id"], limit=1, records=1)
    (incident,) = body["incidents"]
    assert body["matching"] == 2 and incident["onset_step"] == 3
    assert len(incident["items"]) == 1 and incident["matching_records"] == 3


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"rule": "NonFinite"}, [(3, 0), (3, 0), (3, 1), (9, 1)]),
        ({"rule": "AnomalyZScore"}, []),
        ({"step_min": 4}, [(9, 1)]),
        ({"step_max": 3, "rank": 1}, [(3, 1)]),
        ({"step_min": 4, "step_max": 8}, []),
    ],
)
def test_anomaly_list_filters_by_rule_and_step(incident_run, query, expected):
    api, run, _ = incident_run
    body = api.json("/anomalies", run=run["id"], **query)
    assert sorted((a["step"], a["rank"]) for a in body["items"]) == expected
    assert body["counts"]["rule"] == [["NonFinite", 4]] and body["total"] == 4


@pytest.mark.parametrize("route", ["/incidents", "/anomalies"])
@pytest.mark.parametrize(
    ("query", "code", "words"),
    [
        ({"step_min": "x"}, 400, "step_min: expected an integer, got 'x'"),
        ({"step_max": "3.5"}, 400, "step_max: expected an integer"),
        ({"step_min": "5", "step_max": "2"}, 400, "step_max: 2 is below step_min 5"),
        ({"rank": "-3"}, 400, "rank: expected an integer >= -1, got -3"),
        ({"run": "nope"}, 404, "run: no run 'nope'"),
        ({"run": ""}, 400, "run: required"),
    ],
)
def test_bad_filters_get_a_clear_error(incident_run, route, query, code, words):
    api, run, _ = incident_run
    response = api.get(route, **{"run": run["id"], **query})
    assert response.status_code == code and words in response.get_json()["error"]


def test_runs_of_msprobe_have_no_incidents_and_keep_their_anomaly_list(tmp_path):
    write_run(tmp_path, anomalies=[(0, "grad_reduced", 2, 1, "norm")])
    for path in (tmp_path / "anomaly_detected").glob("*/incidents.json"):
        path.unlink()  # msprobe writes anomaly.json alone
    api = Api(tmp_path)
    (run,) = api.runs().values()
    assert run["incidents"] is None and run["anomalies"] == 1
    assert run["landing"] == {
        "prefix": "grad_reduced",
        "op": "norm",
        "rank": 0,
        "anomaly": 0,
        "incident": None,
    }
    body = api.json("/incidents", run=run["id"])
    assert (body["files"], body["total"], body["incidents"]) == (0, 0, [])


def test_bad_files_incidents_and_records_are_counted_not_fatal(tmp_path):
    write_run(tmp_path, **INCIDENT_RUN)
    rank0 = tmp_path / "anomaly_detected" / "rank0" / "incidents.json"
    rank1 = tmp_path / "anomaly_detected" / "rank1" / "incidents.json"
    document = json.loads(rank1.read_text())
    document["incidents"][1]["records"].append({"tag_name": 7, "rank": 1})  # a record of the wrong shape
    document["incidents"][1]["records"].append({**document["incidents"][1]["records"][0], "call_id": None})
    document["incidents"].append({"id": "3", "rank": 1, "onset_step": 10, "records": []})  # id: not an int
    document["incidents"].append({**document["incidents"][0], "state": "paused"})
    document["incidents"].append(["not", "an", "incident"])
    rank1.write_text(json.dumps(document))
    rank0.write_text('{"version": 1, "rank": 0, "incidents": [')  # cut short
    api = Api(tmp_path)
    (run,) = api.runs().values()
    body = api.json("/incidents", run=run["id"])
    assert (body["skipped_files"], body["skipped_incidents"], body["skipped_records"]) == (1, 3, 2)
    # rank 1's own incidents remain, its records unchanged; rank 0's are gone with its file
    assert [(i["onset_step"], i["ranks"], {a["tag"] for a in i["items"]}) for i in body["incidents"]] == [
        (3, [1], {"0:layers.0.fc1.weight/rank1/post_grad"}),
        (9, [1], SECOND[5]),
    ]
    assert run["incidents"] == 2


def test_files_are_read_again_only_when_they_change(tmp_path, monkeypatch):
    write_run(tmp_path, **INCIDENT_RUN)
    calls = []
    load = incidents_module.load_json
    monkeypatch.setattr(incidents_module, "load_json", lambda path: calls.append(path) or load(path))
    reader = IncidentReader()
    anomaly_dir = str(tmp_path / "anomaly_detected")
    first = reader.read(anomaly_dir)
    assert len(calls) == 2 and reader.read(anomaly_dir) is first and len(calls) == 2
    rank1 = tmp_path / "anomaly_detected" / "rank1" / "incidents.json"
    document = json.loads(rank1.read_text())
    document["incidents"] = document["incidents"][:1]  # the run restarted: a new file by rename
    rank1.with_suffix(".tmp").write_text(json.dumps(document))
    rank1.with_suffix(".tmp").replace(rank1)
    second = reader.read(anomaly_dir)
    assert len(calls) == 3 and calls[-1] == str(rank1)
    assert [i.merged.onset_step for i in second.incidents] == [3]


def _json_values():
    leaves = (
        st.none() | st.booleans() | st.integers(-5, 20) | st.floats(allow_nan=False) | st.text(max_size=5)
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    )


def _incidents():
    record = st.fixed_dictionaries(
        {
            "rank": st.integers(0, 2),
            "step": st.integers(0, 5),
            "tag_name": st.sampled_from(["0:a/rank0/actv", "0:b/rank1/post_grad", "x"]),
            "message": st.just("m"),
        },
        optional={
            key: _json_values()
            for key in ("micro_step", "call_id", "op", "value", "rule", "ratio", "common", "prefix")
        },
    )
    incident = st.fixed_dictionaries(
        {
            "id": st.integers(1, 3),
            "rank": st.integers(0, 2),
            "onset_step": st.integers(0, 5),
            "state": st.sampled_from(["open", "closed"]),
            "records": st.lists(record | _json_values(), max_size=4),
        },
        optional={key: _json_values() for key in ("tensors", "last_abnormal_step", "root", "evidence")},
    )
    return st.lists(incident | _json_values(), max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(_incidents(), min_size=1, max_size=3))
def test_any_json_in_the_incidents_files_is_survived(tmp_path_factory, files):
    """Whatever shape the files have, the reader answers; every incident it keeps has its onset."""
    directory = tmp_path_factory.mktemp("fuzz")
    for rank, incidents in enumerate(files):
        (directory / f"rank{rank}").mkdir()
        (directory / f"rank{rank}" / "incidents.json").write_text(json.dumps({"incidents": incidents}))
    listed = IncidentReader().read(str(directory))
    onsets = [i.merged.onset_step for i in listed.incidents]
    assert onsets == sorted(onsets) and listed.files == len(files)
    for incident in listed.incidents:
        body = incident.to_json(incident.items)
        assert body["onset_step"] == incident.merged.onset_step and json.dumps(body)


def test_the_run_version_changes_when_only_the_incidents_change(tmp_path, monkeypatch):
    """The tab polls /runs and reloads its lists when the version changes: an incident that
    closes rewrites incidents.json alone (no new anomaly), and must still be noticed."""
    monkeypatch.setattr(store_module, "DISCOVERY_SECONDS", 0.0)
    write_run(tmp_path, **INCIDENT_RUN)
    api = Api(tmp_path)
    (before,) = api.runs().values()
    rank1 = tmp_path / "anomaly_detected" / "rank1" / "incidents.json"
    document = json.loads(rank1.read_text())
    assert document["incidents"][1]["state"] == "open"
    document["incidents"][1].update(state="closed", closed_step=12)
    rank1.with_suffix(".tmp").write_text(json.dumps(document))
    rank1.with_suffix(".tmp").replace(rank1)
    (after,) = api.runs().values()
    assert after["version"] != before["version"] and after["anomalies"] == before["anomalies"]
    states = [i["state"] for i in api.json("/incidents", run=after["id"])["incidents"]]
    assert states == ["closed", "closed"]
