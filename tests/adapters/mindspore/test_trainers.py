"""MindSpore's own training wrappers in PyNative mode: ``nn.TrainOneStepCell`` and ``Model.train``
run the forward, backward and optimizer inside their ``construct``; the monitor attached to the
network and the optimizer they wrap records the same numbers as in a hand-written loop.

The gradients are checked against ``value_and_grad`` of the same loss on a twin network holding
a copy of the weights before each step, the parameters against the network's own values after
it. (``TrainOneStepWithLossScaleCell`` needs Ascend's overflow check and does not run on CPU.)
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import Net, make_batches
from tests.reference_stats import ALL_OPS, assert_stats_close

CONFIG = {"wg_distribution": True, "param_distribution": True, "ops": list(ALL_OPS), "format": "api"}


def _values(net: nn.Cell) -> list[np.ndarray]:
    return [p.asnumpy().copy() for p in net.trainable_params()]


def test_train_one_step_cell_records_the_gradients_it_applies():
    net, twin = Net(), Net(seed=1)
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    step_cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    step_cell.set_train()
    twin_grads = ms.value_and_grad(nn.WithLossCell(twin, nn.MSELoss()), None, twin.trainable_params())
    names = [p.name for p in net.trainable_params()]
    mon = TrainerMon(CONFIG).set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    for step, (x,) in enumerate(make_batches(4, 1)):
        target = ms.Tensor(np.zeros((x.shape[0], 4), np.float32))
        for mine, theirs in zip(net.trainable_params(), twin.trainable_params()):
            theirs.set_data(ms.Tensor(mine.asnumpy().copy()))
        _, grads = twin_grads(ms.Tensor(x), target)
        step_cell(ms.Tensor(x), target)
        reduced, unreduced = mon.generate_wgrad_metrics()
        params = mon.generate_param_metrics()
        for name, grad, value in zip(names, grads, _values(net), strict=True):
            head, what = f"0:{name}/rank0", f"step {step} {name}"
            assert_stats_close(unreduced[f"{head}/acc_grad"], grad.asnumpy(), what=f"{what} unreduced")
            assert_stats_close(reduced[f"{head}/post_grad"], grad.asnumpy(), what=f"{what} reduced")
            assert_stats_close(params[f"{head}/param_updated"], value, what=f"{what} updated")
    mon.stop()


def test_model_train_records_every_step_of_every_epoch():
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    inputs = np.concatenate([batch for (batch,) in make_batches(4, 1)])
    data = ds.NumpySlicesDataset(
        {"x": inputs, "y": np.zeros((len(inputs), 4), np.float32)}, shuffle=False
    ).batch(5)
    names = [p.name for p in net.trainable_params()]
    mon = TrainerMon(CONFIG).set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    seen = []

    class Check(ms.train.Callback):
        def on_train_step_end(self, run_context):
            reduced, _ = mon.generate_wgrad_metrics()
            params = mon.generate_param_metrics()
            for name, value in zip(names, _values(net), strict=True):
                assert_stats_close(params[f"0:{name}/rank0/param_updated"], value, what=name)
            seen.append((mon.step, len(reduced)))

    ms.train.Model(net, nn.MSELoss(), optimizer).train(2, data, callbacks=[Check()], dataset_sink_mode=False)
    mon.stop()
    assert seen == [(step + 1, len(names)) for step in range(8)]  # 2 epochs of 4 batches


class _Listed(nn.Cell):
    """A network whose parameters all sit in a CellList (never called itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.CellList([nn.Dense(6, 8), nn.Dense(8, 4)])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _TunedHead(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = Net(sizes=(6, 8, 8)), nn.Dense(8, 4)

    def construct(self, x):
        return self.head(self.backbone(x))


class _TrainCell(nn.Cell):
    """A train network of the user's own: holds what it calls and the optimizer."""

    def __init__(self, optimizer: nn.Optimizer, **inner: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        for name, cell in inner.items():
            setattr(self, name, cell)
        self.optimizer = optimizer


def _adam(*cells: nn.Cell, head_only: bool = False) -> nn.Optimizer:
    params = [p for cell in cells for p in (cell.head if head_only else cell).trainable_params()]
    return nn.Adam(params, learning_rate=0.05)


def test_a_train_network_is_monitored_at_the_network_its_optimizer_trains(caplog):
    """Whatever holds the parameters inside the network (a CellList, a frozen backbone beside a
    tuned head), the monitored Cell is the network the train network calls, as
    ``Model(net, loss_fn, optimizer)`` would monitor it; a network registered twice (itself and
    in its loss cell) is one; an optimizer over two sibling networks finds none, and says so."""
    from adapters.mindspore.optim import trained_network

    listed = _Listed()
    optimizer = _adam(listed)
    assert trained_network(_TrainCell(optimizer, net=listed), optimizer) is listed
    tuned = _TunedHead()
    optimizer = _adam(tuned, head_only=True)
    loss = nn.WithLossCell(tuned, nn.MSELoss())
    assert trained_network(_TrainCell(optimizer, loss=loss), optimizer) is tuned
    assert trained_network(_TrainCell(optimizer, net=tuned, loss=loss), optimizer) is tuned
    assert trained_network(tuned, optimizer) is tuned  # no optimizer inside: as given
    first, second = _TunedHead(), _Listed()
    optimizer = _adam(first, second)
    both = _TrainCell(optimizer, first=first, second=second)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert trained_network(both, optimizer) is both
    assert "no one Cell inside it" in caplog.text
