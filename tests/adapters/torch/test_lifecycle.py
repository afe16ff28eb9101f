"""Attaching, scheduling, stopping: the training is unchanged and every hook goes away."""

from __future__ import annotations

import logging
import os

import numpy as np
import pandas as pd
import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import ALL_OPS, MLP, make_batches
from tests.shared_configs import DATA_TYPES as SHARED_DATA_TYPES
from tests.shared_outputs import collected_steps, window_starts

DATA_TYPES = {**SHARED_DATA_TYPES, "xy": {"xy_distribution": True, "all_xy": True}}


def _train(model, optimizer, steps: int, grad_acc: int = 2, seed: int = 1) -> list[float]:
    losses = []
    for step_batches in make_batches(steps, grad_acc, seed=seed):
        for x in step_batches:
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _fresh(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _hook_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every hook dictionary a monitor could touch, as lists of hook ids."""
    return {
        "params": [
            (n, list(p._post_accumulate_grad_hooks or {}), list(p._backward_hooks or {}))
            for n, p in model.named_parameters()
        ],
        "modules": [
            (
                n,
                list(m._forward_pre_hooks),
                list(m._forward_hooks),
                list(m._backward_hooks),
                list(m._backward_pre_hooks),
            )
            for n, m in model.named_modules()
        ],
        "optimizer": (list(optimizer._optimizer_step_pre_hooks), list(optimizer._optimizer_step_post_hooks)),
    }


@pytest.mark.parametrize("kind", sorted(DATA_TYPES))
def test_training_is_bit_identical_with_the_monitor(kind):
    model, optimizer = _fresh()
    plain_losses = _train(model, optimizer, 10)
    plain = [p.detach().clone() for p in model.parameters()]

    model, optimizer = _fresh()
    mon = TrainerMon({**DATA_TYPES[kind], "ops": ALL_OPS, "format": "csv"})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    monitored_losses = _train(model, optimizer, 10)
    mon.stop()
    assert monitored_losses == plain_losses
    for before, after in zip(plain, model.parameters()):
        assert torch.equal(before, after.detach())


def test_stop_removes_every_hook():
    model, optimizer = _fresh()
    before = _hook_state(model, optimizer)
    mon = TrainerMon(DATA_TYPES["all"])
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    assert _hook_state(model, optimizer) != before
    _train(model, optimizer, 2)
    mon.stop()
    assert _hook_state(model, optimizer) == before
    mon.stop()  # idempotent
    assert not mon.monitoring


def test_collect_times_removes_every_hook_and_training_goes_on(tmp_path):
    model, optimizer = _fresh()
    before = _hook_state(model, optimizer)
    mon = TrainerMon({**DATA_TYPES["all"], "collect_times": 3})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 6)
    assert not mon.monitoring
    assert _hook_state(model, optimizer) == before
    files = sorted(os.listdir(mon.output_dir))
    assert "grad_reduced_2-2.csv" in files and "grad_reduced_3-3.csv" not in files


def test_collect_times_reached_on_the_last_step_is_cleaned_by_stop():
    model, optimizer = _fresh()
    before = _hook_state(model, optimizer)
    mon = TrainerMon({**DATA_TYPES["all"], "collect_times": 2})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 2)
    mon.stop()
    assert _hook_state(model, optimizer) == before


def test_schedule_start_step_interval_and_collect_times():
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "start_step": 2, "step_interval": 3, "collect_times": 2})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 10)
    mon.stop()
    assert window_starts(mon.output_dir) == [2, 5]


def test_step_interval_counts_from_start_step_whenever_collection_begins(trainmon_log):
    """msprobe collects step N when (N - start_step) % step_interval == 0: a run resumed at step 5
    collects the same steps as the run it continues (10, 20), and so does a collection begun
    again by start() or a change of ops in Python (not 5, 15 or 23, 33)."""
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "step_interval": 10})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer, start_iteration=5)
    said = [r.getMessage() for r in trainmon_log.records if "recording" in r.getMessage()]
    assert "from step 10 " in said[-1], said
    _train(model, optimizer, 18)  # steps 5 .. 22
    mon.stop()
    mon.start(step=23)
    _train(model, optimizer, 10)  # steps 23 .. 32
    mon.ops = ["norm", "max"]
    _train(model, optimizer, 10)  # steps 33 .. 42
    mon.stop()
    assert collected_steps(mon.output_dir, prefix="") == [10, 20, 30, 40]


def test_start_iteration_offsets_the_step_counter():
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "start_step": 100})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer, start_iteration=99)
    _train(model, optimizer, 3)
    mon.stop()
    assert collected_steps(mon.output_dir, prefix="") == [100, 101]


def test_targets_select_on_name_boundaries():
    torch.manual_seed(0)
    model = MLP(sizes=(6,) * 12 + (4,))  # layers.0 .. layers.11
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        {"wg_distribution": True, "format": "api", "targets": {"layers.1": {}, "norm.weight": {}}}
    )
    mon.set_monitor(model, 2, optimizer)
    _train(model, optimizer, 1)
    reduced, _ = mon.generate_wgrad_metrics()
    mon.stop()
    assert sorted(reduced) == [
        "0:layers.1.bias/rank0/post_grad",
        "0:layers.1.weight/rank0/post_grad",
        "0:norm.weight/rank0/post_grad",
    ]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_targets_key_that_names_nothing_is_warned_about_with_the_closest_name(caplog):
    from tests.training import Net

    torch.manual_seed(0)
    mlp = MLP()
    targets = {"layers.1": {}, "norm.weght": {}, "lm_head": {}, "0:layers.0.weight": {}}
    model = Net()  # block.1 is a GELU: a module without parameters, which xy may target
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"wg_distribution": True, "format": "api", "targets": targets})
        mon.set_monitor(mlp, 1, torch.optim.AdamW(mlp.parameters()))
        mon.stop()
        told = _warnings(caplog)
        caplog.clear()
        other = TrainerMon({"xy_distribution": True, "format": "api", "targets": {"block.1": {}}})
        other.set_monitor(model, 1, optimizer)
        other.stop()
    unmatched = [m for m in told if "targets key" in m]
    assert len(unmatched) == 2, told
    assert "'norm.weght' selects no module or parameter" in unmatched[0] and "'norm.weight'?" in unmatched[0]
    assert "'lm_head'" in unmatched[1] and "print_struct: true lists" in unmatched[1]
    assert not [m for m in _warnings(caplog) if "targets key" in m]
    # a module without parameters may be targeted for activations: nothing is wrong there
    assert not [m for m in _warnings(caplog) if "no parameter is selected" in m]


def test_weight_data_types_with_no_parameter_selected_are_warned_about(caplog):
    mlp = MLP()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"wg_distribution": True, "format": "api", "targets": {"norm.weght": {}}})
        mon.set_monitor(mlp, 1, torch.optim.AdamW(mlp.parameters()))
        mon.stop()
    (told,) = [m for m in _warnings(caplog) if "no parameter is selected" in m]
    assert "targets: norm.weght" in told and "wg_distribution records nothing" in told, told
    assert "frozen" not in told
    mlp.norm.weight.requires_grad_(False)  # a LoRA user naming the frozen base weight
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"wg_distribution": True, "format": "api", "targets": {"norm.weight": {}}})
        mon.set_monitor(mlp, 1, torch.optim.AdamW(mlp.parameters()))
        mon.stop()
    (told,) = [m for m in _warnings(caplog) if "no parameter is selected" in m]
    assert "(the 1 parameter(s) the targets name are frozen: requires_grad is False)" in told, told


def test_attaching_again_after_stop_monitors_the_new_run_and_only_it():
    """A trainer's second fit() with the same callback: stop(), then set_monitor on a new optimizer.
    The new run's parameters are recorded; the first attachment's hooks are gone; attaching
    again without stop() is refused, also once collect_times has ended the collection."""
    model, optimizer = _fresh()
    before = _hook_state(model, optimizer)
    mon = TrainerMon({"param_distribution": True, "format": "api"})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    with pytest.raises(RuntimeError, match="already attached; call stop"):
        mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 2)
    done = TrainerMon({"param_distribution": True, "format": "api", "collect_times": 1})
    done.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 1)  # collect_times reached: no longer monitoring, but not stopped
    with pytest.raises(RuntimeError, match="already attached; call stop"):
        done.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    done.stop()
    mon.stop()
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    clean = _hook_state(model, second)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=second)
    assert _hook_state(model, optimizer)["optimizer"] == before["optimizer"]  # the first run's: gone
    _train(model, second, 1)
    rows = mon.generate_param_metrics()
    for name, param in model.named_parameters():
        want = float(np.linalg.norm(param.detach().numpy().astype(np.float64)))
        assert rows[f"0:{name}/rank0/param_updated"]["norm"] == pytest.approx(want, rel=1e-6), name
    mon.stop()
    assert _hook_state(model, second) == clean


def test_set_last_micro_batch_takes_a_bool_only():
    with pytest.raises(TypeError, match="set_last_micro_batch: last: expected true or false, got 1"):
        TrainerMon({"param_distribution": True, "format": "api"}).set_last_micro_batch(1)


def test_graph_mode_is_refused_for_torch_at_the_door():
    mlp = MLP()
    with pytest.raises(ValueError, match="graph_mode: MindSpore only"):
        TrainerMon({"param_distribution": True, "format": "api"}).set_monitor(
            mlp, 1, torch.optim.AdamW(mlp.parameters()), graph_mode=True
        )


def test_a_bad_compiled_argument_is_refused_at_the_door():
    mlp = MLP()
    with pytest.raises(ValueError, match="compiled: expected true or false, got 'yes'"):
        TrainerMon({"param_distribution": True, "format": "api"}).set_monitor(
            mlp, 1, torch.optim.AdamW(mlp.parameters()), compiled="yes"
        )


def test_an_l2_targets_key_that_names_no_module_is_warned_about(caplog):
    torch.manual_seed(0)
    mlp = MLP()
    l2 = {"attention_hook": ["atention"], "linear_hook": ["layers.0", "layer.1", "layers.0.weight"]}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"recording_l2_features": True, "l2_targets": l2, "format": "api"})
        mon.set_monitor(mlp, 1, torch.optim.AdamW(mlp.parameters()))
        mon.stop()
    unmatched = [m for m in _warnings(caplog) if "l2_targets" in m]
    assert len(unmatched) == 3, _warnings(caplog)
    assert "l2_targets.attention_hook key 'atention' selects no module" in unmatched[0], unmatched
    assert "l2_targets.linear_hook key 'layer.1'" in unmatched[1] and "'layers.1'?" in unmatched[1]
    assert "key 'layers.0.weight'" in unmatched[2]  # a parameter, not a module


@pytest.mark.parametrize(
    ("config", "told"),
    [
        ({"mv_distribution": True}, "keeps no exp_avg/exp_avg_sq; no moment rows"),
        ({"mg_direction": True}, "keeps no exp_avg; every share is 1.0"),  # msprobe's value
    ],
    ids=["moments", "mg_direction"],
)
def test_an_optimizer_without_moments_is_said_once(caplog, config, told):
    """Moments of an optimizer without them: no rows, and mg_direction's shares all 1.0 (written,
    so that a flat line of ones is not read as gradients agreeing with their momentum): said."""
    for optimizer_type, warned in ((torch.optim.SGD, 1), (torch.optim.Adagrad, 1), (torch.optim.AdamW, 0)):
        caplog.clear()
        torch.manual_seed(0)
        model = MLP()
        optimizer = optimizer_type(model.parameters(), lr=0.01)
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            mon = TrainerMon({**config, "format": "api"})
            mon.set_monitor(model, 2, optimizer)
            _train(model, optimizer, 3)
            shares = [row["norm"] for row in mon._latest("other").values()]
            mon.stop()
        about = [m for m in _warnings(caplog) if told in m]
        assert len(about) == warned, (optimizer_type, _warnings(caplog))
        assert all(optimizer_type.__name__ in m for m in about)
        if "mg_direction" in config and warned:
            assert shares and set(shares) == {1.0}


def test_whether_an_optimizer_keeps_adam_moments_is_told_only_once_an_update_made_state():
    from adapters.torch.optim import TorchBackend
    from adapters.torch.optimizer_checks import without_adam_moments

    def verdicts(optimizer_type, **kwargs):
        torch.manual_seed(0)
        model = MLP()
        params = list(model.parameters())
        backend = TorchBackend(optimizer_type(params, lr=0.01, **kwargs))
        before = without_adam_moments(backend, params)
        model(torch.ones(2, 6)).sum().backward()
        backend.optimizer.step()
        return before, without_adam_moments(backend, params)

    assert verdicts(torch.optim.AdamW) == (None, False)  # before its first update it cannot tell
    assert verdicts(torch.optim.SGD, momentum=0.9) == ("SGD", "SGD")  # no betas; then state, no exp_avg
    assert verdicts(torch.optim.SGD) == ("SGD", "SGD")  # no state ever, and no betas
    assert verdicts(torch.optim.Adagrad) == ("Adagrad", "Adagrad")


def test_a_config_that_switches_nothing_on_is_warned_about(caplog):
    model, optimizer = _fresh()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        mon = TrainerMon({"wg_distributon": True, "format": "api"})  # misspelt
        mon.set_monitor(model, 2, optimizer)
        mon.stop()
    told = _warnings(caplog)
    assert any("unknown key 'wg_distributon'" in m and "'wg_distribution'" in m for m in told), told
    assert any(m.startswith("trainmon: nothing to record") for m in told), told
    recording = ({"ur_distribution": True, "format": "tensorboard"}, {"cc_distribution": {"enable": True}})
    for something in recording:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            mon = TrainerMon(something)
            mon.set_monitor(model, 2, optimizer)
            mon.stop()
        assert not [m for m in _warnings(caplog) if "nothing to record" in m], something
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainmon"):  # ur_distribution needs TensorBoard
        mon = TrainerMon({"ur_distribution": True, "wg_distribution": True, "format": "csv"})
        mon.set_monitor(model, 2, optimizer)
        mon.stop()
    (attached,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainmon: recording")]
    assert "recording wg_distribution on" in attached, attached
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainmon"):  # the one key on is off with CSV: said why
        mon = TrainerMon({"ur_distribution": True, "format": "csv"})
        mon.set_monitor(model, 2, optimizer)
        mon.stop()
    (nothing,) = [m for m in _warnings(caplog) if "nothing to record" in m]
    assert (
        "(ur_distribution is on, but its histograms go to TensorBoard files only, not to format csv)"
        in nothing
    )


def test_module_ranks_without_this_rank_monitors_nothing(_output_dir):
    model, optimizer = _fresh()
    before = _hook_state(model, optimizer)
    mon = TrainerMon({**DATA_TYPES["all"], "module_ranks": [1]})
    mon.set_monitor(model, 2, optimizer)
    assert _hook_state(model, optimizer) == before
    _train(model, optimizer, 2)
    assert not _output_dir.exists()
    assert mon.generate_wgrad_metrics() == ({}, {})


def test_plain_pytorch_with_main_grad_true_does_not_crash(caplog):
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "format": "api"}, params_have_main_grad=True)
    mon.set_monitor(model, 2, optimizer)
    _train(model, optimizer, 2)
    reduced, unreduced = mon.generate_wgrad_metrics()
    mon.stop()
    assert len(reduced) == len(list(model.parameters())) and len(unreduced) == len(reduced)


def test_main_grad_is_read_when_present():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"wg_distribution": True, "format": "api", "ops": ["norm"]})
    mon.set_monitor(model, 1, optimizer)
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 2.0)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    reduced, _ = mon.generate_wgrad_metrics()
    mon.stop()
    assert reduced["0:weight/rank0/post_grad"]["norm"] == pytest.approx(2.0 * np.sqrt(6))


def test_later_argument_order_and_deprecated_shims():
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "format": "api"})
    mon.set_monitor(model, optimizer, 2)  # later msprobe order: (model, optimizer, grad_acc_steps)
    _train(model, optimizer, 1)
    assert mon.generate_wgrad_metrics()[0]
    mon.stop()

    model, optimizer = _fresh()
    legacy = TrainerMon({"wg_distribution": True, "format": "api"})
    with pytest.warns(DeprecationWarning):
        legacy.set_wrapped_optimizer(optimizer)
    with pytest.warns(DeprecationWarning):
        legacy.monitor_gnorm_with_ad(model, grad_acc_steps=2)
    _train(model, optimizer, 1)
    assert legacy.generate_wgrad_metrics()[0]
    legacy.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_acc_steps": 0}, "grad_acc_steps"),
        ({"start_iteration": -1}, "start_iteration"),
        ({"optimizer": None}, "optimizer"),
        ({"optimizer": object()}, "optimizer"),
    ],
)
def test_bad_set_monitor_arguments_are_rejected_at_the_door(kwargs, message):
    model, optimizer = _fresh()
    arguments = {"grad_acc_steps": 1, "optimizer": optimizer, **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        TrainerMon({"wg_distribution": True}).set_monitor(model, **arguments)


def test_a_method_given_for_grad_acc_steps_is_named_briefly():
    """``engine.gradient_accumulation_steps`` without its call: the error names the method, not
    the whole model its repr would print."""
    model, optimizer = _fresh()
    big = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(50)])
    with pytest.raises(ValueError, match="grad_acc_steps: expected an integer >= 1, got method") as raised:
        TrainerMon({"wg_distribution": True}).set_monitor(
            model, grad_acc_steps=big.parameters, optimizer=optimizer
        )
    assert len(str(raised.value)) < 250 and "\n" not in str(raised.value)


def test_csv_files_layout_rows_and_windows():
    model, optimizer = _fresh()
    mon = TrainerMon({**DATA_TYPES["all"], "ops": ["norm", "nans"], "step_count_per_record": 2})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    _train(model, optimizer, 5)
    mon.stop()
    names = [n for n, _ in model.named_parameters()]
    files = sorted(os.listdir(mon.output_dir))
    expected = {
        f"{prefix}_{a}-{a + 1}.csv"
        for prefix in (
            "grad_unreduced",
            "grad_reduced",
            "exp_avg",
            "exp_avg_sq",
            "param_origin",
            "param_updated",
            "other",
        )
        for a in (0, 2, 4)
    } | {"trainmon_run.json"}
    assert set(files) == expected
    for prefix in ("grad_reduced", "exp_avg_sq", "other"):
        frame = pd.read_csv(os.path.join(mon.output_dir, f"{prefix}_2-3.csv"))
        assert list(frame.columns) == ["vpp_stage", "name", "step", "norm", "nans"]
        assert sorted(frame["step"].value_counts().items()) == [(2, len(names)), (3, len(names))]
        assert set(frame["name"]) == set(names) and set(frame["vpp_stage"]) == {0}
    tail = pd.read_csv(os.path.join(mon.output_dir, "exp_avg_sq_4-5.csv"))
    assert (tail["norm"] > 0).all()  # significant digits: small moments are not rounded to 0.0


def test_tensorboard_scalars_read_back_equal_numpy():
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "ops": ["norm", "max"], "format": "tensorboard"})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    expected = {}
    for step, step_batches in enumerate(make_batches(3, 2)):
        for x in step_batches:
            model(x).pow(2).mean().backward()
        for name, p in model.named_parameters():
            grad = p.grad.numpy().astype(np.float64)
            expected[(f"0:{name}/rank0/post_grad_norm", step)] = np.linalg.norm(grad)
            expected[(f"0:{name}/rank0/acc_grad_max", step)] = grad.max()
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    events = EventAccumulator(mon.output_dir, size_guidance={SCALARS: 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert len(tags) == 2 * 2 * len(list(model.parameters()))
    for (tag, step), value in expected.items():
        (point,) = [e for e in events.Scalars(tag) if e.step == step]
        assert point.value == pytest.approx(np.float32(value), rel=1e-6)


def test_failure_in_a_statistic_is_contained(monkeypatch, caplog):
    import adapters.torch.grads as grads

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(grads.RowBuffer, "put", broken)  # gradients measured one by one
    monkeypatch.setattr(grads.RowBuffer, "put_many", broken)  # or together (one process)
    model, optimizer = _fresh()
    mon = TrainerMon({"wg_distribution": True, "param_distribution": True, "format": "api"})
    mon.set_monitor(model, 2, optimizer)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trainmon").addHandler(handler)
    try:
        _train(model, optimizer, 3)
    finally:
        logging.getLogger("trainmon").removeHandler(handler)
    reduced, unreduced = mon.generate_wgrad_metrics()
    mon.stop()
    failures = [r for r in records if "grad_unreduced failed" in r.getMessage()]
    assert len(failures) == 1 and "injected failure" in failures[0].getMessage()
    assert unreduced == {} and reduced and mon.generate_param_metrics()
