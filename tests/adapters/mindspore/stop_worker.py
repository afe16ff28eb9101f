"""One rank of the 2-process MindSpore job of test_alert_actions.py (started with msrun).

Each rank trains its own network; rank 1 alone writes a NaN into a gradient at step AT. With
``alert.actions: [checkpoint, stop]`` both ranks must call the checkpoint function and raise
TrainingStopped at the same step; each writes ``result{rank}.json`` under argv[1].
"""

from __future__ import annotations

import json
import os
import sys

STEPS, AT = 20, 5


def main(workdir: str) -> None:
    import mindspore as ms
    import numpy as np
    from mindspore import nn
    from mindspore.communication import get_rank, init

    from monitor import TrainerMon, TrainingStopped

    init()
    from tests.adapters.mindspore.helpers import Net

    rank = get_rank()
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    checkpoints = []
    config = {"wg_distribution": True, "ops": ["norm", "nans"], "alert": {"actions": ["checkpoint", "stop"]}}
    mon = TrainerMon(config).on_checkpoint(lambda step, reason: checkpoints.append(step))
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    rng = np.random.default_rng(100 + rank)
    stopped, last = None, None
    for step in range(STEPS):
        last = step
        _, grads = grad_fn(ms.Tensor(rng.normal(size=(5, 6)).astype(np.float32)))
        if step == AT and rank == 1:
            first = grads[0].asnumpy().copy()
            first[0, 0] = np.nan
            grads = (ms.Tensor(first), *grads[1:])
        try:
            optimizer(grads)
        except TrainingStopped as exc:
            stopped = [exc.step, exc.reason]
            break
    mon.stop()
    result = {"rank": rank, "stopped": stopped, "last_step": last, "checkpoints": checkpoints}
    with open(os.path.join(workdir, f"result{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
