"""Switching collection on and off during a live run: dynamic mode, start()/stop(), ops, resume."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from monitor import ConfigError, TrainerMon
from tests.adapters.torch.helpers import MLP, make_batches
from tests.shared_live_control import (
    DYNAMIC_CONFIG,
    SWITCHED_ON,
    assert_the_edits_were_followed,
    replace_file,
    train_while_editing,
)
from tests.shared_outputs import collected_steps


def _fresh():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model, optimizer, seed: int) -> None:
    for x in make_batches(1, 1, seed=seed)[0]:
        model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_dynamic_mode_starts_on_edit_stops_after_collect_times_and_writes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    path = tmp_path / "monitor.json"
    replace_file(path, DYNAMIC_CONFIG)
    model, optimizer = _fresh()
    mon = TrainerMon(str(path))
    mon.set_monitor(model, 1, optimizer)
    log = train_while_editing(path, lambda step: _step(model, optimizer, step), steps=16)
    assert_the_edits_were_followed(mon.output_dir, path, log)
    mon.stop()


def _dynamic_run(tmp_path, monkeypatch, config: dict, steps: int) -> tuple[TrainerMon, Path]:
    """Dynamic mode with a config file that says dynamic_on from the start, trained ``steps``
    steps; the monitor is left attached."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "TRUE")
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"wg_distribution": True, "dynamic_on": True, **config}))
    model, optimizer = _fresh()
    mon = TrainerMon(str(path))
    mon.set_monitor(model, 1, optimizer)
    for step in range(steps):
        _step(model, optimizer, step)
    return mon, path


def test_dynamic_mode_says_an_unknown_key_once_at_start(tmp_path, monkeypatch, trainmon_log):
    mon, _ = _dynamic_run(tmp_path, monkeypatch, {"wg_distrbution": 1}, steps=1)
    mon.stop()
    said = [r.getMessage() for r in trainmon_log.records if "unknown key" in r.getMessage()]
    assert len(said) == 1 and "did you mean 'wg_distribution'" in said[0], said


def test_dynamic_mode_keeps_a_later_start_step_and_says_it(tmp_path, monkeypatch, trainmon_log):
    config = {"start_step": 3, "step_interval": 2, "collect_times": 2}
    mon, _ = _dynamic_run(tmp_path, monkeypatch, config, steps=8)
    mon.stop()
    assert collected_steps(mon.output_dir) == [3, 5]
    said = [r.getMessage() for r in trainmon_log.records if "updated; collecting from step" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("collecting from step 3"), said


def test_dynamic_mode_counts_step_interval_from_the_step_its_edit_starts(tmp_path, monkeypatch):
    """As msprobe's later releases (start_step becomes the next step): an edit seen at step 7 with
    step_interval 10 collects from its first step and then every 10th after it, not at 10, 20."""
    mon, path = _dynamic_run(tmp_path, monkeypatch, {"dynamic_on": False}, steps=7)
    edit = json.loads(path.read_text()) | {"dynamic_on": True, "step_interval": 10, "collect_times": 2}
    replace_file(path, json.dumps(edit))
    for step in range(7, 30):
        _step(mon._session.chunks[0], mon._session.optimizer, step)
    mon.stop()
    first, second = collected_steps(mon.output_dir)
    assert first in (7, 8) and second == first + 10


def test_dynamic_mode_with_dynamic_on_at_start_collects_from_the_first_step(tmp_path, monkeypatch):
    mon, path = _dynamic_run(tmp_path, monkeypatch, {"collect_times": 3}, steps=5)
    assert collected_steps(mon.output_dir) == [0, 1, 2]
    assert json.loads(path.read_text())["dynamic_on"] is False
    mon.stop()


def test_a_live_edit_that_cannot_start_leaves_the_running_collection_on(tmp_path, monkeypatch, trainmon_log):
    """An edit whose collection fails to start (a fault of ours, made here on purpose for configs
    asking for ``zeros``): the collection that ran goes on in the same directory, the file keeps
    what the user wrote until the collection ends (it was rewritten with dynamic_on: false at
    once), the steps collected before the edit still count, and the failure is said once."""
    from adapters.torch.session import TorchSession

    made = TorchSession._new_collection

    def refusing(self):
        if "zeros" in self.config.ops:
            raise RuntimeError("cannot build this collection")
        return made(self)

    monkeypatch.setattr(TorchSession, "_new_collection", refusing)
    mon, path = _dynamic_run(tmp_path, monkeypatch, {"ops": ["norm"], "collect_times": 5}, steps=2)
    edit = json.loads(path.read_text()) | {"ops": ["norm", "zeros"]}
    replace_file(path, json.dumps(edit))
    model_steps = mon.step
    for step in range(model_steps, model_steps + 4):
        _step(mon._session.chunks[0], mon._session.optimizer, step)
    # the steps collected before the edit still count: collect_times 5 ends after step 4
    assert collected_steps(mon.output_dir) == list(range(5)) and not mon.monitoring
    assert json.loads(path.read_text()) == {**edit, "dynamic_on": False}  # written back at the end
    said = [r.getMessage() for r in trainmon_log.records if "cannot be applied" in r.getMessage()]
    assert len(said) == 1 and "cannot build this collection" in said[0]
    assert said[0].endswith("collecting on with the previous config")
    mon.stop()


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_start_and_stop_switch_collection_from_python(optimizer_class):
    torch.manual_seed(0)
    model = MLP()
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    mon = TrainerMon(
        {"wg_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
    )
    mon.set_monitor(model, 1, optimizer)
    for step in range(6):
        if step == 2:
            mon.stop()
        if step == 4:  # AdamW counts its own updates; SGD does not, so the loop says where it is
            mon.start() if optimizer_class is torch.optim.AdamW else mon.start(step=4)
        _step(model, optimizer, step)
    mon.stop()
    assert collected_steps(mon.output_dir) == [0, 1, 4, 5]
    assert len([d for d in os.listdir(os.path.dirname(mon.output_dir)) if "-rank0-" in d]) == 1


@pytest.mark.parametrize("given", [None, 4], ids=["no step given", "start(step=4)"])
def test_restarting_with_an_optimizer_that_counts_no_updates_asks_for_the_step(given, trainmon_log):
    """SGD keeps no count of its updates: the steps between stop() and start() are not seen, so
    without start(step=...) the rows go on from the step stop() left, which is said."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon({"wg_distribution": True, "format": "csv"})
    mon.set_monitor(model, 1, optimizer)
    mon.start()  # not stopped: nothing to say
    for step in range(6):
        if step == 2:
            mon.stop()
        if step == 4:
            mon.start(step=given)
        _step(model, optimizer, step)
    mon.stop()
    said = [r.getMessage() for r in trainmon_log.records if "keeps no count of its updates" in r.getMessage()]
    assert collected_steps(mon.output_dir) == ([0, 1, 2, 3] if given is None else [0, 1, 4, 5])
    assert len(said) == (1 if given is None else 0), said
    assert given is not None or "rows go on from step 2" in said[0]


def test_incident_numbers_go_on_after_a_restart_without_anomaly_files(trainmon_log):
    """A NaN that stays opens an incident in each collection of the run; the second one is
    numbered after the first, as the anomaly files would number it with alert.dump."""
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "format": "api", "alert": {"rules": []}})
    mon.set_monitor(model, 1, optimizer)
    for step in range(6):
        if step == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        if step == 2:
            mon.stop()
        if step == 4:
            mon.start(step=4)
        _step(model, optimizer, step)
    mon.stop()
    opened = [m for r in trainmon_log.records if (m := r.getMessage()).startswith("trainmon: incident ")]
    assert [m.split(" on rank")[0] for m in opened] == [
        "trainmon: incident 1 at step 1",
        "trainmon: incident 2 at step 4",
    ], opened


def test_ops_setter_is_validated_and_applies_from_the_next_step():
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    _step(model, optimizer, 0)
    assert set(next(iter(mon.generate_wgrad_metrics()[0].values()))) == {"norm"}
    with pytest.raises(ConfigError, match="ops"):
        mon.ops = ["median"]
    mon.ops = ["max", "nans"]
    assert mon.ops == ["max", "nans"]
    _step(model, optimizer, 1)
    assert set(next(iter(mon.generate_wgrad_metrics()[0].values()))) == {"max", "nans"}
    mon.stop()


def test_reload_xy_is_deprecated_and_switches_activations():
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    _step(model, optimizer, 0)
    with pytest.warns(DeprecationWarning):
        mon.reload_xy(True)
    _step(model, optimizer, 1)
    assert mon._session.core.latest.latest("actv")
    mon.stop()


def test_a_resumed_run_does_not_write_steps_twice(tmp_path):
    first_model, first_optimizer = _fresh()
    first = TrainerMon({"wg_distribution": True, "step_count_per_record": 100})
    first.set_monitor(first_model, 1, first_optimizer)
    for step in range(5):
        _step(first_model, first_optimizer, step)
    first.stop()
    tag = os.path.basename(first.output_dir).split("-rank")[0]
    model, optimizer = _fresh()
    resumed = TrainerMon({"wg_distribution": True, "step_count_per_record": 100, "append_output": [tag, tag]})
    resumed.set_monitor(model, 1, optimizer, start_iteration=3)  # restarted from a checkpoint of step 3
    for step in range(3, 7):
        _step(model, optimizer, step)
    resumed.stop()
    assert resumed.output_dir == first.output_dir
    frame = pd.read_csv(os.path.join(first.output_dir, "grad_reduced_0-99.csv"))
    counts = frame["step"].value_counts()
    assert sorted(counts.index) == list(range(7)) and set(counts) == {len(list(model.parameters()))}


def test_a_resumed_run_goes_on_in_its_anomaly_files(tmp_path):
    """append_output that finds the rank's directory is the same run going on: its anomaly files
    are read back and extended (incident numbers continue), not set aside as an earlier run's."""
    config = {"wg_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}

    def run(mon, model, optimizer, steps, nan_at):
        for step in steps:
            model(torch.randn(4, 6)).sum().backward()
            if step == nan_at:
                next(model.parameters()).grad[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.nan_to_num_(0.0)
        mon.stop()

    model, optimizer = _fresh()
    first = TrainerMon(config)
    first.set_monitor(model, 1, optimizer)
    run(first, model, optimizer, range(8), nan_at=2)
    tag = os.path.basename(first.output_dir).split("-rank")[0]
    model, optimizer = _fresh()
    resumed = TrainerMon({**config, "append_output": [tag, tag]})
    resumed.set_monitor(model, 1, optimizer, start_iteration=8)
    run(resumed, model, optimizer, range(8, 16), nan_at=12)
    rank_dir = tmp_path / "monitor_output" / "anomaly_detected" / "rank0"
    assert not [p.name for p in rank_dir.iterdir() if ".earlier-" in p.name]
    incidents = json.loads((rank_dir / "incidents.json").read_text())["incidents"]
    assert [(i["id"], i["onset_step"]) for i in incidents] == [(1, 2), (2, 12)]
    steps = {record["step"] for record in json.loads((rank_dir / "anomaly.json").read_text()).values()}
    assert {2, 12} <= steps


def _saved_after_five_steps(config: dict) -> tuple[torch.nn.Module, dict]:
    """A model trained five steps under a monitor of ``config``, and the monitor's saved state."""
    model, optimizer = _fresh()
    first = TrainerMon(config)
    first.set_monitor(model, 1, optimizer)
    for step in range(5):
        _step(model, optimizer, step)
    saved = first.state_dict()
    first.stop()
    return model, saved


def test_detector_baselines_survive_a_resume_through_state_dict():
    config = {
        "wg_distribution": True,
        "format": "api",
        "alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"warmup": 3}}]},
    }
    model, saved = _saved_after_five_steps(config)
    assert saved["step"] == 5 and saved["detector"]["tags"]
    found = {}
    for load in (True, False):
        twin = copy.deepcopy(model)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
        resumed = TrainerMon(config)
        resumed.set_monitor(twin, 1, twin_optimizer, start_iteration=saved["step"])
        if load:
            resumed.load_state_dict(saved)
        for x in make_batches(1, 1, seed=5)[0]:  # a x1000 gradient right after resuming
            (twin(x).pow(2).mean() * 1000).backward()
        twin_optimizer.step()
        resumed.stop()
        found[load] = {a.step for a in resumed.anomalies}
    assert found == {True: {5}, False: set()}  # a fresh detector would still be warming up
    other = TrainerMon({**config, "alert": {"rules": [{"rule_name": "AnomalyNan"}]}})
    other.set_monitor(copy.deepcopy(model), 1, torch.optim.SGD(model.parameters(), lr=0.01))
    with pytest.raises(ValueError, match="rules"):
        other.load_state_dict(saved)
    other.stop()


def test_a_loaded_state_numbers_the_steps_where_set_monitor_was_given_no_start(trainmon_log):
    """A DeepSpeed or plain loop resumed at step 5 that restores the monitor's state but does not
    pass start_iteration: its steps go on from 5, not from 0; an explicit start_iteration (0
    included) that disagrees with the state keeps its numbering, said."""
    config = {"wg_distribution": True, "format": "api"}
    model, saved = _saved_after_five_steps(config)
    for start, expected in ((None, 5), (7, 7), (0, 0)):
        twin = copy.deepcopy(model)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.01)
        resumed = TrainerMon(config)
        resumed.set_monitor(twin, 1, twin_optimizer, **({} if start is None else {"start_iteration": start}))
        resumed.load_state_dict(saved)
        _step(twin, twin_optimizer, 0)
        rows = resumed._latest("grad_reduced")
        resumed.stop()
        assert resumed.step == expected + 1 and rows, (start, resumed.step)
    said = [m for m in trainmon_log.at(logging.WARNING) if "load_state_dict" in m]
    assert len(said) == 2 and "saved at step 5, but steps here go on from 7" in said[0], said
    assert "steps here go on from 0" in said[1]


def test_a_loaded_state_renumbers_the_first_step_without_ending_it_for_cc_log_only():
    """cc_log_only stops the run after its first step: the step begun at attach, renumbered by
    the loaded state, is still that first step (it raised as if a second had begun)."""
    model, optimizer = _fresh()
    config = {
        "wg_distribution": True,
        "format": "api",
        "cc_distribution": {"enable": True, "cc_log_only": True},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    mon.load_state_dict({"step": 30, "detector": None})
    assert mon.step == 30
    mon.stop()


def _dynamic_rank(rank: int, world_size: int, workdir: str) -> None:
    """Rank 1 reads the config at the end of step 3 after rank 0 switched it on; rank 0 reads it
    only at the end of step 4: each rank polling for itself would start them a step apart."""
    import torch.distributed as dist

    from tests.adapters.torch.distributed import save_result

    path = os.path.join(workdir, "monitor.json")
    model, optimizer = _fresh()
    mon = TrainerMon(path)
    mon.set_monitor(model, 1, optimizer)
    dist.barrier()  # both attached (and read the config, still off) before rank 0 edits it
    for step in range(16):
        if step == 3 and rank == 1:
            dist.barrier()  # rank 0 has finished step 3 and switched the config on
        _step(model, optimizer, step)
        if step == 3 and rank == 0:
            replace_file(path, SWITCHED_ON)
            dist.barrier()
        dist.barrier()  # data parallelism keeps ranks within a step of each other (its all-reduce)
    mon.stop()
    with open(path) as handle:
        config = json.load(handle)
    save_result(workdir, rank, {"steps": collected_steps(mon.output_dir), "config": config})


@pytest.mark.distributed
def test_dynamic_mode_starts_every_rank_at_the_same_step(tmp_path):
    from monitor.session.dynamic import DELAY_STEPS
    from tests.adapters.torch.distributed import run_ranks

    replace_file(tmp_path / "monitor.json", DYNAMIC_CONFIG)
    per_rank = run_ranks(_dynamic_rank, 2, str(tmp_path), env={"DYNAMIC_MONITOR": "true"})
    first = 5 + DELAY_STEPS  # rank 0 sees the edit at the end of step 4 and schedules it
    assert [r["steps"] for r in per_rank] == [[first, first + 1]] * 2, per_rank
    assert per_rank[0]["config"]["dynamic_on"] is False  # written back after collect_times


def _dynamic_rank_with_a_copy(rank: int, world_size: int, workdir: str) -> None:
    """Rank 1 watches a copy of the config that nobody edits (a node whose file system shows it
    late, or a copy of its own); rank 0 switches its file on, with collect_times 10, after step 3,
    and off by hand after step 8."""
    import torch.distributed as dist

    from tests.adapters.torch.distributed import save_result

    path = os.path.join(workdir, f"monitor{rank}.json")
    model, optimizer = _fresh()
    mon = TrainerMon(path)
    mon.set_monitor(model, 1, optimizer)
    dist.barrier()
    for step in range(20):
        _step(model, optimizer, step)
        if step == 3 and rank == 0:
            replace_file(path, SWITCHED_ON.replace('"collect_times": 2', '"collect_times": 10'))
        if step == 8 and rank == 0:
            replace_file(path, DYNAMIC_CONFIG.replace('"collect_times": 2', '"collect_times": 10'))
        dist.barrier()  # data parallelism keeps ranks within a step of each other (its all-reduce)
    mon.stop()
    save_result(workdir, rank, {"steps": collected_steps(mon.output_dir)})


@pytest.mark.distributed
def test_dynamic_mode_switches_a_rank_that_never_sees_the_edits_with_rank_0(tmp_path):
    """Rank 0 announces each start and stop and the config's text through the process group's
    store, so a rank does not depend on its own view of the file (with the schedule file alone,
    rank 1 here would never start)."""
    from monitor.session.dynamic import DELAY_STEPS
    from tests.adapters.torch.distributed import run_ranks

    for rank in (0, 1):
        replace_file(tmp_path / f"monitor{rank}.json", DYNAMIC_CONFIG)
    per_rank = run_ranks(_dynamic_rank_with_a_copy, 2, str(tmp_path), env={"DYNAMIC_MONITOR": "true"})
    on, off = 5 + DELAY_STEPS, 10 + DELAY_STEPS  # rank 0 sees each edit at the end of the next step
    assert [r["steps"] for r in per_rank] == [list(range(on, off))] * 2, per_rank
    assert json.loads((tmp_path / "monitor1.json").read_text()) == json.loads(DYNAMIC_CONFIG)  # untouched
