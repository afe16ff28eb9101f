"""Promise 1: the observer effect is zero.

With the monitor attached, 20 steps of training give bit-identical losses, parameters, optimizer
state and RNG state to a run without it (same seeds, deterministic CPU kernels), for every data
type: weight gradients (per step and per micro-batch), parameters, moments, mg_direction,
activations with and without activation checkpointing (reentrant and not), and collectives on two
real gloo ranks. Each run also checks that the monitor really collected that data type, so a
monitor that silently did nothing cannot pass.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from monitor import TrainerMon
from tests.reliability.training import ALL_OPS, EVERYTHING, Net, make_batches, train

STEPS = 20
GRAD_ACC = 2

#: config, model's checkpointing (None: none), and the CSV prefixes that must have rows.
KINDS = {
    "wg": ({"wg_distribution": True}, None, ["grad_unreduced", "grad_reduced"]),
    "wg_per_micro_batch": ({"wg_distribution": True, "monitor_mbs_grad": True}, None, ["grad_unreduced"]),
    "param": ({"param_distribution": True}, None, ["param_origin", "param_updated"]),
    "mv": ({"mv_distribution": True}, None, ["exp_avg", "exp_avg_sq"]),
    "mg_direction": ({"mg_direction": True}, None, ["other"]),
    "xy": ({"xy_distribution": True, "all_xy": True}, None, ["actv", "actv_grad"]),
    "xy_checkpoint_reentrant": ({"xy_distribution": True, "all_xy": True}, True, ["actv", "actv_grad"]),
    "xy_checkpoint_non_reentrant": ({"xy_distribution": True, "all_xy": True}, False, ["actv", "actv_grad"]),
    "everything_tensorboard_alerts": (
        {
            **EVERYTHING,
            "format": "tensorboard",
            "stack_info": True,
            "alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"threshold": 0.5}}], "dump": True},
        },
        False,
        [],
    ),
}


def _run(config: dict | None, reentrant: bool | None) -> dict:
    """20 steps of Net + AdamW from fixed seeds; everything the training could observe afterwards."""
    torch.manual_seed(0)
    model = Net(reentrant=reentrant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = None
    if config is not None:
        mon = TrainerMon({"ops": ALL_OPS, **config})
        mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    losses = train(model, optimizer, make_batches(STEPS, GRAD_ACC, seed=7))
    output = None
    if mon is not None:
        mon.stop()
        output = mon.output_dir
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": [{k: v.clone() for k, v in s.items()} for s in optimizer.state_dict()["state"].values()],
        "rng": torch.get_rng_state(),
        "output": output,
    }


def _assert_identical(plain: dict, monitored: dict) -> None:
    assert monitored["losses"] == plain["losses"]  # exact float equality, every micro-batch
    for i, (a, b) in enumerate(zip(plain["params"], monitored["params"], strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs"
    for a, b in zip(plain["state"], monitored["state"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"optimizer state {key} differs"
    assert torch.equal(plain["rng"], monitored["rng"]), "the monitor consumed random numbers"


@pytest.mark.parametrize("kind", list(KINDS))
def test_twenty_steps_are_bit_identical_with_the_monitor(kind):
    config, reentrant, prefixes = KINDS[kind]
    plain = _run(None, reentrant)
    monitored = _run(config, reentrant)
    _assert_identical(plain, monitored)
    for prefix in prefixes:  # the monitor did collect: every step of this data type is on disk
        steps = set()
        for path in glob.glob(os.path.join(monitored["output"], f"{prefix}_*.csv")):
            with open(path, encoding="utf-8") as handle:
                steps |= {int(line.split(",")[2]) for line in handle.readlines()[1:]}
        assert steps == set(range(STEPS)), f"{prefix}: steps {sorted(steps)}"
    if not prefixes:
        assert glob.glob(os.path.join(monitored["output"], "events.out.tfevents.*"))


# -- collectives on two real gloo ranks --------------------------------------------------------


@pytest.mark.distributed
def test_collectives_monitored_on_two_ranks_leave_the_training_bit_identical(two_rank_results):
    """DDP plus explicit all_reduce/broadcast/all_gather, everything monitored including cc."""
    for rank, result in enumerate(two_rank_results):
        plain, monitored = result["plain"], result["monitored"]
        assert monitored["losses"] == plain["losses"], f"rank {rank}: losses differ"
        assert monitored["params"] == plain["params"], f"rank {rank}: parameters differ"
        assert monitored["comm_steps"] == list(range(STEPS)), f"rank {rank}: collectives not collected"
        assert monitored["errors"] == [], f"rank {rank}: {monitored['errors']}"
