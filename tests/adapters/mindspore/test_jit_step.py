"""A function compiled with ``mindspore.jit`` that reaches the monitor's hooks, attached without
``graph_mode=True``: MindSpore compiles the hooks of every Cell and Parameter it reaches and fails
on the monitor's (and on any forward hook of a Cell called in a loop, as ``Net``'s ReLU is). The
run must go on exactly as without the monitor, and the user be told what to do."""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np
from mindspore import nn

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import Net, copies, jit_training, make_batches
from tests.reference_stats import assert_stats_close
from tests.shared_outputs import collected_steps

EVERY_HOOK = {
    "wg_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "mg_direction": True,
    "stack_info": True,
    "recording_l2_features": True,
    "l2_targets": {"linear_hook": []},
}
PARAMETERS = {"param_distribution": True, "mv_distribution": True}


def _run(train_step, steps: int = 3) -> list[float]:
    losses = []
    for (x,) in make_batches(steps, 1):
        losses.append(float(train_step(ms.Tensor(x), ms.Tensor(np.tanh(x[:, :4]))).asnumpy()))
    return losses


@pytest.mark.parametrize(
    "config", [PARAMETERS, {**PARAMETERS, **EVERY_HOOK}], ids=["parameters", "every hook"]
)
def test_a_jit_step_runs_as_without_the_monitor_and_the_user_is_told(config, caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    twin = Net()
    _, twin_step = jit_training(twin)
    expected_losses = _run(twin_step)

    net = Net()
    optimizer, train_step = jit_training(net)
    mon = TrainerMon({**config, "ops": ["min", "max", "norm"]})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon.set_monitor(net, 1, optimizer)
        losses = _run(train_step)
        mon.stop()

    assert losses == expected_losses
    for ours, theirs in zip(copies(optimizer.parameters), copies(twin.trainable_params())):
        assert np.array_equal(ours, theirs)
    messages = [r.getMessage() for r in caplog.records]
    compiled = [m for m in messages if "training step is compiled with mindspore.jit" in m]
    assert len(compiled) == 1 and "graph_mode=True" in compiled[0] and "step_end()" in compiled[0], messages
    removed = [m for m in messages if "calls the monitored model" in m]
    assert len(removed) == (1 if "wg_distribution" in config else 0), messages
    assert any("3 update(s) while attached and the monitor saw none" in m for m in messages), messages


def test_step_end_after_a_jit_step_attached_without_graph_mode_says_nothing_is_recorded(
    caplog, tmp_path, monkeypatch
):
    """The user followed half the advice (step_end() after each step, not graph_mode=True): the
    call says that nothing is recorded until attached so, not that PyNative hooks count steps."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer, train_step = jit_training(net)
    mon = TrainerMon({**PARAMETERS, "ops": ["norm"]})
    mon.set_monitor(net, 1, optimizer)
    with caplog.at_level(logging.INFO, logger="trainmon"):
        for (x,) in make_batches(2, 1):
            train_step(ms.Tensor(x), ms.Tensor(np.tanh(x[:, :4])))
            mon.step_end()
    mon.stop()
    said = [
        r for r in caplog.records if "step_end()" in r.getMessage() and "graph_mode=True" in r.getMessage()
    ]
    (told,) = [r for r in said if "reads between steps" in r.getMessage()]
    assert told.levelno == logging.WARNING and "nothing is recorded" in told.getMessage()
    assert "optimizer's hooks count" not in told.getMessage()


def test_a_jit_compiled_evaluation_leaves_out_the_hooks_for_the_step_after_it(caplog, tmp_path, monkeypatch):
    """PyNative training, a jit-compiled evaluation after step 1's update and after step 3's: the
    hooks are removed while it compiles (said once) and put back at the optimizer's next update,
    so step 2 has no gradient or activation rows and step 4, whose evaluation reused the compiled graph,
    has them; parameters go on, equal to numpy's, and each evaluation gives an unmonitored
    twin's loss."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)

    @ms.jit
    def evaluate(x):
        return net(x).square().mean()

    config = {"wg_distribution": True, "xy_distribution": True, **PARAMETERS, "ops": ["min", "max", "norm"]}
    mon = TrainerMon(config)
    mon.set_monitor(net, 1, optimizer)
    names = [p.name for p in optimizer.parameters]
    evaluated = []
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step, (x,) in enumerate(make_batches(5, 1)):
            _, grads = grad_fn(ms.Tensor(x))
            optimizer(grads)
            updated = copies(optimizer.parameters)
            params = mon.generate_param_metrics()
            for k, name in enumerate(names):
                assert_stats_close(
                    params[f"0:{name}/rank0/param_updated"], updated[k], ops=["min", "max", "norm"]
                )
            if step in (1, 3):
                evaluated.append((x, float(evaluate(ms.Tensor(x)).asnumpy()), updated))
    mon.stop()
    twin = Net()
    for x, loss, weights in evaluated:
        for param, weight in zip(twin.trainable_params(), weights):
            param.set_data(ms.Tensor(weight))
        assert loss == pytest.approx(float(twin(ms.Tensor(x)).square().mean().asnumpy()), rel=1e-5)
    (removed,) = [r.getMessage() for r in caplog.records if "calls the monitored model" in r.getMessage()]
    assert (
        "activations" in removed and "gradients" in removed and "until the optimizer's next update" in removed
    )
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    assert collected_steps(out, "param_updated") == [0, 1, 2, 3, 4]
    assert collected_steps(out, "grad_unreduced") == [0, 1, 3, 4]
    assert collected_steps(out, "actv") == [0, 1, 3, 4]


def test_hooks_that_cannot_be_put_back_stay_off_and_the_training_goes_on(caplog):
    """A registration failing when a compilation's removal is undone is logged, and whatever
    was put back before it is removed again, rather than raised into the optimizer's call."""
    from adapters.mindspore.jit_guard import MODEL_CALLS, LeftOutOfJit

    class Handle:
        def __init__(self, live: set) -> None:
            self.live = live
            live.add(self)

        def remove(self) -> None:
            self.live.discard(self)

    live: set = set()
    calls = {"second": 0}

    def failing_later() -> list:
        calls["second"] += 1
        if calls["second"] > 1:
            raise RuntimeError("cannot register")
        return [Handle(live)]

    guard = LeftOutOfJit(MODEL_CALLS, removes=True)
    guard.keep(lambda: [Handle(live), Handle(live)])
    guard.keep(failing_later)
    assert len(live) == 3
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        guard.met()
        assert not live
        guard.restore()
        guard.restore()  # closed: nothing more
    assert not live and calls["second"] == 2
    assert any("they stay off" in r.getMessage() for r in caplog.records)
