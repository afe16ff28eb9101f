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


def test_a_factored_second_moment_is_said_and_the_rest_recorded(trainmon_log):
    """Hugging Face's Adafactor keeps exp_avg_sq for vectors and a factored second moment for
    matrices: the vectors' rows are written (equal to the optimizer's state), the matrices' gap
    is said once, naming the keys their state holds."""
    pytest.importorskip("transformers")
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    model = MLP()
    optimizer = Adafactor(model.parameters(), lr=1e-2, relative_step=False, scale_parameter=False)
    mon = TrainerMon({**CONFIG, "wg_distribution": False}).set_monitor(
        model, grad_acc_steps=1, optimizer=optimizer
    )
    for (x,) in make_batches(2, 1):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    moments = mon.generate_mv_metrics()
    mon.stop()
    vectors = {n: p for n, p in model.named_parameters() if p.dim() == 1}
    assert {t for t in moments if t.endswith("/exp_avg_sq")} == {f"0:{n}/rank0/exp_avg_sq" for n in vectors}
    for name, param in vectors.items():
        state = optimizer.state[param]["exp_avg_sq"].numpy()
        assert_stats_close(moments[f"0:{name}/rank0/exp_avg_sq"], state, ops=CONFIG["ops"])
    said = [r.getMessage() for r in trainmon_log.records if "keeps no exp_avg_sq for" in r.getMessage()]
    matrices = sum(p.dim() == 2 for p in model.parameters())
    assert len(said) == 1 and f"Adafactor keeps no exp_avg_sq for {matrices} of" in said[0]
    assert "exp_avg_sq_col, exp_avg_sq_row" in said[0]
