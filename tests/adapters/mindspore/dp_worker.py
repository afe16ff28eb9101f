"""One rank of the 2-process MindSpore data-parallel job that test_distributed.py starts with msrun.

Each rank trains the same network on its own data with a DistributedGradReducer and the monitor
attached, keeps numpy copies of what every data type must describe, and writes them with the
rank's output directory into ``result{rank}.npz`` / ``result{rank}.json`` under argv[1].

Besides the reducer (a jit-compiled Cell, whose AllReduce the monitor cannot see), the loop
makes PyNative collective calls of its own, as training loops do for logging: two AllReduce and
one Broadcast per step with primitives created before ``set_monitor``, and one AllGather with a
primitive created after it (seen from the second step on). Their inputs and outputs are kept.
A second monitor with ``cc_codeline`` keeps only the calls made in ``_summed_loss``; at the end a
third one with ``cc_log_only`` logs the calls of one step and stops the loop.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init

STEPS = 3
LOG_ONLY_STEPS = 3


def _summed_loss(all_reduce, loss):
    """The sum of the ranks' losses, as training loops log it (the call site cc_codeline selects)."""
    return all_reduce(loss.reshape(1))


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _log_only(net, optimizer, grad_fn, reducer, all_reduce, all_gather) -> dict:
    """cc_log_only: the calls of the first step are logged once each, then the run is stopped."""
    from monitor import CollectivesLogged, TrainerMon

    messages = _Messages()
    logging.getLogger("trainmon").addHandler(messages)
    mon = TrainerMon({"cc_distribution": {"enable": True, "cc_log_only": True}, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    stopped_at = None
    for step in range(LOG_ONLY_STEPS):
        loss, grads = grad_fn(ms.Tensor(np.ones((5, 6), np.float32)))
        for _ in range(2):  # the same call twice: logged once
            _summed_loss(all_reduce, loss)
        all_gather(grads[2])
        try:
            optimizer(reducer(grads))
        except CollectivesLogged:
            stopped_at = step
            break
    mon.stop()
    logging.getLogger("trainmon").removeHandler(messages)
    logged = [m for m in messages.messages if m.startswith("trainmon: collective ")]
    return {"stopped_at": stopped_at, "messages": logged}


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
        "cc_distribution": {"enable": True, "cc_pre_hook": True},
    }
    all_reduce, broadcast = ops.AllReduce(), ops.Broadcast(0)
    mon = TrainerMon(config)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    codeline_config = {"cc_distribution": {"enable": True, "cc_codeline": ["_summed_loss"]}}
    watcher = TrainerMon({**codeline_config, "ops": config["ops"], "format": "api"})
    watcher.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    all_gather = ops.AllGather()
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    rng = np.random.default_rng(100 + rank)  # every rank its own data
    saved: dict[str, np.ndarray] = {}
    codeline = []
    for step in range(STEPS):
        loss, grads = grad_fn(ms.Tensor(rng.normal(size=(5, 6)).astype(np.float32)))
        kept = {"local": copies(grads), "param_origin": copies(optimizer.parameters)}
        calls = [  # (op, what is called, with which arguments, the tensors it sends)
            ("AllReduce", _summed_loss, (all_reduce, loss), [loss.reshape(1)]),
            ("AllReduce", all_reduce, (grads[0],), [grads[0]]),
            # on CPU MindSpore sends only the first tensor of a Broadcast tuple: one tensor here
            ("Broadcast", broadcast, ((grads[1],),), [grads[1]]),
            ("AllGather", all_gather, (grads[2],), [grads[2]]),
        ]
        for i, (name, function, args, inputs) in enumerate(calls):
            out = function(*args)
            kept[f"cc_in_{i}_{name}"] = copies(inputs)
            kept[f"cc_out_{i}_{name}"] = copies(out if isinstance(out, tuple) else (out,))
        reduced = reducer(grads)
        kept["reduced"] = copies(reduced)
        optimizer(reduced)
        kept["param_updated"] = copies(optimizer.parameters)
        kept["exp_avg"] = copies(optimizer.moment1)
        kept["exp_avg_sq"] = copies(optimizer.moment2)
        codeline.append(watcher._core.latest.latest("comm"))
        for key, arrays in kept.items():
            for j, array in enumerate(arrays):
                saved[f"{key}/{step}/{j}"] = array
    primitives = (all_reduce, broadcast, all_gather, reducer.allreduce)
    originals = (ops.AllReduce, ops.Broadcast, ops.AllGather, ops.AllReduce)
    wrapped = [type(p) is not cls and isinstance(p, cls) for p, cls in zip(primitives, originals)]
    mon.stop()
    watcher.stop()
    restored = [type(p) is cls for p, cls in zip(primitives, originals)]
    log_only = _log_only(net, optimizer, grad_fn, reducer, all_reduce, all_gather)
    np.savez(os.path.join(workdir, f"result{rank}.npz"), **saved)
    result = {
        "rank": rank,
        "size": size,
        "output_dir": mon.output_dir,
        "names": [p.name for p in optimizer.parameters],
        "steps": STEPS,
        "wrapped": wrapped,
        "restored": restored,
        "codeline": codeline,
        "log_only": log_only,
    }
    with open(os.path.join(workdir, f"result{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
