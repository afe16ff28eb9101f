"""A loss scaler that skips updates (fp16 overflow): the monitor's steps keep the loop's numbers,
what the step measured is written, and an overflow the scaler handles is no incident, while a
real fault in the same run still is one.

torch's GradScaler skips an update in one of two ways: it does not call ``optimizer.step`` at all
(the optimizer's hooks, which mark a step's end, never run: the loop says so with
``update_skipped``), or, for an optimizer that skips it itself (fused AdamW), it calls the step
with its verdict attached. A loss scale far too large for fp16 makes the first steps overflow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP, assert_stats_close, make_batches
from tests.integrations.reads import CONFIG, written_rows

STEPS, BAD_BATCH = 14, 11


def _train(tmp_path, monkeypatch, fused: bool, bad_batch: int | None = None):
    """Train with fp16 autocast and a loss scaler; the loop tells the monitor of each skipped
    update unless the optimizer skips it itself. Returns the monitor, the test's own copy of each
    step's gradients (the scaled ones backward leaves) and the skipped steps."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    config = {**CONFIG, "xy_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyZScore"}]}}
    mon = TrainerMon(config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    grads, skipped = {}, []
    for step, (x,) in enumerate(make_batches(STEPS, 1)):
        if step == bad_batch:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        grads[step] = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < scale:  # the scaler found Inf/NaN: no update
            skipped.append(step)
            if not fused:
                mon.update_skipped()
        optimizer.zero_grad()
    mon.stop()
    return mon, grads, skipped


@pytest.mark.parametrize("fused", [False, True], ids=["not-called", "fused-skips-itself"])
def test_skipped_updates_keep_the_loops_step_numbers_and_raise_no_incident(tmp_path, monkeypatch, fused):
    mon, grads, skipped = _train(tmp_path, monkeypatch, fused)
    assert 2 <= len(skipped) < STEPS - 4 and skipped == list(range(len(skipped)))
    assert mon.step == STEPS
    rows = written_rows(mon.output_dir)
    for step, named in grads.items():
        for name, grad in named.items():
            assert_stats_close(rows["grad_unreduced", name, step], grad, what=f"{name} step {step}")
    assert any(np.isinf(rows["grad_unreduced", name, skipped[0]]["max"]) for name in grads[0])
    updated = {step for kind, _, step in rows if kind in ("grad_reduced", "exp_avg", "param_updated")}
    # an optimizer that is called and skips the update itself is a step like any other
    assert updated == (set(range(STEPS)) if fused else set(range(STEPS)) - set(skipped))
    assert mon.incidents == []


@pytest.mark.parametrize("fused", [False, True], ids=["not-called", "fused-skips-itself"])
def test_a_bad_batch_is_still_an_incident_under_the_scaler(tmp_path, monkeypatch, fused):
    """A NaN in the input: the scaler skips that step's update too, but the forward pass's
    activations are not the scaler's business and name the fault at its step."""
    mon, _, skipped = _train(tmp_path, monkeypatch, fused, bad_batch=BAD_BATCH)
    assert BAD_BATCH in skipped and mon.step == STEPS
    assert [incident.onset_step for incident in mon.incidents] == [BAD_BATCH]
    assert (
        mon.incidents[0].root["tag_name"].endswith("/actv") and mon.incidents[0].root["rule"] == "NonFinite"
    )
