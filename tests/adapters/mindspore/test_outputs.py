"""CSV, TensorBoard and api outputs of a MindSpore run have the torch adapter's names, headers, tags."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import json
import os

import numpy as np

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train

CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "mg_direction": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
}
#: MindSpore's LayerNorm calls its parameters gamma/beta where torch says weight/bias.
TORCH_NAMES = {"norm.gamma": "norm.weight", "norm.beta": "norm.bias"}


def _as_torch(text: str) -> str:
    for ours, theirs in TORCH_NAMES.items():
        text = text.replace(ours, theirs)
    return text


def _mindspore_run(config: dict, steps: int = 2, batches=None) -> TrainerMon:
    net = Net()
    optimizer = OPTIMIZERS["AdamWeightDecay"](net.trainable_params())
    mon = TrainerMon(config)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, batches or make_batches(steps, 1))
    mon.flush()
    return mon


def _torch_run(config: dict, steps: int = 2) -> TrainerMon:
    torch = pytest.importorskip("torch", reason="the comparison with the torch adapter needs torch")
    from tests.adapters.torch.helpers import MLP
    from tests.adapters.torch.helpers import make_batches as torch_batches

    torch.manual_seed(0)
    model = MLP(sizes=(6, 16, 12, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = TrainerMon(config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    for (x,) in torch_batches(steps, 1):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.flush()
    return mon


def _csv_layout(directory: str) -> dict[str, tuple[str, list[str]]]:
    layout = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".csv"):
            continue
        with open(os.path.join(directory, name), encoding="utf-8") as handle:
            header, *rows = handle.read().splitlines()
        layout[name] = (header, sorted(_as_torch(",".join(row.split(",")[:3])) for row in rows))
    return layout


def test_csv_files_headers_and_rows_are_the_torch_adapters(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "ms"))
    ours = _mindspore_run({**CONFIG, "format": "csv"})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "torch"))
    theirs = _torch_run({**CONFIG, "format": "csv"})
    ours_layout, theirs_layout = _csv_layout(ours.output_dir), _csv_layout(theirs.output_dir)
    assert list(ours_layout) == list(theirs_layout)
    assert "grad_unreduced_1-1.csv" in ours_layout and "other_0-0.csv" in ours_layout
    for name, (header, rows) in ours_layout.items():
        assert header == theirs_layout[name][0], name
        assert rows == theirs_layout[name][1], name
    assert os.path.basename(ours.output_dir).split("-rank0-")[1]  # {time}-rank{R}-{uuid8}
    ours.stop()
    theirs.stop()


def test_activation_csv_files_are_the_torch_adapters(tmp_path, monkeypatch):
    config = {
        "xy_distribution": True,
        "targets": {"layers.0": {}, "norm": {}},
        "ops": CONFIG["ops"],
        "format": "csv",
    }
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "ms"))
    ours = _mindspore_run(config)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "torch"))
    theirs = _torch_run(config)
    ours_layout, theirs_layout = _csv_layout(ours.output_dir), _csv_layout(theirs.output_dir)
    assert (
        list(ours_layout)
        == list(theirs_layout)
        == [f"{prefix}_{step}-{step}.csv" for prefix in ("actv", "actv_grad") for step in (0, 1)]
    )
    for name, (header, rows) in ours_layout.items():
        assert header == theirs_layout[name][0] == "vpp_stage,name,step,micro_step," + ",".join(CONFIG["ops"])
        assert rows == theirs_layout[name][1], name
    ours.stop()
    theirs.stop()


def test_tensorboard_tags_are_the_torch_adapters_and_values_the_api_ones(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "ms"))
    ours = _mindspore_run({**CONFIG, "format": "tensorboard"})
    reduced, unreduced = ours.generate_wgrad_metrics()
    latest = {**reduced, **unreduced, **ours.generate_mv_metrics(), **ours.generate_param_metrics()}
    ours.stop()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "torch"))
    theirs = _torch_run({**CONFIG, "format": "tensorboard"})
    theirs.stop()

    def scalars(directory):
        events = EventAccumulator(directory, size_guidance={SCALARS: 0})
        events.Reload()
        return events

    ours_events, theirs_events = scalars(ours.output_dir), scalars(theirs.output_dir)
    ours_tags = ours_events.Tags()["scalars"]
    assert sorted(_as_torch(t) for t in ours_tags) == sorted(theirs_events.Tags()["scalars"])
    assert "0:layers.0.weight/rank0/acc_grad_norm" in ours_tags
    # the API's values are checked against numpy elsewhere; here the event files must carry them
    assert latest and all(set(values) == set(CONFIG["ops"]) for values in latest.values())
    for tag, values in latest.items():
        for op, value in values.items():
            (last,) = [s for s in ours_events.Scalars(f"{tag}_{op}") if s.step == 1]
            assert last.value == pytest.approx(value, rel=1e-6, nan_ok=True), f"{tag}_{op}"


def test_api_dictionaries_have_the_torch_adapters_keys():
    ours = _mindspore_run({**CONFIG, "format": "api"})
    theirs = _torch_run({**CONFIG, "format": "api"})
    for method in ("generate_mv_metrics", "generate_param_metrics"):
        got, want = getattr(ours, method)(), getattr(theirs, method)()
        assert sorted(_as_torch(t) for t in got) == sorted(want), method
        assert all(list(got[t]) == CONFIG["ops"] for t in got)
    for got, want in zip(ours.generate_wgrad_metrics(), theirs.generate_wgrad_metrics()):
        assert sorted(_as_torch(t) for t in got) == sorted(want)
    assert ours.output_dir is None
    ours.stop()
    theirs.stop()


def test_alert_dump_records_a_nan_with_mindspore_tags(_output_dir):
    batches = make_batches(5, 1)
    batches[4][0][0, 0] = np.nan
    config = {
        "wg_distribution": True,
        "ops": ["norm", "nans"],
        "format": "api",
        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    }
    mon = _mindspore_run(config, batches=batches)
    mon.stop()
    path = _output_dir / "anomaly_detected" / "rank0" / "anomaly.json"
    records = json.loads(path.read_text())
    assert records, "the NaN at step 4 was not recorded"
    assert {r["step"] for r in records.values()} == {4}
    assert {r["rank"] for r in records.values()} == {0}
    tags = {r["tag_name"] for r in records.values()}
    assert "0:layers.0.weight/rank0/post_grad" in tags and "0:layers.0.weight/rank0/acc_grad" in tags
    assert len(mon.anomalies) == len(records)
