"""When a torch release moves the FSDP state the monitor reads privately, training goes on, the
monitor says so once, and records what it still can.

Two real gloo ranks; the private readers are made to fail as they would on a torch that changed
them (``FsdpInternalsChanged``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.test_fsdp import MICRO, _optimizer, _sharded, _train_step
from tests.log_capture import trainmon_records

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = {"wg_distribution": True, "ops": ["norm", "min", "max"], "format": "api", "shard_reduce": True}


def _changed(*args, **kwargs):
    from adapters.torch.sharded.fsdp_internals import FsdpInternalsChanged

    raise FsdpInternalsChanged("moved in this torch")


def _worker(rank: int, world_size: int, workdir: str, case: str, reader: str) -> None:
    import importlib

    from monitor import TrainerMon

    module, name = reader.rsplit(".", 1)
    setattr(importlib.import_module(module), name, _changed)
    model, _ = _sharded(case)
    optimizer = _optimizer(model.parameters())
    with trainmon_records() as log:
        mon = TrainerMon(CONFIG).set_monitor(model, MICRO, optimizer)
        for step in range(2):
            _train_step(model, optimizer, rank, step)
        rows = {prefix: sorted(mon._latest(prefix)) for prefix in ("grad_reduced", "grad_unreduced")}
        mon.stop()
    trained = all(torch.isfinite(p.detach()).all() for p in model.parameters())
    save_result(
        workdir,
        rank,
        {"rows": rows, "warnings": log.warnings(), "errors": len(log.errors()), "trained": trained},
    )


@pytest.mark.parametrize(
    ("case", "reader", "said"),
    [
        ("fsdp2-bf16", "adapters.torch.sharded.fsdp.fsdp2_records", "gradient accumulator elsewhere"),
        (
            "fsdp1-flat-params",
            "adapters.torch.sharded.fsdp_flat.flat_layout",
            "flat-parameter layout elsewhere",
        ),
    ],
)
def test_a_changed_fsdp_internal_is_said_once_and_training_goes_on(tmp_path, case, reader, said):
    per_rank = run_ranks(functools.partial(_worker, case=case, reader=reader), 2, str(tmp_path))
    for result in per_rank:
        assert result["trained"] and not result["errors"], result
        assert sum(said in w for w in result["warnings"]) == 1, result["warnings"]
        assert result["rows"]["grad_reduced"], "reduced gradients are still recorded"
        if case.startswith("fsdp2"):  # the last micro-batch's gradient, said so
            assert len(result["rows"]["grad_unreduced"]) == len(result["rows"]["grad_reduced"])
        else:  # rows of the flat parameters as the optimizer sees them; no unreduced gradient
            assert all("_flat_param" in tag for tag in result["rows"]["grad_reduced"]), result["rows"]
            assert result["rows"]["grad_unreduced"] == []


def test_fsdp2s_module_class_is_found_where_torch_2_5_kept_it(monkeypatch):
    """torch 2.5 kept FSDP2 under ``_composable.fsdp`` only; without it, FSDP2 modules would go
    unseen and their parameters' hooks would fire after the reduce-scatter."""
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as public

    from adapters.torch.sharded.fsdp_internals import fsdp2_module_type

    assert fsdp2_module_type() is public.FSDPModule
    composable_type = composable.FSDPModule
    monkeypatch.delattr(public, "FSDPModule")  # as in torch 2.5
    assert fsdp2_module_type() is composable_type
    monkeypatch.delattr(composable, "FSDPModule")  # a torch without distributed support
    assert fsdp2_module_type() is None


def test_a_record_without_fsdp2s_gradient_accumulator_is_a_changed_internal():
    """A torch whose FSDP2 records keep no ``unsharded_accumulated_grad`` is said to have changed
    (and the sum is said to be missing), not read as if nothing were pending."""
    from types import SimpleNamespace

    from adapters.torch.sharded.fsdp_internals import FsdpInternalsChanged, fsdp2_records

    param = torch.nn.Parameter(torch.ones(2))
    kept = SimpleNamespace(_unsharded_param=param, unsharded_param=param, unsharded_accumulated_grad=None)
    assert fsdp2_records(SimpleNamespace(fsdp_params=[kept])) == {id(param): kept}
    moved = SimpleNamespace(_unsharded_param=param, unsharded_param=param)
    with pytest.raises(FsdpInternalsChanged):
        fsdp2_records(SimpleNamespace(fsdp_params=[moved]))
