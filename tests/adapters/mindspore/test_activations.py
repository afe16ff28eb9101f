"""Cell activations on MindSpore: every row against numpy, names, micro-steps, what is left out."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np
from mindspore import nn

from adapters.mindspore import activations
from monitor import TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train
from tests.reference_stats import ALL_OPS, assert_stats_close

#: MindSpore's nn.LayerNorm default epsilon.
LAYER_NORM_EPS = 1e-7


def _forward_backward(weights: dict[str, np.ndarray], x: np.ndarray):
    """The test's own float64 forward and backward of Net for loss = mean(out ** 2).

    Returns ``(values, grads)``: each Cell call's input/output and the loss's gradient with
    respect to each of them, under the names the monitor must use.
    """
    x = x.astype(np.float64)
    values, pre = {".input": x, "layers.0.input": x}, {}
    h = x
    for i in range(3):
        h = h @ weights[f"layers.{i}.weight"].T + weights[f"layers.{i}.bias"]
        values[f"layers.{i}.output"] = h
        if i < 2:
            act = "act" if i == 0 else "act[1]"
            pre[act] = h
            values[f"{act}.input"] = h
            h = np.maximum(h, 0.0)
            values[f"{act}.output"] = h
        values[f"layers.{i + 1}.input" if i < 2 else "norm.input"] = h
    mu = h.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((h - mu) ** 2).mean(axis=-1, keepdims=True) + LAYER_NORM_EPS)
    xhat = (h - mu) * rstd
    out = xhat * weights["norm.gamma"] + weights["norm.beta"]
    values["norm.output"] = values[".output"] = out
    grads = {}
    dout = 2.0 * out / out.size
    grads[".output_grad"] = grads["norm.output_grad"] = dout
    dxhat = dout * weights["norm.gamma"]
    n = h.shape[-1]
    dh = rstd / n * (n * dxhat - dxhat.sum(-1, keepdims=True) - xhat * (dxhat * xhat).sum(-1, keepdims=True))
    grads["norm.input_grad"] = grads["layers.2.output_grad"] = dh
    for i in (2, 1):
        act = "act" if i == 1 else "act[1]"
        dh = dh @ weights[f"layers.{i}.weight"]
        grads[f"layers.{i}.input_grad"] = grads[f"{act}.output_grad"] = dh
        dh = dh * (pre[act] > 0)
        grads[f"{act}.input_grad"] = grads[f"layers.{i - 1}.output_grad"] = dh
    return values, grads


def _run(config: dict, steps: int = 2, micro: int = 2, net=None):
    """Train Net with the monitor; per step the test's copies and the api dictionaries of actv/actv_grad."""
    net = net or Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"xy_distribution": True, "format": "api", **config})
    mon.set_monitor(net, grad_acc_steps=micro, optimizer=optimizer)

    class Recorder(list):
        def append(self, record):  # called right after each optimizer call
            latest = mon._core.latest
            record["actv"], record["actv_grad"] = latest.latest("actv"), latest.latest("actv_grad")
            super().append(record)

    capture = Recorder()
    batches = make_batches(steps, micro)
    train(net, optimizer, batches, capture)
    mon.stop()
    return [p.name for p in optimizer.parameters], batches, list(capture)


@pytest.mark.parametrize("hold_max", [None, 200], ids=["batched", "described-early"])
def test_every_activation_row_matches_numpy(hold_max, monkeypatch):
    if hold_max is not None:  # held tensors above the bound are described at once: same rows, same values
        monkeypatch.setattr(activations, "HOLD_MAX", hold_max)
    names, batches, steps = _run({"all_xy": True, "ops": ALL_OPS})
    for step, (record, step_batches) in enumerate(zip(steps, batches)):
        weights = {name: w.astype(np.float64) for name, w in zip(names, record["param_origin"])}
        want_actv, want_grads = set(), set()
        for micro, x in enumerate(step_batches):
            values, grads = _forward_backward(weights, x)
            for key, array in values.items():
                tag = f"0:{key}:{micro}/rank0/actv"
                want_actv.add(tag)
                assert_stats_close(record["actv"][tag], array, what=f"step {step} {tag}")
            for key, array in grads.items():
                tag = f"0:{key}:{micro}/rank0/actv_grad"
                want_grads.add(tag)
                assert_stats_close(record["actv_grad"][tag], array, what=f"step {step} {tag}")
        # the CellList container never runs; the network input takes no gradient
        assert set(record["actv"]) == want_actv
        assert set(record["actv_grad"]) == want_grads


def test_a_tensor_held_for_two_rows_is_measured_once(monkeypatch):
    """A Cell's output that is the next Cell's input is one tensor: measured once, written twice
    (the values of both rows are checked against numpy above)."""
    from adapters.mindspore.stats import StatEngine

    measured = []
    original = StatEngine.matrix

    def matrix(self, tensors):
        assert len({id(t) for t in tensors}) == len(tensors), "a tensor measured twice in one call"
        measured.append(len(tensors))
        return original(self, tensors)

    monkeypatch.setattr(StatEngine, "matrix", matrix)
    _, _, steps = _run({"all_xy": True, "ops": ["norm"]}, steps=1, micro=1)
    written = len(steps[0]["actv"]) + len(steps[0]["actv_grad"])
    assert 0 < sum(measured) < written


def test_targets_name_cells_exactly_and_1_2_2_formats_are_accepted():
    targets = {"layers.1": {}, "norm": {"input": "tuple[1]:0", "output": "tensor"}, "layers.2.weight": {}}
    _, _, steps = _run({"targets": targets, "ops": ["norm"]}, steps=1, micro=1)
    heads = {tag.split(":0/")[0] for tag in steps[0]["actv"]}
    assert heads == {"0:layers.1.input", "0:layers.1.output", "0:norm.input", "0:norm.output"}
    assert {tag.split(":0/")[0] for tag in steps[0]["actv_grad"]} == {
        "0:layers.1.input_grad",
        "0:layers.1.output_grad",
        "0:norm.input_grad",
        "0:norm.output_grad",
    }


@pytest.mark.parametrize(
    ("flag", "present", "absent"),
    [("forward_only", "actv", "actv_grad"), ("backward_only", "actv_grad", "actv")],
)
def test_forward_only_and_backward_only(flag, present, absent):
    _, _, steps = _run({"all_xy": True, flag: True, "ops": ["norm"]}, steps=1, micro=1)
    assert steps[0][present] and not steps[0][absent]


class Gated(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Dense(2, 2)
        self.sometimes = nn.Dense(2, 2)

    def construct(self, x, use: bool):
        x = self.always(x)
        return self.sometimes(x) if use else x


def test_a_cell_that_did_not_run_has_no_row_for_that_step():
    net = Gated()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    seen = []
    for use in (True, False):
        grad_fn = ms.value_and_grad(lambda x, u=use: net(x, u).sum(), None, optimizer.parameters)
        _, grads = grad_fn(ms.Tensor(np.ones((1, 2), np.float32)))
        optimizer(grads)
        seen.append({tag for tag in mon._core.latest.latest("actv") if "sometimes" in tag})
    mon.stop()
    assert seen[0] and not seen[1]


def test_eval_forwards_outside_gradients_are_not_recorded_and_set_train_is_not_needed():
    net = Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"xy_distribution": True, "ops": ["norm"], "format": "api", "targets": {"norm": {}}})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    x = ms.Tensor(make_batches(1, 1)[0][0])
    assert not net.training  # MindSpore's default: this loop never calls set_train()
    net(x)  # an evaluation forward: no gradient, eval mode
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    _, grads = grad_fn(x)
    net(x)
    optimizer(grads)
    tags = set(mon._core.latest.latest("actv"))
    mon.stop()
    assert tags == {"0:norm.input:0/rank0/actv", "0:norm.output:0/rank0/actv"}


def test_a_training_mode_forward_outside_gradients_is_no_micro_step():
    """Samples generated (or an evaluation forward) with the net still in training mode: no
    backward follows, so micro-steps 0 and 1 stay the two that train, with their own values."""
    net = Net()
    net.set_train(True)
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"xy_distribution": True, "ops": ["norm"], "format": "api", "targets": {"norm": {}}})
    mon.set_monitor(net, grad_acc_steps=2, optimizer=optimizer)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    batches = [ms.Tensor(b) for b in make_batches(1, 2)[0]]
    outputs = []
    for x in batches:
        net(ms.Tensor(np.full(x.shape, 100.0, np.float32)))  # a sample: no gradient follows
        outputs.append(np.linalg.norm(net(x).asnumpy().astype(np.float64)))
        _, grads = grad_fn(x)
    optimizer(grads)
    actv = mon._core.latest.latest("actv")
    mon.stop()
    assert set(actv) == {f"0:norm.{d}:{m}/rank0/actv" for d in ("input", "output") for m in (0, 1)}
    for micro, norm in enumerate(outputs):
        assert actv[f"0:norm.output:{micro}/rank0/actv"]["norm"] == pytest.approx(norm, rel=1e-5)


def test_stop_removes_every_cell_hook_and_training_is_unchanged():
    net = Net()
    optimizer = OPTIMIZERS["AdamWeightDecay"](net.trainable_params())
    plain = train(net, optimizer, make_batches(2, 2))
    plain_params = [p.asnumpy().copy() for p in optimizer.parameters]
    net = Net()
    optimizer = OPTIMIZERS["AdamWeightDecay"](net.trainable_params())
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "stack_info": True})
    mon.set_monitor(net, grad_acc_steps=2, optimizer=optimizer)
    assert train(net, optimizer, make_batches(2, 2)) == plain
    for before, after in zip(plain_params, optimizer.parameters):
        np.testing.assert_array_equal(before, after.asnumpy())
    mon.stop()
    for _, cell in net.cells_and_names():
        assert not cell._forward_pre_hook and not cell._forward_hook


@pytest.mark.parametrize("position", [0, None], ids=["input differentiated", "parameters only"])
def test_the_networks_input_gradient_is_recorded_when_the_input_is_differentiated(position):
    """``value_and_grad(fn, 0, weights)`` gives dL/dx too: its row is that gradient, as torch's
    with ``x.requires_grad``; without it the input takes no gradient and has no row."""
    net = Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    step = ms.value_and_grad(lambda x: net(x).square().mean(), position, optimizer.parameters)
    x = ms.Tensor(make_batches(1, 1)[0][0])
    _, grads = step(x)
    optimizer(grads[1] if position == 0 else grads)
    recorded = {tag.split("/")[0]: row["norm"] for tag, row in mon._core.latest.latest("actv_grad").items()}
    mon.stop()
    inputs = {name: norm for name, norm in recorded.items() if name.startswith("0:.input_grad")}
    if position is None:
        assert inputs == {}
    else:
        (norm,) = inputs.values()
        assert norm == pytest.approx(float(np.linalg.norm(grads[0].asnumpy().astype(np.float64))), rel=1e-5)


def test_one_gradient_hook_per_tensor_names_every_row_that_watches_it(monkeypatch):
    """Net is a chain: each Cell's output is the next one's input. Its six intermediate tensors
    (three Dense outputs, two ReLU outputs, the LayerNorm's, which is the root's) fill twelve
    gradient rows through six hooks (each registration costs most of a millisecond); a seventh
    waits on the input, which this training does not differentiate (no row)."""
    registered = []
    original = ms.Tensor.register_hook

    def counting(tensor, hook):
        registered.append(id(tensor))
        return original(tensor, hook)

    monkeypatch.setattr(ms.Tensor, "register_hook", counting)
    _, _, steps = _run({"all_xy": True, "forward_only": False, "ops": ["norm"]}, steps=1, micro=1)
    (record,) = steps
    assert len(record["actv_grad"]) == 12 and len(registered) == len(set(registered)) == 7


class _SkipBias(nn.Cell):
    """Returns its bias Parameter for the caller to add (a Parameter as a Cell's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Dense(4, 4, has_bias=False)
        self.bias = ms.Parameter(ms.Tensor(np.linspace(-0.2, 0.3, 4).astype(np.float32)))

    def construct(self, x):
        return self.lin(x), self.bias


class _LeafNet(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.a = _SkipBias()

    def construct(self, x):
        out, bias = self.a(x)
        return ((out + bias) ** 2).mean()


def test_a_parameter_a_cell_returns_gets_each_micro_batchs_gradient_once():
    """A hook on a Parameter outlives the backward pass: registered per micro-step, it measured
    later micro-batches' gradients under earlier rows again, step after step."""
    net = _LeafNet()
    optimizer = nn.SGD(net.trainable_params(), 0.1)
    mon = TrainerMon({"xy_distribution": True, "ops": ALL_OPS, "format": "api"})
    mon.set_monitor(net, 2, optimizer)
    grad_fn = ms.value_and_grad(net, None, optimizer.parameters)
    position = [p.name for p in optimizer.parameters].index("a.bias")
    rng = np.random.default_rng(0)
    for _ in range(3):
        total, expected = None, []
        for _ in range(2):
            _, grads = grad_fn(ms.Tensor(rng.normal(size=(3, 4)).astype(np.float32)))
            expected.append(grads[position].asnumpy().copy())  # MindSpore's own gradient
            total = grads if total is None else tuple(a + g for a, g in zip(total, grads))
        optimizer(total)
        rows = mon._core.latest.latest("actv_grad")
        for micro, bias_grad in enumerate(expected):
            assert_stats_close(rows[f"0:a.output_grad_1:{micro}/rank0/actv_grad"], bias_grad)
        assert len([t for t in rows if "a.output_grad_1" in t]) == 2, sorted(rows)
    mon.stop()
