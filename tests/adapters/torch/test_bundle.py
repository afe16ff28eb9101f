"""Evidence bundles of real incidents hold what the training process held, byte for byte. A NaN is
written into one gradient at step AT; the bundle is written at the end of that step. The test
keeps its own copies of the parameter, its gradient, the Adam moments and the random generators'
states at every step end, and compares the bundle (read back with ``load_bundle``, and shown with
``trainmon bundle show``) with the copies of the step the bundle says it was written at.
"""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from monitor import TrainerMon
from monitor.alerts.bundle import load_bundle
from tests.adapters.torch.helpers import MLP, make_batches

STEPS, AT, FAULTY = 14, 8, "layers.1.weight"


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def _train(tmp_path, bundle: dict, second_fault: int | None = None):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "ops": ["norm", "nans"],
        "alert": {"bundle": bundle},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    copies = {}
    for step, (x,) in enumerate(make_batches(STEPS, 1)):
        mon.set_batch_ids([step])
        random.random()  # the generators move every step
        model(x + torch.randn_like(x) * 0.01).pow(2).mean().backward()
        param = dict(model.named_parameters())[FAULTY]
        if step in (AT, second_fault):
            param.grad[0, 0] = float("nan")
        optimizer.step()
        state = optimizer.state[param]
        copies[step] = {
            "value": param.detach().numpy().copy(),
            "grad": param.grad.numpy().copy(),
            "exp_avg": state["exp_avg"].numpy().copy(),
            "exp_avg_sq": state["exp_avg_sq"].numpy().copy(),
            "torch": torch.get_rng_state().numpy().copy(),
            "python": random.getstate(),
        }
        optimizer.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.nan_to_num_(0.0)
                for moment in optimizer.state[p].values():
                    moment.nan_to_num_(0.0)
    mon.stop()
    return tmp_path / "anomaly_detected" / "rank0", copies


def test_the_bundle_holds_the_faulty_tensors_and_the_generators_of_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    rank_dir, copies = _train(tmp_path, {"incidents": 1}, second_fault=AT + 4)
    assert sorted(p.name for p in rank_dir.glob("bundle_*")) == ["bundle_incident1"]  # one, as asked
    bundle = load_bundle(rank_dir / "bundle_incident1")
    m = bundle.manifest
    assert m["incident"]["onset_step"] == AT and m["incident"]["root"]["tag_name"].startswith(f"0:{FAULTY}/")
    assert m["incident"]["batch_ids"] == [{"micro_step": 0, "ids": [AT]}]
    written = m["written_at_step"]
    assert written == AT  # the end of the step where the incident began
    copy = copies[written]
    for part in ("value", "grad", "exp_avg", "exp_avg_sq"):
        assert _same(bundle.tensors[f"0:{FAULTY} {part}"], copy[part]), part
    assert _same(bundle.tensors["rng.torch"], copy["torch"])
    version, internal, gauss = m["rng"]["python"]
    assert (version, tuple(internal), gauss) == copy["python"]
    assert m["topology"] == {"rank": 0, "world_size": 1, "pp_stage": 0, "group_mates": [0], "chunks": ["MLP"]}
    assert m["versions"]["torch"] == torch.__version__ and m["config"]["alert"]["bundle"]["incidents"] == 1
    shown = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "bundle", "show", str(bundle.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        f"incident 1 on rank 0: onset step {AT} (micro-batch 0), written at the end of step {written}"
        in shown
    )
    assert "random generator states: numpy, python, torch\n" in shown
    grad_line = next(line for line in shown.splitlines() if f"0:{FAULTY} grad" in line)
    assert "float32 (12, 16)" in grad_line and f"nan {int(np.isnan(copy['grad']).sum())}" in grad_line


def test_tensors_over_the_size_limit_are_listed_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    rank_dir, _ = _train(tmp_path, {"incidents": 1, "max_mb": 0.001})  # 1,048 bytes
    bundle = load_bundle(rank_dir / "bundle_incident1")
    kept = sum(array.nbytes for array in bundle.tensors.values())
    assert kept <= 1048 and bundle.manifest["left_out"]
    assert list(bundle.tensors) == [f"0:{FAULTY} value"]  # the root's tensors come first
    assert {entry["name"] for entry in bundle.manifest["left_out"]} >= {f"0:{FAULTY} grad", "rng.torch"}
    assert not list(rank_dir.glob(".tmp-bundle-*"))


def test_a_damaged_bundle_is_refused_clearly(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable trainmon bundle"):
        load_bundle(tmp_path)
    shown = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "bundle", "show", str(tmp_path)], capture_output=True, text=True
    )
    assert shown.returncode == 2 and "not a readable trainmon bundle" in shown.stderr
