"""Incidents in real training reach the sinks and callbacks, and ``stop`` ends every rank together.

A NaN is written into one gradient at step AT (after backward, before the optimizer step) on
the ranks named; the monitor must deliver one message naming that step and tensor, and with
``alert.actions: ["stop"]`` raise TrainingStopped from ``optimizer.step()`` at one and the same
step on every rank (2 gloo ranks, each training its own model: a rank without a fault learns of
the incident only through the monitor's agreement), after calling the checkpoint function there
(which itself runs a collective). A sink that fails on one rank does not keep another rank's
sinks from delivering.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from monitor import TrainerMon, TrainingStopped
from monitor.alerts.bundle import load_bundle
from tests.adapters.torch.distributed import free_port, run_ranks, save_result
from tests.adapters.torch.helpers import MLP, clear_non_finite, make_batches
from tests.monitor.alert_endpoints import Server

STEPS, AT = 30, 5
#: the steps whose gradient skip_step tests poison: three in a row
BAD_STEPS = (AT, AT + 1, AT + 2)
FAULTY = "layers.1.weight"


def _train(
    rank: int,
    fault_ranks: tuple[int, ...],
    sinks: list[dict],
    actions: tuple[str, ...] = ("stop",),
    faults: tuple[int, ...] = (AT,),
) -> dict:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    alert = {"sinks": sinks, "actions": list(actions), "bundle": {"incidents": 1}}
    config = {"wg_distribution": True, "ops": ["norm", "nans"], "alert": alert}
    messages: list[dict] = []
    checkpoints: list[int] = []

    def checkpoint(step: int, reason: str) -> None:
        if dist.is_initialized():  # a sharded save uses collectives: every rank must be here
            dist.all_reduce(torch.ones(1))
        checkpoints.append(step)

    mon = TrainerMon(config).on_incident(messages.append).on_checkpoint(checkpoint)
    mon.set_monitor(model, 1, optimizer)
    stopped, last = None, None
    for step, (x,) in enumerate(make_batches(STEPS, 1, seed=rank + 1)):
        last = step
        mon.set_batch_ids({"rank": rank, "step": step})
        model(x).pow(2).mean().backward()
        if step in faults and rank in fault_ranks:
            dict(model.named_parameters())[FAULTY].grad[0, 0] = float("nan")
        try:
            optimizer.step()
        except TrainingStopped as exc:
            stopped = exc
            break
        optimizer.zero_grad()
        clear_non_finite(model, optimizer)
    optimizer.step()  # after the stop the monitor's hooks are inert: nothing is raised again
    mon.stop()
    return {
        "stopped": None if stopped is None else [stopped.step, stopped.reason],
        "last_step": last,
        "messages": messages,
        "checkpoints": checkpoints,
        "output_dir": mon.output_dir,
    }


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_one_process_delivers_the_incident_and_stops_at_the_next_step_boundary(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    sinks = [{"type": "file", "path": "incidents.jsonl"}]
    result = _train(0, (0,), sinks)
    (message,) = _lines(str(tmp_path / "incidents.jsonl"))  # a relative path is under the output root
    assert (message["step"], message["rank"], message["rule"]) == (AT, 0, "NonFinite")
    assert message["tag"].startswith(f"0:{FAULTY}/rank0/")
    assert result["messages"] == [message]  # the callback got the same message
    step, reason = result["stopped"]
    assert AT < step <= result["last_step"] + 1 < STEPS  # stopped at a step boundary after the fault
    assert step == result["last_step"] + 1 and f"incident 1 at step {AT}" in reason
    frame = pd.concat(
        pd.read_csv(os.path.join(result["output_dir"], name))
        for name in os.listdir(result["output_dir"])
        if name.startswith("grad_reduced")
    )
    faulty = frame[(frame["name"] == FAULTY) & (frame["step"] == AT)]
    assert list(faulty["nans"]) == [1]  # the outputs are complete up to the stop
    assert frame["step"].max() == result["last_step"]


def test_checkpoint_alone_is_called_once_per_incident_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    result = _train(0, (0,), [], actions=("checkpoint",), faults=(AT, AT + 10))
    assert result["stopped"] is None and result["last_step"] == STEPS - 1
    assert [m["step"] for m in result["messages"]] == [AT, AT + 10]
    first, second = result["checkpoints"]
    assert AT < first < AT + 10 < second < STEPS  # each at a step end after its incident


def test_a_webhook_token_written_in_the_config_reaches_no_output_file(tmp_path, monkeypatch):
    """A chat tool's webhook URL holds its token; given as ``url`` (not ``url_env``) it is used,
    but the run's files (trainmon_run.json, the evidence bundle, the anomaly files) keep only
    its scheme and host."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    token = "T0KEN-5ecret-in-the-path"
    url = f"http://127.0.0.1:{free_port()}/services/{token}?access_token={token}"
    sinks = [{"type": "webhook", "url": url, "retries": 0, "timeout_s": 1}]
    result = _train(0, (0,), sinks, actions=("checkpoint",))
    assert [m["step"] for m in result["messages"]] == [AT]
    written = [os.path.join(d, name) for d, _, names in os.walk(tmp_path) for name in names]
    assert any(path.endswith("trainmon_run.json") for path in written)
    assert any("bundle_incident1" in path for path in written)
    for path in written:
        with open(path, "rb") as handle:
            assert token.encode() not in handle.read(), path
    with open(os.path.join(result["output_dir"], "trainmon_run.json"), encoding="utf-8") as handle:
        (sink,) = json.load(handle)["config"]["alert"]["sinks"]
    assert sink["url"] == url.split("/services")[0] + "/..."


def test_without_an_incident_nothing_is_sent_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    result = _train(0, (), [{"type": "file", "path": "incidents.jsonl"}])
    assert result["stopped"] is None and result["last_step"] == STEPS - 1
    assert result["messages"] == [] and not (tmp_path / "incidents.jsonl").exists()


def _worker(rank: int, world_size: int, workdir: str) -> None:
    fault_ranks = tuple(json.loads(os.environ["FAULT_RANKS"]))
    target = os.path.join(workdir, "command.jsonl")
    appender = f"import json, sys; open({target!r}, 'a').write(json.dumps(json.load(sys.stdin)) + '\\n')"
    sinks = [
        {"type": "file", "path": os.path.join(workdir, "all.jsonl"), "ranks": "all"},
        {"type": "file", "path": os.path.join(workdir, "lowest.jsonl")},
        {"type": "file", "path": os.path.join(workdir, "rank0.jsonl"), "ranks": "rank0"},
        {"type": "command", "argv": [sys.executable, "-c", appender], "ranks": "all"},
    ]
    if rank == 0:  # nothing listens there: rank 0's webhook fails every time
        sinks.append({"type": "webhook", "url": os.environ["DEAD_URL"], "retries": 1, "backoff_s": 0.01})
    sinks.append({"type": "webhook", "url": os.environ["LIVE_URL"], "ranks": "all"})  # the test's server
    save_result(workdir, rank, _train(rank, fault_ranks, sinks, actions=("checkpoint", "stop")))


@pytest.mark.distributed
@pytest.mark.parametrize("fault_ranks", [(1,), (0, 1)])
def test_every_rank_stops_at_the_same_step(tmp_path, fault_ranks):
    server = Server()
    env = {
        "MONITOR_OUTPUT_DIR": str(tmp_path / "out"),
        "FAULT_RANKS": json.dumps(fault_ranks),
        "DEAD_URL": f"http://127.0.0.1:{free_port()}/hook",
        "LIVE_URL": server.url,
    }
    try:
        results = run_ranks(_worker, 2, str(tmp_path), env)
    finally:
        server.close()
    steps = {result["stopped"][0] for result in results}
    assert len(steps) == 1 and AT < steps.pop() < STEPS  # one stop step, agreed by both ranks
    assert {result["last_step"] for result in results} == {results[0]["last_step"]}
    assert [result["checkpoints"] for result in results] == [[result["stopped"][0]] for result in results]
    if 0 not in fault_ranks:
        assert results[0]["messages"] == [] and "another rank" in results[0]["stopped"][1]
    every = sorted((m["step"], m["rank"]) for m in _lines(str(tmp_path / "all.jsonl")))
    assert every == [(AT, rank) for rank in fault_ranks]  # rank 0's failing webhook hurts no one
    posted = sorted((body["step"], body["rank"]) for _, body in server.requests)
    assert posted == every  # every rank's webhook delivers, whatever rank 0's dead one does
    for rank, result in enumerate(results):  # each rank's callback had its own incidents
        assert [(m["step"], m["rank"]) for m in result["messages"]] == (
            [(AT, rank)] if rank in fault_ranks else []
        )
    lowest = [(m["step"], m["rank"]) for m in _lines(str(tmp_path / "lowest.jsonl"))]
    assert lowest == [(AT, min(fault_ranks))]  # one message per incident, from the lowest rank
    rank0 = [(m["step"], m["rank"]) for m in _lines(str(tmp_path / "rank0.jsonl"))]
    assert rank0 == ([(AT, 0)] if 0 in fault_ranks else [])  # only what rank 0 itself saw
    commanded = sorted((m["step"], m["rank"]) for m in _lines(str(tmp_path / "command.jsonl")))
    assert commanded == every  # a program run per message, the message on its stdin
    for rank in (0, 1):  # each rank that saw the incident kept its evidence, with its batch
        bundles = list((tmp_path / "out" / "anomaly_detected" / f"rank{rank}").glob("bundle_incident*"))
        if rank in fault_ranks:
            (bundle,) = bundles
            manifest = load_bundle(bundle).manifest
            assert manifest["topology"]["rank"] == rank and manifest["topology"]["world_size"] == 2
            assert manifest["incident"]["batch_ids"] == [{"micro_step": 0, "ids": {"rank": rank, "step": AT}}]
        else:
            assert bundles == []


def _skipping(rank: int, fault_ranks: tuple[int, ...]) -> dict:
    """Train with skip_step; per step, whether the weights changed and whether any is NaN."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {"wg_distribution": True, "ops": ["norm", "nans"], "alert": {"actions": ["skip_step"]}}
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    changed, poisoned = [], []
    for step, (x,) in enumerate(make_batches(STEPS, 1, seed=rank + 1)):
        before = [p.detach().clone() for p in model.parameters()]
        model(x).pow(2).mean().backward()
        if step in BAD_STEPS and rank in fault_ranks:
            dict(model.named_parameters())[FAULTY].grad[0, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
        poisoned.append(any(p.isnan().any().item() for p in model.parameters()))
    mon.stop()
    return {"changed": changed, "poisoned": poisoned, "incidents": [i.onset_step for i in mon.incidents]}


def test_skip_step_keeps_a_nan_gradient_out_of_the_weights(tmp_path, monkeypatch, trainmon_log):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    result = _skipping(0, (0,))
    assert result["incidents"] == [AT]
    # only the faulty steps are skipped, the second and third in a row too (one incident, open)
    assert result["changed"] == [step not in BAD_STEPS for step in range(STEPS)]
    assert not any(result["poisoned"])  # without the skip, AdamW spreads the NaN into the weights
    said = [
        m for r in trainmon_log.records if "alert.actions asks" in (m := r.getMessage()) or "run again" in m
    ]
    assert said == [
        f"trainmon: skipping the update of step {AT} as alert.actions asks",
        f"trainmon: updates run again at step {AT + 3}, after 3 skipped in a row since step {AT}",
    ]  # a run of skipped updates is said once, not at every step


def _skip_worker(rank: int, world_size: int, workdir: str) -> None:
    save_result(workdir, rank, _skipping(rank, (1,)))


@pytest.mark.distributed
def test_every_rank_skips_the_same_step(tmp_path):
    results = run_ranks(_skip_worker, 2, str(tmp_path), {"MONITOR_OUTPUT_DIR": str(tmp_path / "out")})
    for result in results:  # rank 0 saw nothing, yet skips with rank 1
        assert result["changed"] == [step not in BAD_STEPS for step in range(STEPS)]
        assert not any(result["poisoned"])
    assert [r["incidents"] for r in results] == [[], [AT]]


def _uneven_worker(rank: int, world_size: int, workdir: str) -> None:
    """Data-parallel training by hand (an all_reduce per gradient, as DDP does) where the ranks'
    collections end at different steps (collect_times 3 and 9): the agreement must go on at
    every step on both, or it would pair with a gradient all_reduce."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {
        "wg_distribution": True,
        "ops": ["norm", "nans"],
        "collect_times": 3 if rank == 0 else 9,
        "alert": {"actions": ["stop"]},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    stopped = None
    for step, (x,) in enumerate(make_batches(STEPS, 1, seed=rank + 1)):
        model(x).pow(2).mean().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        if step == 6 and rank == 1:  # rank 0 collects no more by then
            dict(model.named_parameters())[FAULTY].grad[0, 0] = float("nan")
        try:
            optimizer.step()
        except TrainingStopped as exc:
            stopped = exc.step
            break
        optimizer.zero_grad()
    mon.stop()
    save_result(workdir, rank, {"stopped": stopped})


@pytest.mark.distributed
def test_the_agreement_goes_on_after_a_ranks_collection_ended(tmp_path):
    results = run_ranks(_uneven_worker, 2, str(tmp_path), {"MONITOR_OUTPUT_DIR": str(tmp_path / "out")})
    steps = [result["stopped"] for result in results]
    assert steps[0] == steps[1] and steps[0] is not None and steps[0] > 6


EXITING = """
import sys, torch
from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP, make_batches
model = MLP()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
mon = TrainerMon({"wg_distribution": True, "alert": {"sinks": [{"type": "file", "path": "last.jsonl"}]}})
mon.set_monitor(model, 1, optimizer)
for step, (x,) in enumerate(make_batches(4, 1)):
    model(x).sum().backward()
    if step == 3:
        model.layers[0].weight.grad[0, 0] = float("nan")
    optimizer.step()
    optimizer.zero_grad()
sys.exit(0)  # no mon.stop(): a script that ends right after the fault
"""


def test_an_incident_at_the_last_step_is_delivered_when_the_process_exits(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path), "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", EXITING], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert [m["step"] for m in _lines(str(tmp_path / "last.jsonl"))] == [3]


def _agreement_worker(rank: int, world_size: int, workdir: str) -> None:
    from adapters.torch import dist as monitor_dist
    from tests.log_capture import trainmon_records

    # a run that gives its collectives longer than torch's default (a slow checkpoint, say)
    world_timeout = datetime.timedelta(seconds=4321)
    dist.distributed_c10d._set_pg_timeout(world_timeout, dist.group.WORLD)
    with trainmon_records() as records:
        own = [monitor_dist.any_rank(rank == asking, torch.device("cpu")) for asking in (1, -1)]
        group = monitor_dist._agreement_groups[-1][1]
        group_timeout = group._get_backend(torch.device("cpu")).options._timeout
        available = dist.is_gloo_available
        dist.is_gloo_available = lambda: False  # a torch built without gloo
        monitor_dist._agreement_groups.clear()
        default = [monitor_dist.any_rank(rank == asking, torch.device("cpu")) for asking in (0, -1)]
        dist.is_gloo_available = available

        def cannot_connect(*args, **kwargs):
            raise RuntimeError("injected: gloo cannot connect")

        dist.new_group = cannot_connect
        monitor_dist._agreement_groups.clear()
        unmade = [monitor_dist.any_rank(rank == asking, torch.device("cpu")) for asking in (1, -1)]
    save_result(
        workdir,
        rank,
        {
            "own_group": own,
            "own_group_is_not_the_default": group is not None and group is not dist.group.WORLD,
            "own_group_waits_as_long": group_timeout == world_timeout,
            "default_group": default,
            "unmade_group": unmade,
            "told": [m for m in records.warnings() if "agree on the default process group" in m],
        },
    )


def test_ranks_agree_in_a_gloo_group_of_their_own_or_on_the_default_group_without_gloo(tmp_path):
    """The flag of one rank reaches every rank: through the monitor's own gloo group (on the CPU,
    never waiting for an accelerator), or, in a torch without gloo or where the group cannot be
    made, through the default group, said once each. The own group waits as long as the run's."""
    for result in run_ranks(_agreement_worker, 2, str(tmp_path)):
        assert result["own_group"] == [True, False] and result["own_group_is_not_the_default"]
        assert result["own_group_waits_as_long"]
        assert result["default_group"] == result["unmade_group"] == [True, False]
        assert len(result["told"]) == 2, result["told"]  # no gloo, then a group that cannot be made
