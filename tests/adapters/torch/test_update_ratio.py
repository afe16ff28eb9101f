"""ur_distribution: Adam update and m/sqrt(v) histograms in TensorBoard, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP, make_batches, read_histograms, update_histogram_reference


def _expected(optimizer, param):
    state = optimizer.state[param]
    group = optimizer.param_groups[0]
    return update_histogram_reference(
        state["exp_avg"].numpy(),
        state["exp_avg_sq"].numpy(),
        float(state["step"]),
        group["betas"],
        group["eps"],
        group.get("bias_correction", True),
    )


@pytest.mark.parametrize("copy", ["host", "deferred", "uncorrected"])
def test_update_histograms_equal_numpy_on_the_optimizer_state(copy, monkeypatch):
    """The histograms in TensorBoard against numpy's, also with the counts' copy completed later
    on the writer thread, as on an accelerator, and for a param group with ``bias_correction``
    off (as DeepSpeed's and apex's Adams keep it; torch's AdamW ignores the key)."""
    if copy == "deferred":
        import adapters.torch.update_ratio as update_ratio

        monkeypatch.setattr(update_ratio, "to_host", lambda matrix: (None, matrix.numpy))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    if copy == "uncorrected":
        optimizer.param_groups[0]["bias_correction"] = False
    mon = TrainerMon({"ur_distribution": True, "format": "tensorboard"})
    mon.set_monitor(model, 1, optimizer)
    expected = {}
    for step, (x,) in enumerate(make_batches(3, 1)):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, param in model.named_parameters():
            for kind, counts_and_nans in _expected(optimizer, param).items():
                expected[(f"0:{name}/rank0/{kind}", step)] = counts_and_nans
    mon.stop()
    found = read_histograms(mon.output_dir)
    assert len({tag for tag, _ in found}) == 2 * len(list(model.parameters()))
    assert any(nans for _, nans in expected.values())  # 0/0 where a gradient was exactly zero
    for key, (counts, nan_count) in expected.items():
        assert np.array_equal(found[key][0], counts), key
        assert found[key][1] == nan_count, key


def test_ur_distribution_needs_tensorboard_and_says_so():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon({"ur_distribution": True, "format": "csv"})
    mon.set_monitor(model, 1, optimizer)
    assert not mon._session.collection.update_ratio
    mon.stop()
