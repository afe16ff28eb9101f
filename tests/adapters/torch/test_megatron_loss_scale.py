"""megatron-core's fp16 dynamic loss scale on two real ranks (CPU, behind the test-only shim): the
steps whose gradients overflow (the first ones, while the scale comes down from a value far too
large) are skipped by Megatron's optimizer and raise no incident; a bad batch on one rank is
still an incident at its step, rooted at that rank's input. Under a constant loss scale nothing
lowers the scale, so an overflow there stays a fault.
"""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch

from tests.adapters.torch import megatron_cpu_shim
from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.loss_scale_checks import (
    assert_nan_gradient_is_fault,
    assert_overflows_left_to_scaler,
)
from tests.training import MLP

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, BAD_STEP, BAD_RANK = 14, 11, 1


def _worker(rank: int, world_size: int, workdir: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("MEGATRON_TEST_HANG_S", "600")), exit=True)
    megatron_cpu_shim.install()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from monitor import TrainerMon

    parallel_state.initialize_model_parallel(1, 1)
    constant = os.environ["LOSS_SCALE"] == "constant"
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, fp16=True, params_dtype=torch.float16
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), MLP().half()
    )
    # 2**22: the first steps overflow fp16 and are skipped while the dynamic scale comes down
    scale = {"loss_scale": 1024.0} if constant else {"initial_loss_scale": 2.0**22, "hysteresis": 1}
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True, clip_grad=1.0, **scale), [model]
    )
    rules = {"rules": [{"rule_name": "AnomalyZScore"}]}
    mon = TrainerMon(
        {"wg_distribution": True, "xy_distribution": True, "format": "api", "alert": rules},
        params_have_main_grad=True,
    )
    mon.set_monitor(model, 1, optimizer=optimizer)
    generator = torch.Generator().manual_seed(rank)
    skipped = 0
    for step in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        x = torch.randn(2, 6, generator=generator)
        if step == BAD_STEP and rank == BAD_RANK:
            x[0, 0] = float("nan")
        (model(x.half()).float().pow(2).mean() * optimizer.get_loss_scale()).backward()
        model.finish_grad_sync()
        updated, *_ = optimizer.step()
        skipped += not updated
    mon.stop()
    parallel_state.destroy_model_parallel()
    incidents = [(i.onset_step, i.root["tag_name"], i.root["rule"]) for i in mon.incidents]
    save_result(workdir, rank, {"skipped": skipped, "step": mon.step, "incidents": incidents})


def test_fp16_overflow_steps_are_no_incident_and_a_bad_batch_still_is(tmp_path):
    pytest.importorskip("megatron.core")
    env = {"LOSS_SCALE": "dynamic", "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    results = run_ranks(_worker, 2, str(tmp_path), env)
    assert_overflows_left_to_scaler(results, STEPS, BAD_STEP, BAD_RANK)


def test_under_a_constant_loss_scale_a_nan_gradient_is_a_fault(tmp_path):
    pytest.importorskip("megatron.core")
    env = {"LOSS_SCALE": "constant", "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    results = run_ranks(_worker, 2, str(tmp_path), env)
    assert [result["skipped"] for result in results] == [1, 1], "only the bad batch's step is skipped"
    assert_nan_gradient_is_fault(results, BAD_STEP, BAD_RANK)
