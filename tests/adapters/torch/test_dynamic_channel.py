"""Dynamic mode across ranks through the process group's key-value store: two watches (rank 0 and
rank 1) in one process on a real torch store, with files that the test edits or leaves stale."""

from __future__ import annotations

import datetime
import gc
import json
import logging

import torch.distributed as dist

from adapters.torch.dist import StoreChannel, schedule_channel
from monitor.session.dynamic import DELAY_STEPS, DynamicControl
from tests.shared_live_control import DYNAMIC_CONFIG, SWITCHED_ON, replace_file

YAML_ON = "wg_distribution: true\ndynamic_on: true\ncollect_times: 7\n"


def _watches(tmp_path, store, rank0_name="rank0.json"):
    """Rank 0's watch of its file, rank 1's of a file nobody edits; both attached at step 0."""
    watches = []
    for rank, name in ((0, rank0_name), (1, "rank1.json")):
        replace_file(tmp_path / name, DYNAMIC_CONFIG)
        watch = DynamicControl(tmp_path / name)
        assert not watch.attach(rank, 2, StoreChannel(store)).dynamic_on
        watches.append(watch)
    return watches


def _started(watches, steps) -> dict[int, list]:
    """Per step, the config each watch starts (None: none); every rank polls each step."""
    return {step: [watch.poll(step) for watch in watches] for step in steps}


def test_rank_0_announces_its_config_and_every_rank_starts_it_at_the_same_step(tmp_path):
    rank0, rank1 = _watches(tmp_path, dist.HashStore(), rank0_name="rank0.yaml")
    replace_file(tmp_path / "rank0.yaml", YAML_ON)  # YAML, read by rank 1 as YAML although its file is JSON
    started = _started([rank0, rank1], range(1, 12))
    due = 1 + DELAY_STEPS
    assert all(configs == [None, None] for step, configs in started.items() if step != due)
    assert [config.collect_times for config in started[due]] == [7, 7]
    assert json.loads((tmp_path / "rank1.json").read_text()) == json.loads(DYNAMIC_CONFIG)


def test_a_new_watch_does_not_follow_an_announcement_made_before_it(tmp_path):
    store = dist.HashStore()
    rank0, rank1 = _watches(tmp_path, store)
    replace_file(tmp_path / "rank0.json", SWITCHED_ON)
    _started([rank0, rank1], range(1, 12))
    later = DynamicControl(tmp_path / "rank1.json")
    later.attach(1, 2, StoreChannel(store))  # attached again after stop()
    assert all(later.poll(step) is None for step in range(12, 30))


def test_an_announcement_that_is_not_a_valid_config_is_reported_once_and_ignored(tmp_path, caplog):
    store = dist.HashStore()
    _, rank1 = _watches(tmp_path, store)
    StoreChannel(store).publish(json.dumps({"step": 3, "sha256": "x", "config": "{", "yaml": False}).encode())
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        assert all(rank1.poll(step) is None for step in range(1, 10))
    assert len([r for r in caplog.records if "announced by rank 0" in r.getMessage()]) == 1


def test_a_store_that_died_leaves_the_ranks_to_the_schedule_file(tmp_path, caplog):
    """Both watches on a real TCP store whose server is gone: rank 0 writes the schedule file,
    which rank 1 follows with its own read of the (shared) config file."""
    timeout = datetime.timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    replace_file(tmp_path / "shared.json", DYNAMIC_CONFIG)
    watches = [DynamicControl(tmp_path / "shared.json") for _ in range(2)]
    for rank, watch in enumerate(watches):
        watch.attach(rank, 2, StoreChannel(client))
    del server
    gc.collect()
    replace_file(tmp_path / "shared.json", SWITCHED_ON)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        started = _started(watches, range(1, 12))
    due = 1 + DELAY_STEPS
    assert [config is not None for config in started[due]] == [True, True]
    assert (tmp_path / "shared.json.schedule").exists()
    lost = [r for r in caplog.records if "schedule file" in r.getMessage()]
    assert len(lost) == 2  # once per rank


def test_one_process_has_no_channel():
    assert not dist.is_initialized() and schedule_channel() is None


def test_a_rank_that_polls_late_follows_every_edit_at_its_step(tmp_path):
    """Rank 0 switches on after step 1 and off after step 2; rank 1 looks only from step 3 on,
    finds both announcements, and switches at the same steps as rank 0."""
    rank0, rank1 = _watches(tmp_path, dist.HashStore())
    for step, text in ((1, SWITCHED_ON), (2, DYNAMIC_CONFIG.replace("2\n", "3\n"))):
        replace_file(tmp_path / "rank0.json", text)
        assert rank0.poll(step) is None
    applied = {step: [rank0.poll(step), rank1.poll(step)] for step in range(3, 12)}
    switches = {
        step: [c.dynamic_on for c in configs] for step, configs in applied.items() if configs != [None] * 2
    }
    assert switches == {1 + DELAY_STEPS: [True, True], 2 + DELAY_STEPS: [False, False]}
