"""print_struct and stack_info on MindSpore: the torch adapter's files, written once, hooks removed."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import csv
import json
import logging
import os

import monitor
from monitor import TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train


def _tensor(shape) -> str:
    return f"size={shape}, dtype=Float32"


def _fresh():
    net = Net()
    return net, OPTIMIZERS["Adam"](net.trainable_params())


def test_print_struct_writes_the_structure_and_stops_the_run_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net, optimizer = _fresh()
    before = [p.asnumpy().copy() for p in optimizer.parameters]
    mon = TrainerMon({"print_struct": True, "wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    with pytest.raises(monitor.StructurePrinted) as raised:
        train(net, optimizer, make_batches(1, 1))
    path = raised.value.args[0]
    assert path == str(tmp_path / "module_struct" / "rank0" / "module_struct.json")
    with open(path, encoding="utf-8") as handle:
        structure = json.load(handle)
    # batch 5, Net(6 -> 16 -> 12 -> 4): the CellList container never runs, ReLU "act" runs twice
    # (its first call is recorded); the network input takes no gradient
    shapes = {"0:layers.0": (6, 16), "0:act": (16, 16), "0:layers.1": (16, 12), "0:layers.2": (12, 4)}
    shapes.update({"0:norm": (4, 4), "0:": (6, 4)})
    assert sorted(structure) == sorted(shapes)
    for name, (n_in, n_out) in shapes.items():
        entry = structure[name]
        assert entry["input"] == {"config": "tuple[1]", "0": _tensor((5, n_in))}, name
        assert entry["output"] == {"config": "tensor", "tensor": _tensor((5, n_out))}, name
        assert entry["output_grad"] == {"config": "tuple[1]", "0": _tensor((5, n_out))}, name
        if name in ("0:", "0:layers.0"):
            assert "input_grad" not in entry
        else:
            assert entry["input_grad"] == {"config": "tuple[1]", "0": _tensor((5, n_in))}, name
    # the update of that step did not run; afterwards the hooks are gone and training goes on
    for want, param in zip(before, optimizer.parameters):
        assert (param.asnumpy() == want).all()
    assert not mon.monitoring
    train(net, optimizer, make_batches(1, 1))
    assert all(not cell._forward_hook for _, cell in net.cells_and_names())
    mon.stop()


def test_a_failing_structure_write_is_logged_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    (tmp_path / "module_struct").write_text("a file where the directory should be")
    net, optimizer = _fresh()
    mon = TrainerMon({"print_struct": True, "param_distribution": True, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        train(net, optimizer, make_batches(2, 1))
    assert [r for r in caplog.records if "print_struct failed" in r.getMessage()]
    assert mon.generate_param_metrics()
    mon.stop()


def test_stack_info_writes_each_cells_first_call_stack_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net, optimizer = _fresh()
    mon = TrainerMon({"stack_info": True, "wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(2, 1))
    path = os.path.join(mon.output_dir, "stack_info.csv")
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["module_name", "stack_info"]
    stacks = dict(rows[1:])
    assert len(rows) == 1 + len(stacks)  # a module's row written once, not per step
    assert sorted(stacks) == sorted(["0:", "0:layers.0", "0:act", "0:layers.1", "0:layers.2", "0:norm"])
    helpers = os.path.join("tests", "adapters", "mindspore", "helpers.py")
    for name, text in stacks.items():
        assert helpers in text and "in train" in text, name  # the training loop's frame, with its source
        assert "net(x).square().mean()" in text, name
    mtime = os.stat(path).st_mtime_ns
    train(net, optimizer, make_batches(1, 1))
    assert os.stat(path).st_mtime_ns == mtime  # written once
    mon.stop()
