"""Sharding in the wrong order around set_monitor, on two real gloo ranks: one message that
says what happened and what to do, no internal error, and no rows that describe tensors the
training does not use.

FSDP2's ``fully_shard`` makes the model's parameters anew (DTensors). An optimizer built before
it updates the old tensors, which the model no longer uses; a monitor attached before it watches
them. Neither is an error torch reports: the model simply does not train.
"""

from __future__ import annotations

import logging

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
