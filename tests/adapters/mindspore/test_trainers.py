"""MindSpore's own training wrappers in PyNative mode: ``nn.TrainOneStepCell`` and ``Model.train``
run the forward, backward and optimizer inside their ``construct``; the monitor attached to the
network and the optimizer they wrap records the same numbers as in a hand-written loop.

The gradients are checked against ``value_and_grad`` of the same loss on a twin network holding
a copy of the weights before each step, the parameters against the network's own values after
it. (``TrainOneStepWithLossScaleCell`` needs Ascend's overflow check and does not run on CPU.)
"""

from __future__ import annotations

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
