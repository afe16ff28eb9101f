"""Switching collection on and off during a live MindSpore run: dynamic mode, start()/stop(), ops."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import os

from mindspore import nn

from monitor import ConfigError, TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train
from tests.shared_live_control import (
    DYNAMIC_CONFIG,
    assert_the_edits_were_followed,
    replace_file,
    train_while_editing,
)
from tests.shared_outputs import collected_steps


def _fresh(kind: str = "Adam"):
    net = Net()
    return net, OPTIMIZERS[kind](net.trainable_params())


def _step(net, optimizer, seed: int) -> None:
    train(net, optimizer, make_batches(1, 1, seed=seed))


def test_dynamic_mode_starts_on_edit_stops_after_collect_times_and_writes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    path = tmp_path / "monitor.json"
    replace_file(path, DYNAMIC_CONFIG)
    net, optimizer = _fresh()
    mon = TrainerMon(str(path))
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    assert not mon.monitoring
    log = train_while_editing(path, lambda step: _step(net, optimizer, step), steps=16)
    assert_the_edits_were_followed(mon.output_dir, path, log)
    mon.stop()


@pytest.mark.parametrize("kind", ["Adam", "SGD"])
def test_start_and_stop_switch_collection_from_python(kind):
    net = Net()
    if kind == "SGD":
        optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    else:
        optimizer = OPTIMIZERS[kind](net.trainable_params())
    mon = TrainerMon({"wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    for step in range(6):
        if step == 2:
            mon.stop()
            assert not mon.monitoring
        if step == 4:  # MindSpore optimizers count their updates (global_step): no step needed
            mon.start()
        _step(net, optimizer, step)
    mon.stop()
    assert collected_steps(mon.output_dir) == [0, 1, 4, 5]
    assert len([d for d in os.listdir(os.path.dirname(mon.output_dir)) if "-rank0-" in d]) == 1


def test_start_with_an_explicit_step():
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    _step(net, optimizer, 0)
    mon.stop()
    _step(net, optimizer, 1)
    mon.start(step=10)
    _step(net, optimizer, 2)
    mon.stop()
    assert collected_steps(mon.output_dir) == [0, 10] and mon.step == 11


def test_ops_setter_is_validated_and_applies_from_the_next_step():
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "xy_distribution": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    _step(net, optimizer, 0)
    assert set(next(iter(mon.generate_wgrad_metrics()[0].values()))) == {"norm"}
    with pytest.raises(ConfigError, match="ops"):
        mon.ops = ["median"]
    mon.ops = ["max", "nans"]
    assert mon.ops == ["max", "nans"]
    _step(net, optimizer, 1)
    assert set(next(iter(mon.generate_wgrad_metrics()[0].values()))) == {"max", "nans"}
    assert set(next(iter(mon._core.latest.latest("actv").values()))) == {"max", "nans"}
    mon.stop()
