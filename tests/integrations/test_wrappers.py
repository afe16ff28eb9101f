"""Optimizer wrappers are unwrapped by what they are: accelerate's AcceleratedOptimizer (a
torch.optim.Optimizer subclass whose ``__init__`` never ran) and Lightning's LightningOptimizer
(no torch optimizer at all), passed straight to set_monitor; anything else gets a clear error."""

from __future__ import annotations

import pytest
import torch

from monitor import TrainerMon
from tests.adapters.torch.helpers import MLP, assert_stats_close, make_batches

CONFIG = {"wg_distribution": True, "mv_distribution": True, "format": "api", "ops": ["min", "max", "norm"]}


def _train_and_check(mon: TrainerMon, model: torch.nn.Module, step, inner: torch.optim.Optimizer) -> None:
    for (x,) in make_batches(2, 1):
        model(x).pow(2).mean().backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        step()
        inner.zero_grad()
        reduced, _ = mon.generate_wgrad_metrics()
        moments = mon.generate_mv_metrics()
        for name, param in model.named_parameters():
            assert_stats_close(reduced[f"0:{name}/rank0/post_grad"], grads[name], ops=CONFIG["ops"])
            exp_avg = inner.state[param]["exp_avg"].numpy()
            assert_stats_close(moments[f"0:{name}/rank0/exp_avg"], exp_avg, ops=CONFIG["ops"])
    assert mon.step == 2


def test_accelerated_optimizer_is_unwrapped():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = MLP()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    assert isinstance(optimizer, torch.optim.Optimizer)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    _train_and_check(mon, model, optimizer.step, optimizer.optimizer)
    mon.stop()


def test_lightning_optimizer_is_unwrapped():
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    torch.manual_seed(0)
    model = MLP()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    wrapper = LightningOptimizer(inner)
    mon = TrainerMon(CONFIG)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=wrapper)
    _train_and_check(mon, model, inner.step, inner)
    mon.stop()


class Facade(torch.optim.Optimizer):
    """Claims to be a torch optimizer, never initialised one, and holds none."""

    def __init__(self) -> None:  # deliberately not calling super().__init__
        self.defaults = {}


@pytest.mark.parametrize("optimizer, names", [(object(), "object"), (Facade(), "Facade")])
def test_a_wrapper_that_cannot_be_resolved_is_named_at_the_door(optimizer, names):
    mon = TrainerMon(CONFIG)
    with pytest.raises(TypeError, match=f"set_monitor: optimizer: .*got {names}"):
        mon.set_monitor(MLP(), grad_acc_steps=1, optimizer=optimizer)


def test_lightnings_placeholder_optimizer_is_refused_naming_it():
    """configure_optimizers returning None leaves Lightning's placeholder, which holds no
    parameters and whose step never marks a step's end: attached, the run would write nothing."""
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import _MockOptimizer

    mon = TrainerMon(CONFIG)
    with pytest.raises(ValueError, match="got _MockOptimizer holding no parameters"):
        mon.set_monitor(MLP(), grad_acc_steps=1, optimizer=_MockOptimizer())
    assert mon.output_dir is None
