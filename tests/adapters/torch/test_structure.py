"""print_struct and stack_info outputs."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch
from torch import nn

from monitor import StructurePrinted, TrainerMon


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.pair = nn.Bilinear(4, 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.pair(h, h)


def test_print_struct_writes_the_structure_and_stops_with_a_dedicated_exception(_output_dir):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = (list(optimizer._optimizer_step_pre_hooks), [list(m._forward_hooks) for m in model.modules()])
    mon = TrainerMon({"print_struct": True})
    mon.set_monitor(model, 1, optimizer)
    model(torch.randn(5, 3)).sum().backward()
    with pytest.raises(StructurePrinted) as raised:
        optimizer.step()
    path = _output_dir / "module_struct" / "rank0" / "module_struct.json"
    assert raised.value.args[0] == str(path)
    structure = json.loads(path.read_text())
    assert structure["0:fc"]["input"] == {"config": "tuple[1]", "0": "size=(5, 3), dtype=torch.float32"}
    assert structure["0:fc"]["output"] == {"config": "tensor", "tensor": "size=(5, 4), dtype=torch.float32"}
    assert structure["0:pair"]["input"]["config"] == "tuple[2]"
    assert structure["0:fc"]["output_grad"] == {"config": "tuple[1]", "0": "size=(5, 4), dtype=torch.float32"}
    model(torch.randn(5, 3))  # the next forward removes the inert optimizer hooks
    assert (
        list(optimizer._optimizer_step_pre_hooks),
        [list(m._forward_hooks) for m in model.modules()],
    ) == before


def test_stack_info_is_written_once_with_source_lines(tmp_path):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"stack_info": True, "wg_distribution": True})
    mon.set_monitor(model, 1, optimizer)
    for _ in range(2):
        model(torch.randn(5, 3)).sum().backward()  # the call site recorded for the root module
        optimizer.step()
    mon.stop()
    with open(os.path.join(mon.output_dir, "stack_info.csv"), newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["module_name", "stack_info"]
    stacks = dict(rows[1:])
    assert len(rows) == 1 + len(stacks)  # a module's row written once, not per step
    assert set(stacks) == {"0:", "0:fc", "0:pair"}
    assert f"File {__file__}" in stacks["0:"]
    assert "model(torch.randn(5, 3)).sum().backward()  # the call site" in stacks["0:"]
    assert "h = self.fc(x)" in stacks["0:fc"]
