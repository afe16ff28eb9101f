"""ur_distribution on MindSpore: Adam's update and m/sqrt(v) histograms in TensorBoard, checked
against numpy on the optimizer's own moments (copied by the test after each update), corrected for
bias as each optimizer corrects them: Adam does, AdamWeightDecay applies m / (sqrt(v) + eps) as is."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore", reason="MindSpore is not installed here (pip install -e '.[mindspore]')")

import numpy as np

from monitor import TrainerMon
from tests.adapters.mindspore.helpers import MOMENTS, OPTIMIZERS, Net, make_batches, train
from tests.reference_stats import read_histograms, update_histogram_reference

STEPS = 3


@pytest.mark.parametrize("kind", ["Adam", "AdamWeightDecay"])
def test_update_histograms_equal_numpy_on_the_optimizers_moments(kind):
    net = Net()
    optimizer = OPTIMIZERS[kind](net.trainable_params())
    mon = TrainerMon({"ur_distribution": True, "format": "tensorboard"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    capture: list[dict] = []
    train(net, optimizer, make_batches(STEPS, 1), capture, MOMENTS[kind])
    mon.stop()
    betas = (optimizer.beta1.asnumpy().item(), optimizer.beta2.asnumpy().item())
    eps = optimizer.eps.asnumpy().item()
    names = [p.name for p in optimizer.parameters]
    found = read_histograms(mon.output_dir)
    assert len({tag for tag, _ in found}) == 2 * len(names)
    for step, record in enumerate(capture):
        for j, name in enumerate(names):
            expected = update_histogram_reference(
                record["exp_avg"][j], record["exp_avg_sq"][j], step + 1, betas, eps, kind == "Adam"
            )
            for kind_name, (counts, nans) in expected.items():
                got_counts, got_nans = found[(f"0:{name}/rank0/{kind_name}", step)]
                assert np.array_equal(got_counts, counts), (step, name, kind_name)
                assert got_nans == nans, (step, name, kind_name)


def test_ur_distribution_needs_tensorboard_and_says_so(trainmon_log):
    net = Net()
    optimizer = OPTIMIZERS["Adam"](net.trainable_params())
    mon = TrainerMon({"ur_distribution": True, "format": "csv"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
    assert any("ur_distribution writes TensorBoard histograms" in w for w in trainmon_log.warnings())
    mon.stop()


def test_adam_weight_decay_moves_its_parameters_by_its_uncorrected_moments():
    """What the histograms above assume of AdamWeightDecay, read off its own update: without
    weight decay a parameter moves by lr * m / (sqrt(v) + eps) exactly, not by the bias-corrected
    form that Adam uses (about a third of it at the first step)."""
    from mindspore import nn

    net = Net()
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=0.05, weight_decay=0.0)
    capture: list[dict] = []
    train(net, optimizer, make_batches(2, 1), capture, MOMENTS["AdamWeightDecay"])
    eps = optimizer.eps.asnumpy().item()
    for record in capture:
        for before, after, m, v in zip(
            record["param_origin"], record["param_updated"], record["exp_avg"], record["exp_avg_sq"]
        ):
            moved = (before.astype(np.float64) - after) / 0.05
            np.testing.assert_allclose(moved, m / (np.sqrt(v.astype(np.float64)) + eps), rtol=1e-3, atol=1e-6)
