"""TrainmonCallback for MindSpore's ``Model.train``, in graph mode and in PyNative mode.

    from monitor.integrations.mindspore import TrainmonCallback
    model = ms.train.Model(net, loss_fn, optimizer)
    model.train(epochs, dataset, callbacks=[TrainmonCallback("monitor_config.json")])

At ``on_train_begin`` the callback attaches to the network and optimizer that ``Model`` holds;
in graph mode it calls ``step_end()`` after each step, which reads the parameters and Adam's
moments from the host (a compiled step runs no hook); in PyNative mode the optimizer's hooks
mark the steps. At ``on_train_end`` it closes the outputs.

Step numbers: the monitor's step ``s`` is the optimizer's update ``s + 1`` (MindSpore's
``cur_step_num`` after it), also when ``Model.train`` runs again with the same callback: each
run starts from the optimizer's update count (``global_step``), in the same run directory when
it trains the same network with the same optimizer. With dataset sinking a
callback runs once per sunk group of steps: the last of them is collected, without its
``param_origin`` rows (its parameters before the update are gone by then).
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore.train import Callback

from monitor.integrations import MonitorCallback, MonitorSource


class TrainmonCallback(MonitorCallback, Callback):
    """Attach trainmon to a ``Model.train`` run.

    Args:
        config: a config file path, a dict, a MonitorConfig, or a TrainerMon already built.
        grad_acc_steps: micro-batches per optimizer step, where the train network accumulates.
        optimizer: the optimizer to monitor where ``Model`` holds none (a train network of your
            own that calls its optimizer, as one that accumulates gradients does); by default
            ``Model``'s, else the one optimizer Cell inside the network.
        **trainer_mon_kwargs: passed to TrainerMon.

    Raises:
        ConfigError: the config is invalid (raised here, before training starts).
    """

    for_trainer = "MindSpore's Model.train"

    def __init__(
        self, config: MonitorSource, grad_acc_steps: int = 1, optimizer: Any = None, **trainer_mon_kwargs: Any
    ) -> None:
        super().__init__(config, **trainer_mon_kwargs)
        self.grad_acc_steps = grad_acc_steps
        self.optimizer = optimizer
        self._graph_mode = False

    def on_train_begin(self, run_context: Any) -> None:
        # as the session decides at attach: in PyNative mode the optimizer's hooks mark the steps
        self._graph_mode = ms.get_context("mode") != ms.PYNATIVE_MODE
        args = run_context.original_args()
        optimizer = self.optimizer or args.optimizer or _held_optimizer(args.network)
        self.attach(
            "MindSpore Model.train",
            model=args.network,
            grad_acc_steps=self.grad_acc_steps,
            optimizer=optimizer,
            start_iteration=_updates_so_far(optimizer),
        )

    def on_train_step_end(self, run_context: Any) -> None:
        if self.attached and self._graph_mode:
            self.monitor.step_end()

    def on_train_end(self, run_context: Any) -> None:
        self.detach()


def _held_optimizer(network: Any) -> Any:
    """The one optimizer Cell inside a train network that ``Model`` was given without an
    optimizer (it calls its own); None where there is none or several (which one is ambiguous)."""
    found = {id(cell): cell for _, cell in network.cells_and_names() if isinstance(cell, ms.nn.Optimizer)}
    return next(iter(found.values())) if len(found) == 1 else None


def _updates_so_far(optimizer: Any) -> int:
    """The optimizer's update count (``global_step``, one host copy at attach), 0 without one:
    a later ``Model.train`` of the same model goes on numbering where the last one ended."""
    count = getattr(optimizer, "global_step", None)
    return int(count.asnumpy().reshape(-1)[0]) if count is not None else 0
