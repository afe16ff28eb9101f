"""One rank of the 2-process MindSpore data-parallel job that test_distributed.py starts with msrun.

Each rank trains the same network on its own data with a DistributedGradReducer and the monitor
attached, keeps numpy copies of what every data type must describe, and writes them with the
rank's output directory into ``result{rank}.npz`` / ``result{rank}.json`` under argv[1].
"""

from __future__ import annotations

import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

STEPS = 3


def main(workdir: str) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    init()  # first: every process reaches the rendezvous as early as it can
    from monitor import TrainerMon
    from tests.adapters.mindspore.helpers import Net, copies

    rank, size = get_rank(), get_group_size()
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=size)
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "mg_direction": True,
        "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    }
    mon = TrainerMon(config)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    rng = np.random.default_rng(100 + rank)  # every rank its own data
    saved: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        _, grads = grad_fn(ms.Tensor(rng.normal(size=(5, 6)).astype(np.float32)))
        kept = {"local": copies(grads), "param_origin": copies(optimizer.parameters)}
        reduced = reducer(grads)
        kept["reduced"] = copies(reduced)
        optimizer(reduced)
        kept["param_updated"] = copies(optimizer.parameters)
        kept["exp_avg"] = copies(optimizer.moment1)
        kept["exp_avg_sq"] = copies(optimizer.moment2)
        for key, arrays in kept.items():
            for j, array in enumerate(arrays):
                saved[f"{key}/{step}/{j}"] = array
    mon.stop()
    np.savez(os.path.join(workdir, f"result{rank}.npz"), **saved)
    result = {
        "rank": rank,
        "size": size,
        "output_dir": mon.output_dir,
        "names": [p.name for p in optimizer.parameters],
        "steps": STEPS,
    }
    with open(os.path.join(workdir, f"result{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
