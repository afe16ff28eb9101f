"""Every statistic of every data type equals numpy's on a copy made by the test (one process)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import mindspore as ms
import numpy as np

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import MOMENTS, OPTIMIZERS, Net, make_batches, train
from tests.reference_stats import (
    ALL_OPS,
    assert_mg_direction_row,
    assert_plain_floats,
    assert_stats_close,
    sign_agreement,
)
from tests.shared_configs import DATA_TYPES

STEPS = 3


def _config(**extra):
    return {**DATA_TYPES["all"], "ops": [*ALL_OPS, "id"], "format": "api", **extra}


def _run(kind: str, grad_acc: int, batches=None, **config):
    """Train with the monitor (on ``batches``, default STEPS steps of ``grad_acc`` micro-batches);
    per step, the test's copies and what the monitor reported."""
    net = Net()
    optimizer = OPTIMIZERS[kind](net.trainable_params())
    mon = TrainerMon(_config(**config))
    mon.set_monitor(net, grad_acc_steps=grad_acc, optimizer=optimizer)
    names = [p.name for p in optimizer.parameters]
    results = []

    class Recorder(list):
        def append(self, record):  # called right after each optimizer call
            reduced, unreduced = mon.generate_wgrad_metrics()
            record["reported"] = {
                "reduced": reduced,
                "unreduced": unreduced,
                "mv": mon.generate_mv_metrics(),
                "params": mon.generate_param_metrics(),
                "other": mon._core.latest.latest("other"),
            }
            super().append(record)

    capture = Recorder()
    train(net, optimizer, batches or make_batches(STEPS, grad_acc), capture, MOMENTS[kind])
    results.extend(capture)
    mon.stop()
    return names, results


@pytest.mark.parametrize("grad_acc", [1, 2])
@pytest.mark.parametrize("kind", ["Adam", "AdamWeightDecay"])
def test_every_statistic_matches_numpy(kind, grad_acc):
    names, results = _run(kind, grad_acc)
    assert names[0] == "layers.0.weight" and names[-1] == "norm.beta"
    for step, record in enumerate(results):
        got = record["reported"]
        assert len(got["unreduced"]) == len(got["reduced"]) == len(names)
        for j, name in enumerate(names):
            head, what = f"0:{name}/rank0", f"{kind} step {step} {name}"
            local = np.sum([micro[j].astype(np.float64) for micro in record["micro"]], axis=0)
            assert_stats_close(got["unreduced"][f"{head}/acc_grad"], local, what=f"{what} unreduced")
            assert_stats_close(
                got["reduced"][f"{head}/post_grad"], record["grads"][j], what=f"{what} reduced"
            )
            for key in ("param_origin", "param_updated"):
                assert_stats_close(got["params"][f"{head}/{key}"], record[key][j], what=f"{what} {key}")
            for key in ("exp_avg", "exp_avg_sq"):
                assert_stats_close(got["mv"][f"{head}/{key}"], record[key][j], what=f"{what} {key}")
            for prefix, key in (("reduced", "post_grad"), ("params", "param_origin"), ("mv", "exp_avg")):
                row = got[prefix][f"{head}/{key}"]
                expected = record[key if key != "post_grad" else "grads"][j]
                assert np.isnan(row["id"]) if expected.size > 1 else row["id"] == expected.item()


@pytest.mark.parametrize("kind", ["Adam", "AdamWeightDecay"])
def test_mg_direction_matches_sign_agreement_with_previous_moment(kind):
    names, results = _run(kind, 1, ops=["min", "max", "norm", "mean"])
    changed = False
    for step, record in enumerate(results):
        for j, name in enumerate(names):
            if step == 0:
                expected = 1.0  # no update yet: no history to agree with
            else:
                expected = sign_agreement(record["grads"][j], record["exp_avg_before"][j])
                changed |= expected != 1.0
            row = record["reported"]["other"][f"0:{name}/rank0/mg_direction"]
            assert_mg_direction_row(row, expected, what=f"step {step} {name}")
    assert changed


def test_lamb_moments_are_mapped_by_position_and_checked_by_name():
    """nn.Lamb cannot step on CPU (its kernel is Ascend/GPU only), so the mapping itself is checked."""
    net = Net()
    optimizer = OPTIMIZERS["Lamb"](net.trainable_params())
    mon = TrainerMon(_config())
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    view = mon._session.view
    for j, param in enumerate(optimizer.parameters):
        assert view.moment(param, "exp_avg") is optimizer.moments1[j]
        assert view.moment(param, "exp_avg_sq") is optimizer.moments2[j]
    mon.stop()


def test_misaligned_moments_are_refused_not_guessed(caplog):
    net = Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    optimizer.moment1 = ms.ParameterTuple(tuple(reversed(optimizer.moment1)))
    mon = TrainerMon(_config())
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)  # (Adam itself could not step now)
    assert mon._session.view.moments == {}
    assert "moment1 entry 'moment1.norm.beta' does not belong to parameter 'layers.0.weight'" in caplog.text
    mon.stop()


@pytest.mark.parametrize(
    "grad_acc, counts, said", [(2, [2, 1, 3, 2], "step 1 had 1"), (1, [1, 3, 1], "step 1 had 3")]
)
def test_steps_with_fewer_or_more_micro_batches_are_counted_not_assumed(trainmon_log, grad_acc, counts, said):
    """grad_acc_steps 2, steps of 2, 1, 3 and 2 micro-batches (a short last step of an epoch, or
    one more); or grad_acc_steps left at 1 while a step accumulates 3: each step's row describes
    the sum of the micro-batches it really had, as the message says."""
    batches = [step[:n] for step, n in zip(make_batches(len(counts), max(counts)), counts)]
    names, results = _run("Adam", grad_acc, batches, mv_distribution=False, mg_direction=False)
    assert [len(record["micro"]) for record in results] == counts
    for step, record in enumerate(results):
        unreduced = record["reported"]["unreduced"]
        assert len(unreduced) == len(names)
        for j, name in enumerate(names):
            local = np.sum([micro[j].astype(np.float64) for micro in record["micro"]], axis=0)
            assert_stats_close(unreduced[f"0:{name}/rank0/acc_grad"], local, what=f"step {step} {name}")
    messages = [r.getMessage() for r in trainmon_log.records if "micro-batch" in r.getMessage()]
    assert len(messages) == 1 and f"{said} micro-batch(es)" in messages[0], messages


def test_per_micro_batch_gradients_match_each_micro_batch():
    names, results = _run("Adam", 2, monitor_mbs_grad=True, mv_distribution=False, mg_direction=False)
    for record in results:
        unreduced = record["reported"]["unreduced"]
        assert len(unreduced) == 2 * len(names)
        for micro, grads in enumerate(record["micro"]):
            for j, name in enumerate(names):
                got = unreduced[f"0:{name}:{micro}/rank0/acc_grad"]
                assert_stats_close(got, grads[j], what=f"{name} micro {micro}")


def test_metrics_are_plain_floats():
    _, results = _run("Adam", 1)
    for metrics in results[-1]["reported"].values():
        assert_plain_floats(metrics)


def _halved_in_place(grads):  # written into the same memory: nothing else shows the change
    for grad in grads:
        grad.copy_(grad * 0.5)
    return grads


def _clipped(grads):
    return ms.ops.clip_by_global_norm(grads, 1e-3)


@pytest.mark.parametrize("change", [None, _halved_in_place, _clipped], ids=["as-is", "halved", "clipped"])
def test_reduced_gradients_reuse_the_backward_rows_only_while_unchanged(change, monkeypatch):
    """grad_reduced reuses the rows measured at the backward pass when the optimizer gets that
    very memory (one tensor measured again to check); gradients halved in place or clipped into
    new tensors are measured anew. Every row equals numpy's on the test's copies."""
    from adapters.mindspore.stats import StatEngine

    measured: list[int] = []
    original = StatEngine.matrix
    monkeypatch.setattr(
        StatEngine, "matrix", lambda self, tensors: measured.append(len(tensors)) or original(self, tensors)
    )
    net = Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"wg_distribution": True, "ops": ALL_OPS, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)
    n = len(optimizer.parameters)
    for (x,) in make_batches(STEPS, 1):
        _, grads = grad_fn(ms.Tensor(x))
        raw = [g.asnumpy().copy() for g in grads]
        used = change(grads) if change is not None else grads
        handed = [g.asnumpy().copy() for g in used]
        measured.clear()
        optimizer(used)
        reduced, unreduced = mon.generate_wgrad_metrics()
        for j, p in enumerate(optimizer.parameters):
            head = f"0:{p.name}/rank0"
            assert_stats_close(unreduced[f"{head}/acc_grad"], raw[j], what=f"{p.name} unreduced")
            assert_stats_close(reduced[f"{head}/post_grad"], handed[j], what=f"{p.name} reduced")
        expected = {None: [1], _halved_in_place: [1, n], _clipped: [n]}[change]
        assert measured == expected, measured  # at the optimizer's call: a probe, or every tensor
    mon.stop()
