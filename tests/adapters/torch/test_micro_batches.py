"""Which gradient a step records when the loop is not the textbook one: steps with fewer or more
micro-batches than grad_acc_steps, and steps whose last micro-batch runs inside
``optimizer.step(closure)``. Every number is checked against the test's own copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monitor import TrainerMon
from monitor.session.collection import UNENDED_PASSES
from tests.adapters.torch.helpers import ALL_OPS, MLP, assert_stats_close, make_batches

CONFIG = {"wg_distribution": True, "ops": ALL_OPS, "format": "api"}


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _copies(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


def _assert_rows(metrics: dict, grads: dict[str, np.ndarray], task: str, what: str) -> None:
    assert len(metrics) == len(grads), f"{what}: {len(metrics)} rows for {len(grads)} parameters"
    for name, grad in grads.items():
        assert_stats_close(metrics[f"0:{name}/rank0/{task}"], grad, what=f"{what} {name}")


def test_steps_with_fewer_or_more_micro_batches_are_counted_not_assumed(trainmon_log):
    """grad_acc_steps 3, steps of 3, 1, 2 and 4 micro-batches, no clipping: each row describes
    the gradient accumulated over the micro-batches the step really had."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=3, optimizer=optimizer)
    counts = [3, 1, 2, 4]
    for step, (batches, count) in enumerate(zip(make_batches(len(counts), 4), counts)):
        for x in batches[:count]:
            _loss(model, x).backward()
        accumulated = _copies(model)
        optimizer.step()
        optimizer.zero_grad()
        _assert_rows(mon.generate_wgrad_metrics()[1], accumulated, "acc_grad", f"step {step}")
    mon.stop()
    said = [r.getMessage() for r in trainmon_log.records if "micro-batch" in r.getMessage()]
    assert len(said) == 1 and "step 1 had 1 micro-batch(es)" in said[0], said


def test_a_short_step_clipped_before_the_update_is_said_once_then_every_micro_batch_is_measured(
    trainmon_log,
):
    """Without a signal for the last micro-batch and with clipping in between, the short step's
    unreduced gradient is gone by the optimizer step: its rows are missing (never the clipped
    values under the unreduced name), a warning says so once, and later short steps are right."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    unreduced_rows = []
    for step, batches in enumerate(make_batches(4, 2)):
        for x in batches[: 1 if step in (1, 2) else 2]:
            _loss(model, x).backward()
        accumulated = _copies(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        optimizer.step()
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        unreduced_rows.append(len(unreduced))
        if step != 1:
            _assert_rows(unreduced, accumulated, "acc_grad", f"step {step}")
    mon.stop()
    assert unreduced_rows[1] == 0
    warned = [r.getMessage() for r in trainmon_log.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "step 1 ended after 1 micro-batch(es)" in warned[0], warned


def test_a_closure_step_is_collected_after_its_closure_ran():
    """``optimizer.step(closure)`` with forward, backward and clipping inside the closure (what
    Lightning does): the unreduced row is the gradient before clipping, the reduced row the one
    the optimizer used, and the training is the same as without the monitor."""
    torch.manual_seed(0)
    model, twin = MLP(), MLP()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.05)
    mon = TrainerMon({**CONFIG, "param_distribution": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    for step, (x,) in enumerate(make_batches(3, 1)):
        seen = {}

        def closure(net=model, opt=optimizer, seen=seen, x=x):
            opt.zero_grad()
            loss = _loss(net, x)
            loss.backward()
            seen["raw"] = _copies(net)
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=1e-3)
            seen["clipped"] = _copies(net)
            seen["origin"] = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
            return loss

        loss = optimizer.step(closure)
        twin_loss = twin_optimizer.step(lambda x=x: closure(twin, twin_optimizer, {}, x))
        assert torch.equal(loss, twin_loss)
        reduced, unreduced = mon.generate_wgrad_metrics()
        _assert_rows(unreduced, seen["raw"], "acc_grad", f"step {step} unreduced")
        _assert_rows(reduced, seen["clipped"], "post_grad", f"step {step} reduced")
        origin = {k: v for k, v in mon.generate_param_metrics().items() if k.endswith("param_origin")}
        for name, value in seen["origin"].items():
            assert_stats_close(origin[f"0:{name}/rank0/param_origin"], value, what=f"{name} origin")
    mon.stop()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_per_micro_batch_rows_of_closure_steps_with_a_short_step(trainmon_log):
    """``monitor_mbs_grad`` with the last micro-batch inside ``optimizer.step(closure)`` (Lightning),
    grad_acc_steps 2 and a step of one micro-batch: a row per micro-batch it really had, each
    equal to that micro-batch's own gradient (computed on a twin), clipping inside the closure
    changing none of them."""
    torch.manual_seed(0)
    model, twin = MLP(), MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon({**CONFIG, "monitor_mbs_grad": True})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    for step, (batches, count) in enumerate(zip(make_batches(3, 2), (2, 1, 2))):
        twin.load_state_dict(model.state_dict())
        own = []
        for x in batches[:count]:
            twin.zero_grad()
            _loss(twin, x).backward()
            own.append(_copies(twin))
        for x in batches[: count - 1]:  # every micro-batch but the last, outside the step
            _loss(model, x).backward()

        def closure(x=batches[count - 1]):
            loss = _loss(model, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
            return loss

        optimizer.step(closure)
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        assert len(unreduced) == count * len(own[0]), f"step {step}: {sorted(unreduced)}"
        for micro, grads in enumerate(own):
            for name, grad in grads.items():
                row = unreduced[f"0:{name}:{micro}/rank0/acc_grad"]
                assert_stats_close(row, grad, what=f"step {step} {name} micro {micro}")
    mon.stop()
    said = [r.getMessage() for r in trainmon_log.records if "micro-batch" in r.getMessage()]
    assert len(said) == 1 and "step 1 had 1 micro-batch(es)" in said[0] and "a row per micro-batch" in said[0]


def test_announced_micro_batches_number_the_gradients_as_the_activations(trainmon_log):
    """A trainer announces each micro-batch (``micro_batch_begins``, as the Lightning callback
    does); the first of a step's two runs its forward and no backward (a training_step returning
    None): the second's own gradient is micro-step 1, as its activations are, not 0."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon({**CONFIG, "monitor_mbs_grad": True, "xy_distribution": True})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    for first, second in make_batches(2, 2):
        mon.micro_batch_begins()
        model(first)  # no backward for this one
        mon.micro_batch_begins()
        _loss(model, second).backward()
        grads = _copies(model)
        optimizer.step()
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        assert sorted(unreduced) == sorted(f"0:{name}:1/rank0/acc_grad" for name in grads), sorted(unreduced)
        for name, grad in grads.items():
            assert_stats_close(unreduced[f"0:{name}:1/rank0/acc_grad"], grad, what=name)
        activations = mon._latest("actv")
        assert {tag.split("/")[0].rsplit(":", 1)[1] for tag in activations} == {"0", "1"}
    mon.stop()


def test_an_optimizer_that_calls_its_closure_several_times_records_the_first_evaluation():
    """LBFGS evaluates the closure again in its line search; the step records the gradient of
    the first evaluation, from which the update starts, and the training is unchanged."""
    torch.manual_seed(0)
    model, twin = MLP(), MLP()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    twin_optimizer = torch.optim.LBFGS(twin.parameters(), lr=0.1, max_iter=4)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    (x,) = make_batches(1, 1)[0]
    evaluations = []

    def closure(net=model, opt=optimizer, keep=evaluations):
        opt.zero_grad()
        loss = _loss(net, x)
        loss.backward()
        keep.append(_copies(net))
        return loss

    optimizer.step(closure)
    twin_optimizer.step(lambda: closure(twin, twin_optimizer, []))
    reduced, unreduced = mon.generate_wgrad_metrics()
    mon.stop()
    assert len(evaluations) > 1
    _assert_rows(reduced, evaluations[0], "post_grad", "reduced")
    _assert_rows(unreduced, evaluations[0], "acc_grad", "unreduced")
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


class IgnoresItsClosure(torch.optim.Optimizer):
    """Plain SGD that takes a closure argument and never calls it."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"])


def test_an_optimizer_that_never_calls_its_closure_is_collected_at_its_end():
    torch.manual_seed(0)
    model = MLP()
    optimizer = IgnoresItsClosure(model.parameters(), lr=0.1)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    for step, (x,) in enumerate(make_batches(2, 1)):
        _loss(model, x).backward()
        grads = _copies(model)
        optimizer.step(closure=lambda: None)
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        _assert_rows(unreduced, grads, "acc_grad", f"step {step}")
    assert mon.step == 2
    mon.stop()


def test_measured_gradients_are_not_kept_alive_by_the_monitor():
    """A framework that frees each gradient right after its hook (DeepSpeed does) must get the
    memory back: with main_grad (a back-end whose reduced pass cannot reuse rows) nothing is
    held; in one plain process the gradients are held only until the optimizer's pre-step."""
    import gc
    import weakref

    for main_grad, kept_until_step in ((True, False), (None, True)):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(CONFIG, params_have_main_grad=main_grad)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        (x,) = make_batches(1, 1)[0]
        _loss(model, x).backward()
        grads = [weakref.ref(p.grad.untyped_storage()) for p in model.parameters()]  # any view keeps it
        for p in model.parameters():
            p.grad = None  # freed by its owner after the hook
        gc.collect()
        alive = sum(g() is not None for g in grads)
        assert alive == (len(grads) if kept_until_step else 0), (main_grad, alive)
        if kept_until_step:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()  # the pre-step releases what the hooks held
            gc.collect()
            assert all(g() is None for g in grads)
        mon.stop()


@pytest.mark.parametrize("per_micro_batch", [False, True], ids=["per step", "per micro-batch"])
def test_backward_passes_with_no_step_of_the_monitored_optimizer_are_said_once(trainmon_log, per_micro_batch):
    """The optimizer that steps is not the one given to set_monitor (one made anew after loading
    a checkpoint): nothing can be written, a warning says why, once (for gradients and
    activations alike), and what a step that never ends holds stays bounded (its latest pass's
    rows)."""
    torch.manual_seed(0)
    model = MLP()
    monitored = torch.optim.SGD(model.parameters(), lr=0.1)
    stepping = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({**CONFIG, "monitor_mbs_grad": per_micro_batch, "xy_distribution": True})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=monitored)
    (x,) = make_batches(1, 1)[0]
    for _ in range(UNENDED_PASSES + 10):
        _loss(model, x).backward()
        stepping.step()
        stepping.zero_grad()
    held = len(mon._session.collection.grads._micro_rows)
    held_activations = len(mon._session.collection.activations._rows["actv"])
    mon.stop()
    warned = [
        r.getMessage() for r in trainmon_log.records if "no step of the monitored optimizer" in r.getMessage()
    ]
    assert len(warned) == 1 and f"{UNENDED_PASSES} backward passes" in warned[0], warned
    assert mon.generate_wgrad_metrics() == ({}, {})
    if per_micro_batch:  # per step, the rows are one per parameter by construction
        assert 0 < held <= len(list(model.parameters()))
    assert held_activations <= 4 * len(list(model.modules()))  # one pass's inputs and outputs at most


def test_a_short_run_whose_monitored_optimizer_never_stepped_is_said_at_stop(trainmon_log):
    """Too short for the warning above: stop() says that nothing was recorded and why; a run whose
    monitored optimizer steps, and one that never trained, say nothing of it."""

    def said(make_anew: bool, steps: int) -> list[str]:
        torch.manual_seed(0)
        model = MLP()
        monitored = torch.optim.SGD(model.parameters(), lr=0.1)
        stepping = torch.optim.SGD(model.parameters(), lr=0.1) if make_anew else monitored
        mon = TrainerMon(CONFIG)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=monitored)
        for (x,) in make_batches(steps, 1):
            _loss(model, x).backward()
            stepping.step()
            stepping.zero_grad()
        mon.stop()
        mon.stop()  # said once
        return [r.getMessage() for r in trainmon_log.records if "never stepped" in r.getMessage()]

    assert said(make_anew=False, steps=5) == [] and said(make_anew=True, steps=0) == []
    warned = said(make_anew=True, steps=5)
    assert len(warned) == 1 and warned[0].startswith("trainmon: 5 backward pass(es) while attached"), warned
