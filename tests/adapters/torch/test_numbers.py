"""Every statistic of every data type equals numpy's on a copy made by the test (one process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import ALL_OPS, MLP, assert_stats_close, make_batches
from tests.reference_stats import assert_mg_direction_row, assert_plain_floats, sign_agreement
from tests.shared_configs import DATA_TYPES

GRAD_ACC = 2
STEPS = 4


def _config(**extra):
    return {**DATA_TYPES["all"], "ops": ALL_OPS, "format": "api", **extra}


def _named(model):
    return {name: p for name, p in model.named_parameters()}


def _train_and_capture(mon: TrainerMon, model, optimizer, batches):
    """Train, and per step capture (by copy) what each data type must describe, plus what mon reports."""
    captured = []
    for step_batches in batches:
        for x in step_batches:
            model(x).pow(2).mean().backward()
        params = _named(model)
        expect = {
            "grad": {n: p.grad.detach().numpy().copy() for n, p in params.items()},
            "param_origin": {n: p.detach().numpy().copy() for n, p in params.items()},
            "exp_avg_before": {
                n: optimizer.state[p]["exp_avg"].numpy().copy() if p in optimizer.state else None
                for n, p in params.items()
            },
        }
        optimizer.step()
        expect["param_updated"] = {n: p.detach().numpy().copy() for n, p in params.items()}
        expect["exp_avg"] = {n: optimizer.state[p]["exp_avg"].numpy().copy() for n, p in params.items()}
        expect["exp_avg_sq"] = {n: optimizer.state[p]["exp_avg_sq"].numpy().copy() for n, p in params.items()}
        optimizer.zero_grad()
        reduced, unreduced = mon.generate_wgrad_metrics()
        captured.append((expect, reduced, unreduced, mon.generate_mv_metrics(), mon.generate_param_metrics()))
    return captured


def test_every_statistic_matches_numpy():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = TrainerMon(_config())
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    captured = _train_and_capture(mon, model, optimizer, make_batches(STEPS, GRAD_ACC))
    mon.stop()
    names = list(_named(model))
    for step, (expect, reduced, unreduced, mv, params) in enumerate(captured):
        for name in names:
            head = f"0:{name}/rank0"
            assert_stats_close(
                unreduced[f"{head}/acc_grad"], expect["grad"][name], what=f"step {step} {name} unreduced"
            )
            assert_stats_close(
                reduced[f"{head}/post_grad"], expect["grad"][name], what=f"step {step} {name} reduced"
            )
            for kind in ("param_origin", "param_updated"):
                assert_stats_close(
                    params[f"{head}/{kind}"], expect[kind][name], what=f"step {step} {name} {kind}"
                )
            for kind in ("exp_avg", "exp_avg_sq"):
                assert_stats_close(
                    mv[f"{head}/{kind}"], expect[kind][name], what=f"step {step} {name} {kind}"
                )
        assert len(unreduced) == len(reduced) == len(names)


def test_live_parquet_output_holds_every_statistic(tmp_path, monkeypatch):
    """format parquet: the files of the rank directory, read with DuckDB as the docs show, hold
    numpy's statistics of every data type at every step, exactly as computed (64-bit values)."""
    import duckdb

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = TrainerMon(_config(format="parquet"))
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    captured = _train_and_capture(mon, model, optimizer, make_batches(STEPS, GRAD_ACC))
    mon.stop()
    pattern = os.path.join(tmp_path, "*", "values", "*", "*.parquet")
    rows = duckdb.sql(
        f"SELECT data_type, step, name, op, value FROM read_parquet('{pattern}', hive_partitioning = true) "
        "WHERE rank = 0 AND micro_step IS NULL"
    ).fetchall()
    sources = {"grad_unreduced": "grad", "grad_reduced": "grad", "param_origin": "param_origin"}
    sources.update({"param_updated": "param_updated", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"})
    got: dict[tuple, dict[str, float]] = {}
    for data_type, step, name, op, value in rows:
        if data_type in sources:  # (mg_direction's "other" is checked by the next test, in memory)
            got.setdefault((data_type, step, name), {})[op] = value
    names = list(_named(model))
    assert len(got) == STEPS * len(names) * len(sources)
    for step, (expect, *_) in enumerate(captured):
        for data_type, source in sources.items():
            for name in names:
                what = f"step {step} {name} {data_type}"
                assert_stats_close(got[(data_type, step, name)], expect[source][name], what=what)


def test_mg_direction_matches_sign_agreement_with_previous_moment():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(_config(ops=["min", "max", "norm", "mean"]))
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    values = []
    for step_batches in make_batches(STEPS, GRAD_ACC):
        for x in step_batches:
            model(x).pow(2).mean().backward()
        expected = {}
        for name, p in _named(model).items():
            if p in optimizer.state:
                expected[name] = sign_agreement(p.grad.numpy(), optimizer.state[p]["exp_avg"].numpy())
            else:
                expected[name] = 1.0
        optimizer.step()
        optimizer.zero_grad()
        values.append((expected, dict(mon._session.core.latest.latest("other"))))
    mon.stop()
    assert any(v != 1.0 for expected, _ in values[1:] for v in expected.values())
    for expected, got in values:
        for name, value in expected.items():
            assert_mg_direction_row(got[f"0:{name}/rank0/mg_direction"], value)


def test_per_micro_batch_gradients_match_each_micro_batch():
    torch.manual_seed(0)
    model = MLP()
    twin = MLP()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon(_config(monitor_mbs_grad=True, mv_distribution=False, mg_direction=False))
    mon.set_monitor(model, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    for step_batches in make_batches(2, GRAD_ACC):
        twin.load_state_dict(model.state_dict())
        per_micro = []
        for x in step_batches:
            twin.zero_grad()
            twin(x).pow(2).mean().backward()
            per_micro.append({n: p.grad.numpy().copy() for n, p in twin.named_parameters()})
            model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        assert len(unreduced) == GRAD_ACC * len(per_micro[0])
        for micro, grads in enumerate(per_micro):
            for name, grad in grads.items():
                assert_stats_close(
                    unreduced[f"0:{name}:{micro}/rank0/acc_grad"], grad, what=f"{name} micro {micro}"
                )
    mon.stop()


def test_metrics_are_plain_floats():
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon(_config())
    mon.set_monitor(model, 1, optimizer)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    reduced, unreduced = mon.generate_wgrad_metrics()
    for metrics in (reduced, unreduced, mon.generate_mv_metrics(), mon.generate_param_metrics()):
        assert_plain_floats(metrics)
    mon.stop()


def test_unreduced_gradient_is_read_at_the_last_micro_batch_only():
    """With grad_acc_steps=3 the row describes the sum of all three micro-batches' gradients."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(_config(mv_distribution=False, mg_direction=False, param_distribution=False))
    mon.set_monitor(model, grad_acc_steps=3, optimizer=optimizer)
    for x in make_batches(1, 3)[0]:
        model(x).pow(2).mean().backward()
    total = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    optimizer.step()
    _, unreduced = mon.generate_wgrad_metrics()
    for name, grad in total.items():
        assert_stats_close(unreduced[f"0:{name}/rank0/acc_grad"], grad, what=name)
    mon.stop()


def _clip(model, scaler, optimizer):
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)


def _unscale(model, scaler, optimizer):  # writes without bumping the gradients' versions
    scaler.unscale_(optimizer)


def _halve_through_data(model, scaler, optimizer):  # .data has a version counter of its own
    for p in model.parameters():
        p.grad.data.mul_(0.5)


@pytest.mark.parametrize("change", [_clip, _unscale, _halve_through_data])
def test_reduced_gradient_changed_after_backward_is_measured_again(change):
    """grad_reduced may reuse grad_unreduced's row only for an unchanged gradient. Between
    backward and step, clipping changes .grad in place (bumping its version), a loss scaler's
    unscaling and a loop through ``.data`` change it without: the reduced row must show each.
    The loss is scaled by 1024 and the scaler unscales at its step at the latest; the test reads
    what the optimizer uses with a step pre-hook of its own."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    changed: dict[str, np.ndarray] = {}
    optimizer.register_step_pre_hook(
        lambda *_: changed.update({n: p.grad.detach().numpy().copy() for n, p in _named(model).items()})
    )
    mon = TrainerMon(_config())
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    for (x,) in make_batches(2, 1):
        scaler.scale(model(x).pow(2).mean()).backward()
        raw = {n: p.grad.detach().numpy().copy() for n, p in _named(model).items()}
        change(model, scaler, optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        reduced, unreduced = mon.generate_wgrad_metrics()
        for name in raw:
            head = f"0:{name}/rank0"
            assert_stats_close(unreduced[f"{head}/acc_grad"], raw[name], what=f"{name} unreduced")
            assert_stats_close(reduced[f"{head}/post_grad"], changed[name], what=f"{name} reduced")
            assert not np.allclose(raw[name], changed[name])
    mon.stop()


class _CheckpointedMLP(MLP):
    """The MLP with its middle layer under reentrant activation checkpointing: its parameters'
    gradients are accumulated by a backward pass run inside the outer one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, middle, last = self.layers
        x = torch.relu(first(x))
        x = torch.utils.checkpoint.checkpoint(lambda h: torch.relu(middle(h)), x, use_reentrant=True)
        return self.norm(last(x))


def test_unreduced_gradient_of_nested_backward_passes_is_read_before_clipping():
    """Gradients accumulated in a backward pass nested in another (reentrant checkpointing) and
    in the outer pass are all measured as accumulated over the step's micro-batches, before the
    clipping that follows the last backward."""
    torch.manual_seed(0)
    model = _CheckpointedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    mon = TrainerMon(_config(mv_distribution=False, mg_direction=False, param_distribution=False))
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    for step_batches in make_batches(3, 2):
        for x in step_batches:
            x.requires_grad_(True)  # reentrant checkpointing needs an input that requires grad
            model(x).pow(2).mean().backward()
        raw = {n: p.grad.detach().numpy().copy() for n, p in _named(model).items()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        optimizer.step()
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        assert len(unreduced) == len(raw)
        for name, grad in raw.items():
            assert_stats_close(unreduced[f"0:{name}/rank0/acc_grad"], grad, what=name)
    mon.stop()
