"""The monitor leaves the user's objects alone and finishes its writing at interpreter exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pandas as pd
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import ALL_OPS, MLP, make_batches


def _train(model, optimizer, steps=3):
    for step_batches in make_batches(steps, 2):
        for x in step_batches:
            model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_no_attribute_is_set_on_parameters_or_the_optimizer():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    params_before = {n: set(vars(p)) for n, p in model.named_parameters()}
    optimizer_before = set(vars(optimizer))
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "mg_direction": True,
    }
    mon = TrainerMon(config)
    mon.set_monitor(model, 2, optimizer)
    _train(model, optimizer)
    assert {n: set(vars(p)) for n, p in model.named_parameters()} == params_before
    assert set(vars(optimizer)) == optimizer_before
    mon.stop()


def test_two_monitors_in_one_process_do_not_interfere(tmp_path, monkeypatch):
    torch.manual_seed(0)
    first, second = MLP(), MLP(sizes=(6, 3))
    opt1, opt2 = torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
    mon1 = TrainerMon({"wg_distribution": True, "format": "api", "ops": ["norm"]})
    mon2 = TrainerMon({"wg_distribution": True, "format": "api", "ops": ["norm"], "start_step": 1})
    mon1.set_monitor(first, 2, opt1)
    mon2.set_monitor(second, 2, opt2)
    _train(first, opt1, steps=1)
    _train(second, opt2, steps=1)
    assert len(mon1.generate_wgrad_metrics()[0]) == len(list(first.parameters()))
    assert mon2.generate_wgrad_metrics() == ({}, {})  # its step 0 is not collected
    _train(second, opt2, steps=1)
    assert set(mon2.generate_wgrad_metrics()[0]) == {
        f"0:{name}/rank0/post_grad"
        for name in ("layers.0.weight", "layers.0.bias", "norm.weight", "norm.bias")
    }
    mon1.stop()
    mon2.stop()


def test_outputs_are_complete_at_interpreter_exit_without_stop(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch
        from monitor import TrainerMon
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters())
        mon = TrainerMon({{"wg_distribution": True, "mv_distribution": True, "ops": {ALL_OPS!r},
                          "step_count_per_record": 100}})
        mon.set_monitor(model, 1, optimizer)
        for _ in range(30):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        print(mon.output_dir)
        """
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out_dir = done.stdout.strip().splitlines()[-1]
    for prefix in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq"):
        frame = pd.read_csv(os.path.join(out_dir, f"{prefix}_0-99.csv"))
        assert sorted(set(frame["step"])) == list(range(30))
        assert len(frame) == 30 * 4
