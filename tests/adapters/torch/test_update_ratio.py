"""ur_distribution: Adam update and m/sqrt(v) histograms in TensorBoard, checked against numpy."""

from __future__ import annotations

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, SCALARS, EventAccumulator

from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP, make_batches


def _expected(optimizer, param):
    state = optimizer.state[param]
    (beta1, beta2), eps = optimizer.param_groups[0]["betas"], optimizer.param_groups[0]["eps"]
    step = float(state["step"])
    m_hat = state["exp_avg"].numpy().astype(np.float64) / (1 - beta1**step)
    root_v = np.sqrt(state["exp_avg_sq"].numpy().astype(np.float64) / (1 - beta2**step))
    edges = np.linspace(-1, 1, 31)
    with np.errstate(invalid="ignore", divide="ignore"):
        kinds = {"adam_update": m_hat / (root_v + eps), "adam_ratio": m_hat / root_v}
    return {kind: (np.histogram(np.clip(v, -1, 1), edges)[0], np.isnan(v).sum()) for kind, v in kinds.items()}


def test_update_histograms_equal_numpy_on_the_optimizer_state():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
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
    events = EventAccumulator(mon.output_dir, size_guidance={HISTOGRAMS: 0, SCALARS: 0})
    events.Reload()
    assert len(events.Tags()["histograms"]) == 2 * len(list(model.parameters()))
    assert any(nans for _, nans in expected.values())  # 0/0 where a gradient was exactly zero
    for (tag, step), (counts, nan_count) in expected.items():
        (event,) = [e for e in events.Histograms(tag) if e.step == step]
        assert np.array_equal(np.asarray(event.histogram_value.bucket), counts)
        (nans,) = [e for e in events.Scalars(f"{tag}_nans") if e.step == step]
        assert nans.value == nan_count


def test_ur_distribution_needs_tensorboard_and_says_so():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon({"ur_distribution": True, "format": "csv"})
    mon.set_monitor(model, 1, optimizer)
    assert not mon._session.collection.update_ratio
    mon.stop()
