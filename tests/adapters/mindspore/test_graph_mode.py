"""Graph mode: no hooks run, so parameters and Adam's moments are read from the host at each
``step_end()``; every statistic equals numpy's on copies made by the test. The same for a step
compiled with ``mindspore.jit`` in PyNative mode (``set_monitor(..., graph_mode=True)``), where
no hook runs."""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
import pandas as pd
from mindspore import nn

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import (
    DIM,
    HEADS,
    SEQ,
    AttentionNet,
    Net,
    copies,
    jit_training,
    make_batches,
)
from tests.reference_stats import ALL_OPS, assert_stats_close
from tests.shared_outputs import collected_steps

CONFIG = {"param_distribution": True, "mv_distribution": True, "ops": ALL_OPS}


@pytest.fixture
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _train_network(net: nn.Cell) -> tuple[nn.Cell, nn.Optimizer]:
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    loss = nn.WithLossCell(net, nn.MSELoss())
    return nn.TrainOneStepCell(loss, optimizer), optimizer


def _target(x: np.ndarray) -> ms.Tensor:
    return ms.Tensor(np.tanh(x[:, :4]))


def _dataset(samples: int) -> ds.GeneratorDataset:
    """``samples`` (x, tanh(x[:4])) pairs in batches of 2, for Model.train."""
    data = [(x[0], np.tanh(x[0][:4])) for (x,) in make_batches(samples, 1, batch=1)]
    return ds.GeneratorDataset(data, ["x", "y"], shuffle=False).batch(2)


def _rows(output_dir: str, prefix: str, step: int) -> dict[str, dict[str, float]]:
    frame = pd.read_csv(os.path.join(output_dir, f"{prefix}_{step}-{step}.csv"))
    return {row["name"]: row for _, row in frame.iterrows()}


def test_parameters_and_moments_match_numpy_and_hook_data_types_are_named(graph_mode, caplog):
    net = Net()
    train, optimizer = _train_network(net)
    mon = TrainerMon({**CONFIG, "wg_distribution": True, "xy_distribution": True, "format": "api"})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    (warning,) = [r.getMessage() for r in caplog.records if "graph mode" in r.getMessage()]
    assert "wg_distribution, xy_distribution" in warning and "PyNative" in warning
    _train_and_compare(mon, optimizer, train)
    assert mon.generate_wgrad_metrics() == ({}, {})
    mon.stop()


def _train_and_compare(mon: TrainerMon, optimizer: nn.Optimizer, train) -> None:
    """Three steps, each followed by step_end(): parameters before and after the update and both
    moments equal numpy's on the test's copies."""
    names = [p.name for p in optimizer.parameters]
    for step, (x,) in enumerate(make_batches(3, 1)):
        origin = copies(optimizer.parameters)
        train(ms.Tensor(x), _target(x))
        mon.step_end()
        assert mon.step == step + 1
        updated = copies(optimizer.parameters)
        moments = copies(optimizer.moment1), copies(optimizer.moment2)
        params, mv = mon.generate_param_metrics(), mon.generate_mv_metrics()
        for k, name in enumerate(names):
            head = f"0:{name}/rank0"
            assert_stats_close(params[f"{head}/param_origin"], origin[k], what=f"{name} origin")
            assert_stats_close(params[f"{head}/param_updated"], updated[k], what=f"{name} updated")
            assert_stats_close(mv[f"{head}/exp_avg"], moments[0][k], what=f"{name} exp_avg")
            assert_stats_close(mv[f"{head}/exp_avg_sq"], moments[1][k], what=f"{name} exp_avg_sq")
            assert not np.array_equal(origin[k], updated[k])


def test_steps_run_together_are_numbered_by_the_update_count(graph_mode, tmp_path, monkeypatch):
    """Several steps between two step_end() calls (as with dataset sinking): the last is
    collected as the step it is, without param_origin rows; a call without an update adds nothing."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    train, optimizer = _train_network(net)
    mon = TrainerMon({**CONFIG, "ops": ["min", "max", "norm"]})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    batches = [x for (x,) in make_batches(4, 1)]
    train(ms.Tensor(batches[0]), _target(batches[0]))
    mon.step_end()
    for x in batches[1:]:
        train(ms.Tensor(x), _target(x))
    mon.step_end()
    mon.step_end()
    assert mon.step == 4
    final = dict(zip([p.name for p in optimizer.parameters], copies(optimizer.parameters)))
    mon.stop()
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    assert collected_steps(out, "param_updated") == [0, 3]
    assert collected_steps(out, "exp_avg_sq") == [0, 3]
    assert collected_steps(out, "param_origin") == [0]
    for name, row in _rows(out, "param_updated", 3).items():
        assert_stats_close(dict(row), final[name], ops=["min", "max", "norm"], what=name)


@pytest.mark.parametrize("step_end", [False, True], ids=["step_end forgotten", "step_end called"])
def test_updates_the_monitor_never_saw_are_said_at_stop(graph_mode, tmp_path, monkeypatch, caplog, step_end):
    """Graph mode runs no hook: without step_end() nothing is recorded, which stop() says."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    train, optimizer = _train_network(net)
    mon = TrainerMon({**CONFIG, "ops": ["norm"]})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    for (x,) in make_batches(3, 1):
        train(ms.Tensor(x), _target(x))
        if step_end:
            mon.step_end()
    mon.stop()
    said = [r.getMessage() for r in caplog.records if "saw none" in r.getMessage()]
    assert len(said) == (0 if step_end else 1), said
    assert step_end or "the optimizer made 3 update(s)" in said[0]


def test_model_train_callback_collects_every_step_in_graph_mode(graph_mode, tmp_path, monkeypatch):
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    dataset = _dataset(6)
    callback = TrainmonCallback({**CONFIG, "ops": ["min", "max", "norm"]})
    model = ms.train.Model(net, nn.MSELoss(), optimizer)
    model.train(2, dataset, callbacks=[callback], dataset_sink_mode=False)
    assert not callback.monitor.monitoring  # closed at the end of training
    final = dict(zip([p.name for p in optimizer.parameters], copies(optimizer.parameters)))
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    assert collected_steps(out, "param_updated") == list(range(6))
    assert collected_steps(out, "param_origin") == list(range(6))
    for name, row in _rows(out, "param_updated", 5).items():
        assert_stats_close(dict(row), final[name], ops=["min", "max", "norm"], what=name)


def test_model_train_callback_in_pynative_mode_says_nothing_of_step_end(tmp_path, monkeypatch, caplog):
    """PyNative: the optimizer's hooks mark the steps, so the callback does not call step_end()
    (whose note that it is for graph mode would puzzle a user who never called it)."""
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    dataset = _dataset(4)
    callback = TrainmonCallback({**CONFIG, "ops": ["min", "max", "norm"]})
    with caplog.at_level(logging.INFO, logger="trainmon"):
        ms.train.Model(net, nn.MSELoss(), optimizer).train(
            2, dataset, callbacks=[callback], dataset_sink_mode=False
        )
    assert "step_end" not in caplog.text
    final = dict(zip([p.name for p in optimizer.parameters], copies(optimizer.parameters)))
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    assert collected_steps(out, "param_updated") == list(range(4))
    for name, row in _rows(out, "param_updated", 3).items():
        assert_stats_close(dict(row), final[name], ops=["min", "max", "norm"], what=name)


class _Accumulating(nn.Cell):
    """A train network of the user's own that adds the gradients of two micro-batches and then
    calls its optimizer: ``Model`` is given it alone and holds no optimizer."""

    def __init__(self, net: nn.Cell, optimizer: nn.Optimizer) -> None:
        super().__init__(auto_prefix=False)
        self.net, self.optimizer, self.total, self.count = net, optimizer, None, 0
        self.grad = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, optimizer.parameters)

    def construct(self, x, y):
        loss, grads = self.grad(x, y)
        self.total = grads if self.total is None else tuple(a + b for a, b in zip(self.total, grads))
        self.count += 1
        if self.count == 2:
            self.optimizer(tuple(g / 2 for g in self.total))
            self.total, self.count = None, 0
        return loss


def test_model_train_callback_finds_the_optimizer_a_train_network_of_its_own_calls(tmp_path, monkeypatch):
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    dataset = _dataset(8)
    callback = TrainmonCallback({**CONFIG, "ops": ["min", "max", "norm"]}, grad_acc_steps=2)
    ms.train.Model(_Accumulating(net, optimizer)).train(
        1, dataset, callbacks=[callback], dataset_sink_mode=False
    )
    final = dict(zip([p.name for p in optimizer.parameters], copies(optimizer.parameters)))
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if "-rank0-" in d]
    assert collected_steps(out, "param_updated") == [0, 1]  # 4 micro-batches, 2 updates
    rows = _rows(out, "param_updated", 1)
    assert sorted(rows) == sorted(final)  # the model's, not the optimizer's moments it holds
    for name, row in rows.items():
        assert_stats_close(dict(row), final[name], ops=["min", "max", "norm"], what=name)


def test_a_train_network_of_its_own_gets_the_activations_of_the_network_it_trains(
    tmp_path, monkeypatch, caplog
):
    """The train network calls value_and_grad inside its own call and holds the optimizer: the
    monitor records the activations of the network inside it that the optimizer trains (named as
    with ``Model(net, loss, optimizer)``), every micro-batch, and the optimizer's compiled
    ``construct`` meets no hook of the monitor's."""
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    config = {"xy_distribution": True, "ops": ["min", "max", "norm"], "step_count_per_record": 10}
    callback = TrainmonCallback(config, grad_acc_steps=2)
    with caplog.at_level(logging.INFO, logger="trainmon"):
        ms.train.Model(_Accumulating(net, optimizer)).train(
            1, _dataset(8), callbacks=[callback], dataset_sink_mode=False
        )
    (out,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if "-rank0-" in d]
    frame = pd.read_csv(os.path.join(out, "actv_0-9.csv"))
    assert sorted(set(frame["step"])) == [0, 1] and sorted(set(frame["micro_step"])) == [0, 1]
    assert {"layers.0.input", "layers.0.output", ".output"} <= set(frame["name"])
    inputs = [x for x, _ in _dataset(8).create_tuple_iterator(output_numpy=True)]
    for step in (0, 1):
        for micro in (0, 1):
            chosen = (frame["name"] == ".input") & (frame["step"] == step) & (frame["micro_step"] == micro)
            (row,) = frame[chosen].to_dict("records")
            assert_stats_close(row, inputs[2 * step + micro], ops=["min", "max", "norm"], what=(step, micro))
    assert "mindspore.jit" not in caplog.text
    assert "holds its optimizer; monitoring the network it trains inside it, Net" in caplog.text


def test_a_callback_given_a_trainermon_attached_by_hand_leaves_it_recording(tmp_path, monkeypatch, caplog):
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    dataset = _dataset(4)
    mon = TrainerMon({**CONFIG, "ops": ["norm"]})
    mon.set_monitor(net, 1, optimizer)
    with caplog.at_level(logging.INFO, logger="trainmon"):
        ms.train.Model(net, nn.MSELoss(), optimizer).train(
            2, dataset, callbacks=[TrainmonCallback(mon)], dataset_sink_mode=False
        )
    assert "already attached (set_monitor was called on it)" in caplog.text
    assert "continues unmonitored" not in caplog.text
    assert mon.monitoring and mon.step == 4
    mon.stop()
    (run,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if "-rank0-" in d]
    assert collected_steps(run, "param_updated") == [0, 1, 2, 3]


def test_a_second_model_train_with_the_same_callback_goes_on_numbering(tmp_path, monkeypatch):
    """A Model.train per epoch: the second goes on in the first's run directory (its anomaly
    files and incident numbers too) from the optimizer's update count: steps 0-1, then 2-3, as
    the optimizer counts them, not 0-1 twice."""
    from monitor.integrations.mindspore import TrainmonCallback

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    dataset = _dataset(4)
    callback = TrainmonCallback({**CONFIG, "ops": ["norm"]})
    model = ms.train.Model(net, nn.MSELoss(), optimizer)
    for _ in range(2):
        model.train(1, dataset, callbacks=[callback], dataset_sink_mode=False)
    assert int(optimizer.global_step.asnumpy().reshape(-1)[0]) == 4
    (run,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if "-rank0-" in d]
    assert collected_steps(run, "param_updated") == [0, 1, 2, 3]


def test_step_end_does_nothing_in_pynative_mode():
    """In PyNative mode the optimizer's hooks mark the steps: step_end() neither counts nor collects."""
    net = Net()
    train, optimizer = _train_network(net)
    mon = TrainerMon({**CONFIG, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    for (x,) in make_batches(2, 1):
        train(ms.Tensor(x), _target(x))
        mon.step_end()
    assert mon.step == 2
    mon.stop()


def test_update_histograms_in_graph_mode_equal_numpy(graph_mode):
    from tests.reference_stats import read_histograms, update_histogram_reference

    net = Net()
    train, optimizer = _train_network(net)
    mon = TrainerMon({"ur_distribution": True, "format": "tensorboard"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    moments = []
    for (x,) in make_batches(2, 1):
        train(ms.Tensor(x), _target(x))
        mon.step_end()
        moments.append((copies(optimizer.moment1), copies(optimizer.moment2)))
    mon.stop()
    betas = (float(optimizer.beta1.asnumpy()), float(optimizer.beta2.asnumpy()))
    eps = float(optimizer.eps.asnumpy())
    found = read_histograms(mon.output_dir)
    for step, (exp_avg, exp_avg_sq) in enumerate(moments):
        for j, name in enumerate(p.name for p in optimizer.parameters):
            expected = update_histogram_reference(exp_avg[j], exp_avg_sq[j], step + 1, betas, eps)
            for kind, (counts, nans) in expected.items():
                got_counts, got_nans = found[(f"0:{name}/rank0/{kind}", step)]
                assert np.array_equal(got_counts, counts) and got_nans == nans, (step, name, kind)


def test_a_jit_compiled_step_in_pynative_mode_is_read_between_steps(caplog):
    net = Net()
    optimizer, train_step = jit_training(net)
    mon = TrainerMon({**CONFIG, "wg_distribution": True, "format": "api"})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon.set_monitor(net, 1, optimizer, graph_mode=True)
    assert any("wg_distribution" in r.getMessage() for r in caplog.records), caplog.records
    _train_and_compare(mon, optimizer, train_step)
    mon.stop()


def test_a_bad_graph_mode_argument_is_refused_at_the_door():
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    with pytest.raises(ValueError, match="graph_mode: expected true, false or None, got 'yes'"):
        TrainerMon({"param_distribution": True, "format": "api"}).set_monitor(
            net, 1, optimizer, graph_mode="yes"
        )


def test_torchs_compiled_argument_is_refused_at_the_door():
    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
    with pytest.raises(ValueError, match=r"compiled: PyTorch only .*graph_mode=True"):
        TrainerMon({"param_distribution": True, "format": "api"}).set_monitor(
            net, 1, optimizer, compiled=True
        )


def test_attention_features_are_off_in_graph_mode_and_linear_ones_read_the_updated_weights(
    graph_mode, caplog
):
    """Attention features need a hook on a Cell inside the compiled step (which breaks its
    compilation): off, and said; the linear ones read the weights at step_end(), after the update."""
    net = AttentionNet()
    train, optimizer = _train_network(net)
    config = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["attention"], "linear_hook": []},
        "sa_order": "b,s,h,d",
        "format": "api",
    }
    mon = TrainerMon(config)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    (warning,) = [r.getMessage() for r in caplog.records if "graph mode" in r.getMessage()]
    assert "l2_targets.attention_hook" in warning, warning
    rng = np.random.default_rng(3)
    for step in range(2):
        x = rng.normal(size=(2, SEQ, HEADS * DIM)).astype(np.float32)
        train(ms.Tensor(x), ms.Tensor(np.zeros((2, SEQ, 5), np.float32)))
        mon.step_end()
        assert mon._latest("attention_hook") == {}
        rows = mon._latest("linear_hook")
        for name in ("qkv", "out"):
            weight = getattr(net, name).weight.asnumpy().astype(np.float64)
            sigma = np.linalg.svd(weight, compute_uv=False)[0]
            row = rows[f"0:{name}.linear/rank0/sr"]  # a module's row, under the tag of its last op
            assert row["kernel_norm"] == pytest.approx(sigma, rel=0.01), (step, name)
    mon.stop()
