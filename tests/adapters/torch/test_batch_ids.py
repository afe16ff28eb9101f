"""Incidents name the micro-batches where they began (``TrainerMon.set_batch_ids``).

Each micro-batch of real training (accumulation 2) is named by the sample indices it holds; a NaN
is injected at step AT, either into one micro-batch's activations (the incident must name that
micro-batch alone) or into a gradient after backward (no micro-batch can be told: every
micro-batch of the step is named). With activations, a second NaN enters the first layer's
output at the next step, while the incident is open: its record joins the incident, which then
also holds that step's ids. The ids are read back from incidents.json, skip_batches.json, the
alert message and anomaly-analyse's output, and compared with the indices the test fed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP

STEPS, AT, MICRO, BATCH = 12, 8, 2, 5


def _indices(step: int, micro: int) -> list[int]:
    start = (step * MICRO + micro) * BATCH
    return list(range(start, start + BATCH))


def _train(tmp_path, where: str) -> tuple[TrainerMon, dict]:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(STEPS * MICRO * BATCH, 6)
    config = {
        "wg_distribution": True,
        "xy_distribution": where == "activation",
        "all_xy": True,
        "ops": ["norm", "nans"],
        "alert": {
            "rules": [{"rule_name": "AnomalyNan"}],
            "dump": True,
            "sinks": [{"type": "file", "path": "a.jsonl"}],
        },
    }
    mon = TrainerMon(config).set_monitor(model, MICRO, optimizer)
    position = {"step": 0, "micro": 0}

    def poison_at(step: int, micro: int):
        def poison(module, args, output):
            if (position["step"], position["micro"]) == (step, micro):
                output = output.clone()
                output[0, 0] = float("nan")
            return output

        return poison

    model.layers[1].register_forward_hook(poison_at(AT, 1))
    if where == "activation":
        model.layers[0].register_forward_hook(poison_at(AT + 1, 0))
    for step in range(STEPS):
        for micro in range(MICRO):
            position.update(step=step, micro=micro)
            index = torch.tensor(_indices(step, micro))
            mon.set_batch_ids(index if micro == 0 else {"samples": _indices(step, micro)})
            x = data[index]
            loss = model(x).pow(2).mean() if where == "activation" or step != AT else model(x).sum() * 0
            loss.backward()
        if where == "gradient" and step == AT:
            model.layers[2].weight.grad[0, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()
        if step in (AT, AT + 1):  # whatever the faults did to the weights, the next steps start clean
            with torch.no_grad():
                for p in model.parameters():
                    p.nan_to_num_(0.0)
    mon.stop()
    return mon, json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("where", ["activation", "gradient"])
def test_incident_names_the_micro_batches_where_it_began(tmp_path, monkeypatch, where):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    mon, message = _train(tmp_path, where)
    first = _indices(AT, 0)
    expected = (
        [{"micro_step": 1, "ids": {"samples": _indices(AT, 1)}}]
        if where == "activation"
        else [{"micro_step": 0, "ids": first}, {"micro_step": 1, "ids": {"samples": _indices(AT, 1)}}]
    )
    incident = mon.incidents[0]
    assert incident.onset_step == AT and incident.batch_ids == expected
    assert message["step"] == AT and message["batch_ids"] == expected
    rank_dir = tmp_path / "anomaly_detected" / "rank0"
    document = json.loads((rank_dir / "incidents.json").read_text())
    assert document["incidents"][0]["batch_ids"] == expected
    assert document["incidents"][0]["world_size"] == 1
    fed = {step: [_indices(step, 0), {"samples": _indices(step, 1)}] for step in (AT, AT + 1)}
    joined = [AT, AT + 1] if where == "activation" else [AT]
    assert len(mon.incidents) == 1 and sorted({r["step"] for r in incident.records}) == joined
    assert document["incidents"][0]["step_batch_ids"] == {str(step): fed[step] for step in joined}
    skip = json.loads((rank_dir / "skip_batches.json").read_text())
    assert skip["batches"] == [{"incident": 1, "step": AT, **entry} for entry in expected]
    analysed = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor.anomaly_analyse",
            "-d",
            str(tmp_path / "anomaly_detected"),
            "-o",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    line = f"batch ids (rank 0, step {AT}, micro-batch 1): {json.dumps({'samples': _indices(AT, 1)})}"
    assert line in analysed.stdout
    merged = json.loads((tmp_path / "incidents_analyse.json").read_text())["incidents"][0]
    assert merged["batch_ids"] == [{"rank": 0, "step": AT, **entry} for entry in expected]
    assert merged["step_batch_ids"] == [{"rank": 0, "step": step, "ids": fed[step]} for step in joined]


def test_batch_ids_must_be_json(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    model = MLP()
    mon = TrainerMon({"wg_distribution": True}).set_monitor(
        model, 1, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    with pytest.raises(TypeError, match="set_batch_ids: ids: expected JSON-ready values"):
        mon.set_batch_ids({"file": object()})
    with pytest.raises(TypeError, match="set_batch_ids: ids"):
        mon.set_batch_ids(float("nan"))
    mon.stop()
    assert not os.path.exists(tmp_path / "anomaly_detected" / "rank0" / "skip_batches.json")
