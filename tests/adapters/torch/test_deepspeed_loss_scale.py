"""DeepSpeed's fp16 dynamic loss scale on two real ranks: the steps whose gradients overflow (the
first ones, while the scale comes down from a value far too large) are skipped by DeepSpeed
inside its step and raise no incident; a bad batch on one rank is still an incident at its step,
rooted at that rank's input. Under bf16 (no loss scale) a NaN gradient stays a fault.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.loss_scale_checks import (
    assert_nan_gradient_is_fault,
    assert_overflows_left_to_scaler,
)
from tests.training import MLP

if importlib.util.find_spec("deepspeed") is None:  # not imported here: the test process stays DeepSpeed-free
    pytest.skip("deepspeed is not installed (pip install trainmon[deepspeed])", allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, BAD_STEP, BAD_RANK = 14, 11, 1


def _worker(rank: int, world_size: int, workdir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    from monitor import TrainerMon

    stage, precision = int(os.environ["DS_STAGE"]), os.environ["DS_PRECISION"]
    torch.manual_seed(0)
    model = MLP()
    config = {
        "train_batch_size": 2 * world_size,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
    }
    if precision == "fp16":  # 2**24: the first steps overflow fp16 and are skipped
        config["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 100}
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (a CPU without
        # AVX512-FP16 or AMX); torch computes this model's fp16 ops on any CPU, more slowly
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    else:
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rules = {"rules": [{"rule_name": "AnomalyZScore"}]}
    mon = TrainerMon({"wg_distribution": True, "xy_distribution": True, "format": "api", "alert": rules})
    mon.set_monitor(engine, 1, engine.optimizer)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(2, 6, generator=generator)
        if step == BAD_STEP and rank == BAD_RANK:
            x[0, 0] = float("nan")
        engine.backward(engine(x.to(dtype)).float().pow(2).mean())
        engine.step()
    mon.stop()
    incidents = [(i.onset_step, i.root["tag_name"], i.root["rule"]) for i in mon.incidents]
    save_result(workdir, rank, {"skipped": engine.skipped_steps, "step": mon.step, "incidents": incidents})


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_steps_are_no_incident_and_a_bad_batch_still_is(tmp_path, stage):
    env = {"DS_STAGE": str(stage), "DS_PRECISION": "fp16", "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    results = run_ranks(_worker, 2, str(tmp_path), env)
    assert_overflows_left_to_scaler(results, STEPS, BAD_STEP, BAD_RANK)


def test_under_bf16_a_nan_gradient_is_a_fault(tmp_path):
    env = {"DS_STAGE": "1", "DS_PRECISION": "bf16", "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    results = run_ranks(_worker, 2, str(tmp_path), env)
    assert_nan_gradient_is_fault(results, BAD_STEP, BAD_RANK)
