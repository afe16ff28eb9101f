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
import torch.distributed as dist

from monitor import TrainerMon
from monitor.alerts.bundle import load_bundle
from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import MLP, clear_non_finite, make_batches

STEPS, AT, FAULTY = 14, 8, "layers.1.weight"


def _shown(path) -> str:
    """What ``trainmon bundle show`` prints for the bundle at ``path``."""
    command = [sys.executable, "-m", "monitor.cli", "bundle", "show", str(path)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


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
        clear_non_finite(model, optimizer)
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
    no_groups = {"tp_group": None, "dp_group": None, "optimizer_shards": None}
    topology = {"rank": 0, "world_size": 1, "pp_stage": 0, "group_mates": [0], "chunks": ["MLP"]}
    assert m["topology"] == {**topology, "groups": no_groups}
    assert m["versions"]["torch"] == torch.__version__ and m["config"]["alert"]["bundle"]["incidents"] == 1
    shown = _shown(bundle.path)
    assert (
        f"incident 1 on rank 0: onset step {AT} (micro-batch 0), written at the end of step {written}"
        in shown
    )
    assert "random generator states: numpy, python, torch\n" in shown
    assert f'batch ids: [{{"micro_step": 0, "ids": [{AT}]}}]\n' in shown
    grad_line = next(line for line in shown.splitlines() if f"0:{FAULTY} grad" in line)
    assert "float32 (12, 16)" in grad_line and f"nan {int(np.isnan(copy['grad']).sum())}" in grad_line


def test_a_skipped_update_keeps_the_gradient_it_dropped_in_the_bundle(tmp_path, monkeypatch):
    """skip_step drops the step's gradients before the update; the bundle of the incident still
    holds the NaN gradient (the key evidence), said to be unused, and the parameter as it was."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    alert = {"bundle": {"incidents": 1}, "actions": ["skip_step"]}
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm", "nans"], "alert": alert})
    mon.set_monitor(model, 1, optimizer)
    for step, (x,) in enumerate(make_batches(AT + 2, 1)):
        model(x).pow(2).mean().backward()
        param = dict(model.named_parameters())[FAULTY]
        if step == AT:
            param.grad[0, 0] = float("nan")
            dropped, before = param.grad.numpy().copy(), param.detach().numpy().copy()
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    bundle = load_bundle(tmp_path / "anomaly_detected" / "rank0" / "bundle_incident1")
    assert _same(bundle.tensors[f"0:{FAULTY} grad"], dropped)
    assert _same(bundle.tensors[f"0:{FAULTY} value"], before)  # the update was skipped
    shown = _shown(bundle.path)
    assert "which the skipped update did not use" in shown
    assert "batch ids: not named (mon.set_batch_ids)\n" in shown  # the loop named none


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


class _WrittenInPlace(torch.nn.Module):
    """``scale`` receives ``h``, which the forward then changes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.scale = _Scale()
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = self.scale(h)
        h.add_(1.0)  # after scale's call: what it received is gone
        return self.out(y + h)


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def _train_with_faulty_output(
    model, module: str, micro: int, bundle: dict, faulty_rank: bool = True, seed: int = 1, **attach
) -> dict:
    """Two micro-batches a step, activations monitored; the output of ``module`` turns NaN at
    micro-batch ``micro`` of step AT (where ``faulty_rank``). Returns the test's own copies of
    what that module received at each (step, micro-batch). A DistributedDataParallel ``model``
    is attached with the set_monitor arguments ``attach``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    faulty = dict(inner.named_modules())[module]
    received: dict[tuple[int, int], list[np.ndarray]] = {}
    position = {"step": 0, "micro": 0}

    def copy_inputs(_module, args):
        received[(position["step"], position["micro"])] = [a.detach().numpy().copy() for a in args]

    def poison(_module, _args, output):
        if faulty_rank and (position["step"], position["micro"]) == (AT, micro):
            output.data[0, 0] = float("nan")

    faulty.register_forward_pre_hook(copy_inputs)
    faulty.register_forward_hook(poison)  # before the monitor's hooks: the monitor sees the NaN
    config = {"xy_distribution": True, "all_xy": True, "ops": ["norm", "nans"], "alert": {"bundle": bundle}}
    mon = TrainerMon(config).set_monitor(model, 2, optimizer, **attach)
    for step, micro_batches in enumerate(make_batches(STEPS, 2, seed=seed)):
        position["step"] = step
        for index, x in enumerate(micro_batches):
            position["micro"] = index
            model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        clear_non_finite(model, optimizer)
    mon.stop()
    return received


def test_the_bundle_holds_the_inputs_the_faulty_module_received(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    received = _train_with_faulty_output(MLP(), "layers.1", 1, {"incidents": 1})
    bundle = load_bundle(tmp_path / "anomaly_detected" / "rank0" / "bundle_incident1")
    m = bundle.manifest
    assert m["incident"]["onset_step"] == AT
    assert m["incident"]["root"]["tag_name"].startswith("0:layers.1.output")
    assert m["module_inputs"] == {"module": "0:layers.1", "micro_step": 1, "changed_in_place": []}
    (expected,) = received[(AT, 1)]
    assert _same(bundle.tensors["0:layers.1 input_0"], expected)
    assert not _same(bundle.tensors["0:layers.1 input_0"], received[(AT, 0)][0])  # the onset micro-batch's
    names = list(bundle.tensors)
    assert names.index("0:layers.1.weight value") < names.index("0:layers.1 input_0")  # the root's first


def test_the_models_own_input_is_named_as_such_in_the_bundle(tmp_path, monkeypatch):
    """A NaN in the batch: the incident's root is the model's own input, and the bundle keeps
    that batch under the model's name (its call has none of its own: it showed as "0:")."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {
        "xy_distribution": True,
        "all_xy": True,
        "ops": ["norm", "nans"],
        "alert": {"bundle": {"incidents": 1}},
    }
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    for step, (x,) in enumerate(make_batches(AT + 2, 1)):
        if step == AT:
            x = x.clone()
            x[0, 0] = float("nan")
            sent = x.numpy().copy()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        clear_non_finite(model, optimizer)
    mon.stop()
    bundle = load_bundle(tmp_path / "anomaly_detected" / "rank0" / "bundle_incident1")
    assert bundle.manifest["module_inputs"]["module"] == "0:[the model]"
    assert _same(bundle.tensors["0:[the model] input_0"], sent)
    assert "inputs of module 0:[the model] at micro-batch 0" in _shown(bundle.path)


def test_an_input_written_in_place_after_the_call_is_not_passed_off_as_received(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    _train_with_faulty_output(_WrittenInPlace(), "scale", 0, {"incidents": 1})
    bundle = load_bundle(tmp_path / "anomaly_detected" / "rank0" / "bundle_incident1")
    assert bundle.manifest["module_inputs"] == {"module": "0:scale", "micro_step": 0, "changed_in_place": [0]}
    assert not [name for name in bundle.tensors if "input" in name]
    shown = _shown(bundle.path)
    said = "inputs of module 0:scale at micro-batch 0 (input 0 written in place after the call: not kept)"
    assert said in shown


def test_module_inputs_past_the_size_limit_are_not_held(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    _train_with_faulty_output(MLP(), "layers.1", 1, {"incidents": 1, "max_mb": 0.00005})  # 52 bytes
    bundle = load_bundle(tmp_path / "anomaly_detected" / "rank0" / "bundle_incident1")
    assert "module_inputs" not in bundle.manifest  # the smallest input, 5x4 float32, is 80 bytes


def _ddp_worker(rank: int, world_size: int, workdir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(MLP())
    received = _train_with_faulty_output(
        model, "layers.1", 1, {"incidents": 1}, rank == 1, seed=rank + 1, dp_group=dist.group.WORLD
    )
    save_result(workdir, rank, {"received": received[(AT, 1)][0].tolist()})


@pytest.mark.distributed
def test_a_data_parallel_rank_keeps_its_groups_and_its_own_module_inputs(tmp_path):
    results = run_ranks(_ddp_worker, 2, str(tmp_path), {"MONITOR_OUTPUT_DIR": str(tmp_path / "out")})
    bundle = load_bundle(tmp_path / "out" / "anomaly_detected" / "rank1" / "bundle_incident1")
    m = bundle.manifest
    assert m["topology"]["groups"] == {"tp_group": None, "dp_group": [0, 1], "optimizer_shards": None}
    assert (m["incident"]["onset_step"], m["module_inputs"]["micro_step"]) == (AT, 1)
    (name,) = [name for name in bundle.tensors if name.endswith("layers.1 input_0")]
    assert _same(bundle.tensors[name], np.array(results[1]["received"], dtype=np.float32))
