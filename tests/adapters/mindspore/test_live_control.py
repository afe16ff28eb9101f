"""Switching collection on and off during a live MindSpore run: dynamic mode, start()/stop(), ops."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import logging
import os

import pandas as pd
from mindspore import nn

from monitor import ConfigError, TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train


def _collected_steps(output_dir: str, prefix: str = "grad_reduced") -> list[int]:
    frames = [
        pd.read_csv(os.path.join(output_dir, f)) for f in os.listdir(output_dir) if f.startswith(prefix)
    ]
    return sorted(set(pd.concat(frames)["step"])) if frames else []


def _write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)  # a new inode: the edit is seen even within the file system's mtime granularity


def _fresh(kind: str = "Adam"):
    net = Net()
    return net, OPTIMIZERS[kind](net.trainable_params())


def _step(net, optimizer, seed: int) -> None:
    train(net, optimizer, make_batches(1, 1, seed=seed))


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_dynamic_mode_starts_on_edit_stops_after_collect_times_and_writes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    path = tmp_path / "monitor.json"
    original = '{\n  "wg_distribution": true,\n\n  "dynamic_on": false,   "collect_times": 2\n}\n'
    _write(path, original)
    net, optimizer = _fresh()
    mon = TrainerMon(str(path))
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    assert not mon.monitoring
    errors = _Errors()
    logging.getLogger("trainmon").addHandler(errors)
    try:
        for step in range(11):
            if step == 2:
                _write(path, original.replace('"dynamic_on": false', '"dynamic_on": true'))
            if step == 7:
                _write(path, "{ broken")
            if step == 8:
                _write(
                    path, original.replace('"dynamic_on": false', '"dynamic_on": true').replace("2\n", "1\n")
                )
            _step(net, optimizer, step)
    finally:
        logging.getLogger("trainmon").removeHandler(errors)
    # the edit made during step 2 is seen at its end: steps 3 and 4 are collected (collect_times 2);
    # the broken edit is reported once; the edit during step 8 collects step 9 only
    assert _collected_steps(mon.output_dir) == [3, 4, 9]
    assert path.read_text() == original.replace("2\n", "1\n")  # dynamic_on written back, nothing else changed
    assert len([m for m in errors.messages if "not valid" in m]) == 1
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
    assert _collected_steps(mon.output_dir) == [0, 1, 4, 5]
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
    assert _collected_steps(mon.output_dir) == [0, 10] and mon.step == 11


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
