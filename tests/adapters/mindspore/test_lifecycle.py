"""Attaching, scheduling, stopping on MindSpore: the training is unchanged and the hooks go away."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import logging
import os

import numpy as np
from mindspore import nn

from adapters.mindspore.grads import UnreducedGrads
from monitor import TrainerMon
from tests.adapters.mindspore.helpers import OPTIMIZERS, Net, make_batches, train
from tests.reference_stats import ALL_OPS
from tests.shared_configs import DATA_TYPES
from tests.shared_outputs import collected_steps, window_starts


def _fresh(kind: str = "AdamWeightDecay", sizes=(6, 16, 12, 4)):
    net = Net(sizes)
    return net, OPTIMIZERS[kind](net.trainable_params())


@pytest.fixture
def hook_calls(monkeypatch):
    """Every call of a monitor parameter hook, recorded (to prove the hooks are really gone)."""
    calls: list[int] = []
    original = UnreducedGrads._hook

    def counting(self, index):
        hook = original(self, index)

        def wrapper(grad):
            calls.append(index)
            return hook(grad)

        return wrapper

    monkeypatch.setattr(UnreducedGrads, "_hook", counting)
    return calls


def _optimizer_hooks(optimizer) -> int:
    return len(optimizer._forward_pre_hook) + len(optimizer._forward_hook)


@pytest.mark.parametrize("kind", sorted(DATA_TYPES))
def test_training_is_bit_identical_with_the_monitor(kind):
    net, optimizer = _fresh()
    plain_losses = train(net, optimizer, make_batches(4, 2))
    plain = [p.asnumpy().copy() for p in optimizer.parameters]

    net, optimizer = _fresh()
    mon = TrainerMon({**DATA_TYPES[kind], "ops": [*ALL_OPS, "id"], "format": "csv"})
    mon.set_monitor(net, grad_acc_steps=2, optimizer=optimizer)
    monitored_losses = train(net, optimizer, make_batches(4, 2))
    mon.stop()
    assert monitored_losses == plain_losses
    for before, after in zip(plain, optimizer.parameters):
        np.testing.assert_array_equal(before, after.asnumpy())


def test_stop_removes_every_hook(hook_calls):
    net, optimizer = _fresh()
    mon = TrainerMon(DATA_TYPES["all"])
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    assert _optimizer_hooks(optimizer) == 2
    train(net, optimizer, make_batches(2, 1))
    assert len(hook_calls) == 2 * len(optimizer.parameters)
    mon.stop()
    assert _optimizer_hooks(optimizer) == 0
    train(net, optimizer, make_batches(2, 1))
    assert len(hook_calls) == 2 * len(optimizer.parameters)
    mon.stop()  # idempotent
    assert not mon.monitoring


def test_collect_times_removes_the_parameter_hooks_and_training_goes_on(hook_calls):
    net, optimizer = _fresh()
    mon = TrainerMon({**DATA_TYPES["all"], "collect_times": 3})
    mon.set_monitor(net, grad_acc_steps=2, optimizer=optimizer)
    train(net, optimizer, make_batches(6, 2))
    assert not mon.monitoring
    assert len(hook_calls) == 3 * 2 * len(optimizer.parameters)
    files = sorted(os.listdir(mon.output_dir))
    assert "grad_reduced_2-2.csv" in files and "grad_reduced_3-3.csv" not in files
    # MindSpore iterates a Cell's hook dict during the call: the two optimizer hooks stay, inert,
    # until stop() removes them.
    assert _optimizer_hooks(optimizer) == 2
    mon.stop()
    assert _optimizer_hooks(optimizer) == 0


def test_schedule_start_step_interval_and_collect_times():
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "start_step": 2, "step_interval": 3, "collect_times": 2})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(9, 1))
    mon.stop()
    assert window_starts(mon.output_dir) == [2, 5]


def test_start_iteration_offsets_the_step_counter():
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "start_step": 100})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer, start_iteration=99)
    train(net, optimizer, make_batches(3, 1))
    mon.stop()
    assert collected_steps(mon.output_dir, prefix="") == [100, 101]
    assert mon.step == 102


def test_targets_select_on_name_boundaries():
    net, optimizer = _fresh("Adam", sizes=(6,) * 12 + (4,))  # layers.0 .. layers.10
    mon = TrainerMon(
        {"targets": {"layers.1": {}}, "wg_distribution": True, "mv_distribution": True, "format": "api"}
    )
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(1, 1))
    reduced, unreduced = mon.generate_wgrad_metrics()
    want = {"0:layers.1.weight", "0:layers.1.bias"}
    assert {tag.split("/")[0] for tag in reduced} == want
    assert {tag.split("/")[0] for tag in unreduced} == want
    assert {tag.split("/")[0] for tag in mon.generate_mv_metrics()} == want
    mon.stop()


def test_a_targets_key_that_names_nothing_is_warned_about(caplog):
    net, optimizer = _fresh("Adam")
    targets = {"layers.1": {}, "layers.1.weigth": {}}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"targets": targets, "wg_distribution": True, "format": "api"})
        mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
        mon.stop()
    (told,) = [r.getMessage() for r in caplog.records if "targets key" in r.getMessage()]
    assert "'layers.1.weigth' selects no module or parameter" in told and "'layers.1.weight'?" in told


def test_an_optimizer_without_moments_is_said_for_moments_and_mg_direction(caplog):
    """Momentum keeps no Adam moments: no moment rows, and every mg_direction share is 1.0;
    both said at attach, so that a flat line of ones is not read as agreeing signs."""
    net = Net()
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"mv_distribution": True, "mg_direction": True, "format": "api"})
        mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
        mon.stop()
    told = [r.getMessage() for r in caplog.records if "keeps no Adam moments" in r.getMessage()]
    assert len(told) == 2, told
    assert "mv_distribution" in told[0] and "mg_direction" in told[1] and "every share is 1.0" in told[1]


def test_passes_with_no_step_of_the_monitored_optimizer_are_said_once_and_held_bounded(caplog):
    """The optimizer that steps is not the one given to set_monitor: a warning says so once, and
    the gradient statistics held for a step that never ends stay those of its latest pass."""
    import mindspore as ms

    from monitor.session.collection import UNENDED_PASSES

    net, monitored = _fresh("Adam")
    stepping = nn.Adam(net.trainable_params())
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, stepping.parameters)
    (x,) = make_batches(1, 1)[0]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"wg_distribution": True, "xy_distribution": True, "format": "api"})
        mon.set_monitor(net, grad_acc_steps=1, optimizer=monitored)
        for _ in range(UNENDED_PASSES + 10):
            _, grads = grad_fn(ms.Tensor(x))
            stepping(grads)
        held = len(mon._session.collection.grads._blocks)
        activations = mon._session.collection.activations._held.values()
        held_activations = sum(len(rows) for held in activations for rows, _, _ in held.blocks)
        mon.stop()
    told = [r.getMessage() for r in caplog.records if "no step of the monitored optimizer" in r.getMessage()]
    assert len(told) == 1 and f"{UNENDED_PASSES} backward passes" in told[0], told
    assert held == 1
    assert held_activations <= 4 * len(list(net.cells_and_names()))  # one pass's rows at most


@pytest.mark.parametrize("ranks", [[1], ["1"]])
def test_a_rank_outside_module_ranks_attaches_nothing(ranks, hook_calls):
    net, optimizer = _fresh()
    mon = TrainerMon({**DATA_TYPES["all"], "module_ranks": ranks})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(1, 1))
    assert mon.output_dir is None and not mon.monitoring and not hook_calls
    assert _optimizer_hooks(optimizer) == 0
    mon.stop()


def test_module_ranks_as_strings_select_this_rank():
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "module_ranks": ["0"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(1, 1))
    assert mon.generate_wgrad_metrics()[0]
    mon.stop()


def test_a_wrapper_with_optimizer_attribute_is_unwrapped():
    net, optimizer = _fresh()
    wrapper = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optimizer)
    mon = TrainerMon({"param_distribution": True, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=wrapper)
    train(net, optimizer, make_batches(1, 1))
    assert mon.generate_param_metrics()
    mon.stop()


def test_bad_arguments_are_refused_at_the_door():
    net, optimizer = _fresh()
    with pytest.raises(TypeError, match=r"set_monitor: model\[1\]: expected a mindspore.nn.Cell, got int"):
        TrainerMon({}).set_monitor([net, 3], grad_acc_steps=1, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"optimizer: expected a mindspore.nn.Optimizer .* got Net"):
        TrainerMon({}).set_monitor(net, grad_acc_steps=1, optimizer=net)
    with pytest.raises(ValueError, match="optimizer: required"):
        TrainerMon({}).set_monitor(net, grad_acc_steps=1)


def test_a_failing_part_is_logged_once_and_the_rest_goes_on(monkeypatch, caplog):
    from adapters.mindspore import collection

    def broken(self, key):
        def moment(i):
            raise RuntimeError(f"{key} read failed")

        return moment

    net, optimizer = _fresh()
    plain = train(net, optimizer, make_batches(3, 1))
    net, optimizer = _fresh()
    monkeypatch.setattr(collection.Collection, "_moment_of", broken)
    mon = TrainerMon({**DATA_TYPES["all"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        assert train(net, optimizer, make_batches(3, 1)) == plain
    failures = sorted(r.getMessage().split()[1] for r in caplog.records if "switched off" in r.getMessage())
    assert failures == ["exp_avg", "exp_avg_sq"]
    assert mon.generate_wgrad_metrics()[0] and mon.generate_param_metrics()
    assert not mon.generate_mv_metrics()
    mon.stop()


def test_a_tensor_that_fails_the_shared_measurement_switches_off_only_its_data_type(monkeypatch, caplog):
    """Moments and parameters after the update are measured in one call; when that call fails,
    each data type is measured on its own, so only the one holding the bad tensor is lost."""
    from adapters.mindspore import collection

    moment_of = collection.Collection._moment_of

    def exp_avg_unreadable(self, key):
        return (lambda i: object()) if key == "exp_avg" else moment_of(self, key)

    net, optimizer = _fresh()
    monkeypatch.setattr(collection.Collection, "_moment_of", exp_avg_unreadable)
    mon = TrainerMon({**DATA_TYPES["all"], "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    with caplog.at_level(logging.ERROR, logger="trainmon"):
        train(net, optimizer, make_batches(2, 1))
    failures = [r.getMessage().split()[1] for r in caplog.records if "switched off" in r.getMessage()]
    assert failures == ["exp_avg"]
    tasks = {tag.rsplit("/", 1)[1] for tag in {**mon.generate_mv_metrics(), **mon.generate_param_metrics()}}
    assert tasks == {"exp_avg_sq", "param_origin", "param_updated"}
    mon.stop()


def test_the_data_types_read_at_one_point_of_the_step_are_measured_in_one_call(monkeypatch):
    """Parameters before the update in one call; both moments and the parameters after it in one
    more: one wait for MindSpore's queue and one host copy at each point, not one per data type."""
    from adapters.mindspore.stats import StatEngine

    calls = []
    matrix = StatEngine.matrix

    def counted(self, tensors):
        calls.append(len(tensors))
        return matrix(self, tensors)

    net, optimizer = _fresh()
    monkeypatch.setattr(StatEngine, "matrix", counted)
    mon = TrainerMon({"mv_distribution": True, "param_distribution": True, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(1, 1))
    mon.stop()
    parameters = len(net.trainable_params())
    assert calls == [parameters, 3 * parameters]


def test_a_restarted_collection_continues_in_the_same_directory(hook_calls):
    """The session's start()/stop() (what live control drives) work on MindSpore too."""
    net, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    train(net, optimizer, make_batches(2, 1))
    first_dir = mon.output_dir
    session = mon._session
    session.stop()
    assert _optimizer_hooks(optimizer) == 0
    session.start()
    train(net, optimizer, make_batches(1, 1))
    session.stop()
    assert mon.output_dir == first_dir and _optimizer_hooks(optimizer) == 0
    assert window_starts(first_dir) == [0, 1, 2]
    assert len(hook_calls) == 3 * len(optimizer.parameters)


def test_a_list_of_cells_gives_chunk_prefixed_names():
    first, second = Net(seed=0), Net(sizes=(4, 6, 4), seed=1)

    class Both(nn.Cell):
        def __init__(self):
            super().__init__()
            self.first, self.second = first, second

        def construct(self, x):
            return self.second(self.first(x))

    both = Both()
    optimizer = OPTIMIZERS["Adam"](both.trainable_params())
    mon = TrainerMon({"wg_distribution": True, "mv_distribution": True, "format": "api"})
    mon.set_monitor([first, second], grad_acc_steps=1, optimizer=optimizer)
    train(both, optimizer, make_batches(1, 1))
    reduced, _ = mon.generate_wgrad_metrics()
    heads = {tag.split("/")[0] for tag in reduced}
    assert {"0:layers.2.weight", "0:norm.gamma", "1:layers.1.weight", "1:norm.beta"} <= heads
    assert len(heads) == len(optimizer.parameters) == 14
    assert {tag.split("/")[0] for tag in mon.generate_mv_metrics()} == heads
    mon.stop()


def test_a_step_whose_update_was_skipped_keeps_its_number_and_its_overflow_is_not_judged(
    tmp_path, monkeypatch
):
    """A loop whose loss scaler found Inf/NaN skips the optimizer's call and says
    ``update_skipped()``: the step keeps the loop's number, its unreduced gradients are written as
    computed (the Inf/NaN included), nothing of the update is, and the overflow is no incident."""
    import mindspore as ms

    from tests.adapters.mindspore.helpers import copies
    from tests.integrations.reads import written_rows
    from tests.reference_stats import assert_stats_close

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    skipped = (1, 2)
    net, optimizer = _fresh("Adam")
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "ops": ALL_OPS,
        "ndigits": 15,
        "squash_name": False,
        "alert": {"rules": [{"rule_name": "AnomalyZScore"}]},
    }
    mon = TrainerMon(config)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    grads = {}
    for step, (x,) in enumerate(make_batches(6, 1)):
        _, step_grads = grad_fn(ms.Tensor(x * (np.float32(np.inf) if step in skipped else 1)))
        grads[step] = dict(zip([p.name for p in optimizer.parameters], copies(step_grads)))
        if step in skipped:
            mon.update_skipped()
        else:
            optimizer(step_grads)
    mon.stop()
    assert mon.step == 6 and mon.incidents == []
    rows = written_rows(mon.output_dir)
    for step, named in grads.items():
        for name, grad in named.items():
            assert_stats_close(rows["grad_unreduced", name, step], grad, what=f"{name} step {step}")
    assert not np.isfinite(rows["grad_unreduced", "layers.0.weight", 1]["norm"])
    updated = {step for kind, _, step in rows if kind in ("grad_reduced", "exp_avg")}
    assert updated == {0, 3, 4, 5}


_FAILING_BACKWARD = """
import os, sys
import numpy as np, mindspore as ms
from mindspore import nn, Parameter, Tensor
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
class Scale(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones(8, np.float32)).astype(ms.bfloat16), name="w")
    def construct(self, x):
        return x * self.w  # its backward sums a broadcast bfloat16 gradient
net = Scale()
optimizer = nn.SGD(net.trainable_params(), 0.1)
if sys.argv[1] == "monitored":
    from monitor import TrainerMon
    TrainerMon({"wg_distribution": True}).set_monitor(net, 1, optimizer)
step = ms.value_and_grad(lambda x: (net(x).astype(ms.float32) ** 2).mean(), None, optimizer.parameters)
try:
    _, grads = step(Tensor(np.ones((4, 8), np.float32)).astype(ms.bfloat16))
    print("gradient", float(grads[0].astype(ms.float32).asnumpy()[0]))
except RuntimeError as exc:
    print("raised", str(exc).splitlines()[0])
"""


def test_an_error_of_the_training_that_a_read_of_ours_surfaces_reaches_the_training(tmp_path):
    """MindSpore runs kernels asynchronously: one of the training's that fails (here a bfloat16
    reduction with no CPU kernel) is said at the first read of its result, which may be the
    monitor's gradient hook. The training must see the error as it does without the monitor,
    not go on with a wrong gradient while the monitor logs the error as its own."""
    import subprocess
    import sys

    said = {}
    for how in ("plain", "monitored"):
        done = subprocess.run(
            [sys.executable, "-c", _FAILING_BACKWARD, how],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path)},
        )
        said[how] = done.stdout.strip().splitlines()[-1:] or [done.stderr[-500:]]
    if said["plain"][0].startswith("gradient"):
        pytest.skip("this MindSpore has the kernel, so its backward does not fail")
    assert said["plain"][0].startswith("raised"), said
    assert said["monitored"] == said["plain"], said


def test_integer_inputs_such_as_labels_are_recorded_but_never_judged():
    """A classifier fed its labels: a batch whose labels are all class 0 (every 10th and the last)
    has a labels row of norm 0 and zeros share 1, the ordinary data of a classification run, not
    a Cell that died; the clean run opens no incident."""
    import mindspore as ms
    from mindspore import ops

    class Classifier(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.body = Net()

        def construct(self, x, labels):
            return ops.cross_entropy(self.body(x), labels)

    model = Classifier()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=0.01)
    config = {
        "xy_distribution": True,
        "wg_distribution": True,
        "ops": [*ALL_OPS],
        "format": "api",
        "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyZScore"}]},
    }
    mon = TrainerMon(config).set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(model, None, optimizer.parameters)
    rng = np.random.default_rng(3)
    for step in range(40):
        x = rng.normal(size=(4, 6)).astype(np.float32)
        labels = np.zeros(4, np.int32) if step % 10 == 9 else rng.integers(0, 4, 4).astype(np.int32)
        _, grads = grad_fn(ms.Tensor(x), ms.Tensor(labels))
        optimizer(grads)
    rows = mon._latest("actv")
    mon.stop()
    (labels_row,) = [row for tag, row in rows.items() if tag.startswith("0:.input_1")]
    assert (labels_row["norm"], labels_row["zeros"]) == (0.0, 1.0)  # recorded as it was fed
    assert mon.incidents == [], [incident.root for incident in mon.incidents]


@pytest.mark.parametrize("by_keyword", [True, False])
def test_an_attention_mask_of_minus_inf_is_recorded_but_not_an_incident(by_keyword):
    """An additive causal mask holds 0 and -inf by design. A Cell that takes it (a ``construct``
    parameter named ``*mask*``, by keyword or by position) has a mask row with -inf at every
    collected step: recorded, not a NaN/Inf fault, so the clean run opens no incident, and a NaN
    put into the attention's output at step 30 is still one, there."""
    import mindspore as ms
    from mindspore import ops

    seq, width = 5, 8

    class Attention(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key = nn.Dense(width, width), nn.Dense(width, width)

        def construct(self, x, attention_mask):
            scores = ops.matmul(self.query(x), self.key(x).transpose(0, 2, 1)) + attention_mask
            return ops.matmul(ops.softmax(scores, -1), x)

    class Model(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()
            self.head = nn.Dense(width, 1)
            self.poison = ms.Tensor(1.0, ms.float32)

        def construct(self, x, mask):
            hidden = self.attention(x, attention_mask=mask) if by_keyword else self.attention(x, mask)
            return (self.head(hidden * self.poison) ** 2).mean()

    model = Model()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
    config = {
        "xy_distribution": True,
        "all_xy": True,
        "ops": [*ALL_OPS],
        "format": "api",
        "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyZScore"}]},
    }
    mon = TrainerMon(config).set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(model, None, optimizer.parameters)
    mask = ms.Tensor(np.triu(np.full((seq, seq), -np.inf, np.float32), 1))
    rng = np.random.default_rng(4)
    for step in range(40):
        model.poison = ms.Tensor(np.nan if step == 30 else 1.0, ms.float32)
        _, grads = grad_fn(ms.Tensor(rng.normal(size=(2, seq, width)).astype(np.float32)), mask)
        optimizer(grads)
    rows = mon._latest("actv")
    mon.stop()
    minima = [row["min"] for tag, row in rows.items() if tag.startswith("0:attention.input_1")]
    assert minima == [-np.inf], sorted(rows)
    roots = [incident.root["tag_name"] for incident in mon.incidents]
    assert [incident.onset_step for incident in mon.incidents] == [30], roots
