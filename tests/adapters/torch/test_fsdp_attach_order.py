"""Sharding in the wrong order around set_monitor, on two real gloo ranks: one message that
says what happened and what to do, no internal error, and no rows that describe tensors the
training does not use.

FSDP2's ``fully_shard`` makes the model's parameters anew (DTensors). An optimizer built before
it updates the old tensors, which the model no longer uses; a monitor attached before it watches
them. Neither is an error torch reports: the model simply does not train.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import ALL_OPS, MLP
from tests.shared_configs import DATA_TYPES

pytestmark = [pytest.mark.distributed]

#: odd sizes: FSDP2 cuts a (7, 13) weight 4/3 over two ranks, which a flat view of it refuses
SIZES = (13, 7, 5)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


def _worker(rank: int, world_size: int, workdir: str, order: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from monitor import TrainerMon

    said = _Said()
    logging.getLogger("trainmon").addHandler(said)
    torch.manual_seed(0)
    model = MLP(SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon({**DATA_TYPES["all"], "ops": ALL_OPS, "format": "api"})
    if order in (
        "attached before sharding",
        "one layer sharded after attaching",
        "attached before sharding, a new optimizer trains",
    ):
        mon.set_monitor(model, 1, optimizer)
    if order == "one layer sharded after attaching":
        fully_shard(model.layers[0])
    else:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    if order == "in order, left unsharded after backward":
        model.set_reshard_after_backward(False)  # the model holds unsharded tensors at the update
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon.set_monitor(model, 1, optimizer)
    if order == "optimizer built before sharding":
        mon.set_monitor(model, 1, optimizer)
    if order == "attached before sharding, a new optimizer trains":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        x = torch.randn(4, SIZES[0], generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    written = {prefix: len(mon._latest(prefix)) for prefix in ("param_origin", "param_updated", "exp_avg")}
    mon.stop()
    save_result(workdir, rank, {"said": said.messages, "written": written})


@pytest.mark.parametrize("order", ["optimizer built before sharding", "attached before sharding"])
def test_sharding_after_the_optimizer_or_the_monitor_is_said_once_without_errors(tmp_path, order):
    import functools

    for rank, result in enumerate(run_ranks(functools.partial(_worker, order=order), 2, str(tmp_path))):
        said = [m for m in result["said"] if "would describe none of this training" in m]
        assert len(said) == 1, result["said"]
        assert "build the model fully first" in said[0] and "then attach" in said[0]
        assert not [m for m in result["said"] if m.startswith(("ERROR", "CRITICAL"))], result["said"]
        assert result["written"] == {"param_origin": 0, "param_updated": 0, "exp_avg": 0}, (rank, result)


def test_a_layer_sharded_after_attaching_is_named_as_no_longer_the_models(tmp_path):
    """Only part of the model was made anew after set_monitor: the monitor still watches that
    part's old tensors, which the training no longer uses; the message names them."""
    import functools

    order = "one layer sharded after attaching"
    for result in run_ranks(functools.partial(_worker, order=order), 2, str(tmp_path)):
        said = [m for m in result["said"] if "are no longer the model's" in m]
        assert len(said) == 1, result["said"]
        named = "WARNING trainmon: 2 monitored parameter(s) (layers.0.weight, layers.0.bias)"
        assert said[0].startswith(named), said
        assert not [m for m in result["said"] if m.startswith(("ERROR", "CRITICAL"))], result["said"]


def test_a_monitor_attached_before_sharding_whose_optimizer_never_steps_says_so_at_stop(tmp_path):
    """The optimizer given to set_monitor was replaced by one built after sharding: no backward
    pass reaches the monitored tensors and no update is seen, so stop() says why nothing was
    recorded."""
    import functools

    order = "attached before sharding, a new optimizer trains"
    stale = f"{len(list(MLP(SIZES).parameters()))} monitored parameter(s) are no longer the model's"
    for result in run_ranks(functools.partial(_worker, order=order), 2, str(tmp_path)):
        said = [m for m in result["said"] if "never stepped" in m]
        assert len(said) == 1 and stale in said[0], result
        assert result["written"] == {"param_origin": 0, "param_updated": 0, "exp_avg": 0}


def _inner_module_worker(rank: int, world_size: int, workdir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from monitor import TrainerMon
    from tests.adapters.torch.helpers import flat_values

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(SIZES)
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, SIZES[-1]))  # the root unit's own

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    wrapper = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), use_orig_params=True, device_id="cpu"
    )
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=0.01)
    config = {"param_distribution": True, "ops": ALL_OPS, "format": "api", "squash_name": False}
    pieces = TrainerMon({**config, "alert": {"rules": [{"rule_name": "AnomalyNan"}]}})
    merged = TrainerMon({**config, "shard_reduce": True})
    for mon in (pieces, merged):  # the inner module, as a trainer may hand it over
        mon.set_monitor(wrapper.module, 1, optimizer)
    x = torch.randn(4, SIZES[0], generator=torch.Generator().manual_seed(rank))
    wrapper(x).pow(2).mean().backward()
    with FullyShardedDataParallel.summon_full_params(wrapper):  # FSDP's own gather of the whole tensors
        expected = {
            name.replace("_fsdp_wrapped_module.", ""): flat_values(param)
            for name, param in wrapper.module.named_parameters()
        }
    optimizer.step()
    got = merged._latest("param_origin")
    for mon in (pieces, merged):
        mon.stop()
    save_result(workdir, rank, {"expected": expected, "got": got, "incidents": len(pieces.incidents)})


def test_the_inner_module_of_an_fsdp1_wrapper_is_monitored_through_its_wrapper(tmp_path):
    """Through the inner module the root unit's parameters are views of this rank's shard, empty
    on a rank that holds none of them: their rows were NaN and raised an incident at step 0."""
    from tests.adapters.torch.helpers import assert_stats_close, latest_rows

    for rank, result in enumerate(run_ranks(_inner_module_worker, 2, str(tmp_path))):
        assert result["incidents"] == 0
        # named as the wrapper names them (squash_name off keeps FSDP1's segments, as msprobe does)
        rows = {
            k.replace("_fsdp_wrapped_module.", ""): v
            for k, v in latest_rows({"p": result["got"]}, "p").items()
        }
        assert set(rows) == set(result["expected"]), sorted(rows)
        for name, values in result["expected"].items():
            assert_stats_close(rows[name], np.array(values), what=f"rank {rank} {name}")


def test_a_model_left_unsharded_after_backward_is_not_taken_for_one_made_anew(tmp_path):
    """FSDP2 without resharding after backward holds its unsharded tensors on the model when the
    optimizer steps: the monitored (sharded) ones are the optimizer's, and nothing is said."""
    import functools

    order = "in order, left unsharded after backward"
    for result in run_ranks(functools.partial(_worker, order=order), 2, str(tmp_path)):
        assert result["said"] == [], result["said"]
        assert all(count > 0 for count in result["written"].values()), result["written"]
