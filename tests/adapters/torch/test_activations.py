"""Activation statistics against an independent recomputation, checkpointing, in-place ops, views."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adapters.torch.demo import Block, GPTConfig
from monitor import TrainerMon
from tests.adapters.torch.helpers import ALL_OPS, assert_stats_close

CFG = GPTConfig(vocab=50, hidden=16, heads=2, layers=1, seq=6)


class TinyLM(nn.Module):
    """Embedding -> transformer block (optionally checkpointed) -> head."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(CFG.vocab, CFG.hidden)
        self.block = Block(CFG)
        self.head = nn.Linear(CFG.hidden, CFG.vocab)
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        if self.reentrant is None:
            x = self.block(x)
        else:
            x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _batches(steps: int, micro: int, seed: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g) for _ in range(micro)] for _ in range(steps)
    ]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float().pow(2).mean()


def _run(model, config, batches, grad_acc=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        {
            "xy_distribution": True,
            "all_xy": True,
            "ops": ALL_OPS,
            "format": "api",
            "squash_name": False,
            **config,
        }
    )
    mon.set_monitor(model, grad_acc_steps=grad_acc, optimizer=optimizer)
    per_step = []
    for step_batches in batches:
        for tokens in step_batches:
            _loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        latest = mon._session.core.latest
        for prefix in ("actv", "actv_grad"):  # by tag, a row written twice would count once
            record = latest._latest.get(prefix)
            assert record is None or len(record.values) == len(record.as_dict()), f"{prefix}: a row twice"
        per_step.append((latest.latest("actv"), latest.latest("actv_grad")))
    mon.stop()
    return per_step


def _capture(twin: nn.Module, tokens: torch.Tensor):
    """Independent recomputation: the test's own hooks keep every module's inputs and outputs;
    torch.autograd.grad gives the loss's gradient with respect to each of them."""
    seen = []

    def hook(name):
        def fn(module, args, output):
            seen.append((name, "input", [a for a in args if isinstance(a, torch.Tensor)]))
            seen.append((name, "output", [output]))

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in twin.named_modules()]
    loss = _loss(twin, tokens)
    for h in handles:
        h.remove()
    values = {}
    wanted = []
    for name, direction, tensors in seen:
        for i, t in enumerate(tensors):
            key = f"{name}.{direction}" + (f"_{i}" if len(tensors) > 1 else "")
            values[key] = t.detach().numpy().copy()
            if t.requires_grad:
                wanted.append((f"{name}.{direction}_grad" + (f"_{i}" if len(tensors) > 1 else ""), t))
    grads = torch.autograd.grad(loss, [t for _, t in wanted], allow_unused=True)
    grads = {key: g.numpy().copy() for (key, _), g in zip(wanted, grads) if g is not None}
    return values, grads


def _recomputed(batches) -> list:
    """Per step, per micro-batch: every module's inputs, outputs and their gradients, recomputed
    by the test on a twin of a model it trains alone (to know each step's weights)."""
    torch.manual_seed(0)
    reference = TinyLM()
    twin = TinyLM()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for step_batches in batches:
        twin.load_state_dict(reference.state_dict())
        expected.append([_capture(twin, tokens) for tokens in step_batches])
        for tokens in step_batches:
            _loss(reference, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return expected


def _assert_rows_match(per_step, expected, rel: float = 1e-5) -> None:
    """Every row the monitor wrote equals the recomputation, and none is missing or extra."""
    assert len(per_step) == len(expected)
    for (actv, actv_grad), micro_batches in zip(per_step, expected):
        assert len(actv) == sum(len(values) for values, _ in micro_batches)
        assert len(actv_grad) == sum(len(grads) for _, grads in micro_batches)
        for micro, (values, grads) in enumerate(micro_batches):
            for key, array in values.items():
                what = f"{key} micro {micro}"
                assert_stats_close(actv[f"0:{key}:{micro}/rank0/actv"], array, what=what, rel=rel)
            for key, array in grads.items():
                what = f"{key} micro {micro}"
                assert_stats_close(actv_grad[f"0:{key}:{micro}/rank0/actv_grad"], array, what=what, rel=rel)


def test_every_activation_row_matches_an_independent_recomputation():
    batches = _batches(2, 2)
    expected = _recomputed(batches)
    torch.manual_seed(0)
    _assert_rows_match(_run(TinyLM(), {}, batches), expected)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_model_gives_the_same_rows_and_values(reentrant):
    """Activation checkpointing reruns each block's forward in backward: the rows are still one
    per module and micro-batch, with the recomputation's values (gradients summed in another
    order there, hence the looser tolerance)."""
    batches = _batches(2, 2)
    expected = _recomputed(batches)
    torch.manual_seed(0)
    _assert_rows_match(_run(TinyLM(reentrant=reentrant), {}, batches), expected, rel=1e-4)


class ReturnsView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 4)


def test_inplace_op_after_a_hooked_module_and_a_returned_view_work():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), ReturnsView(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        {"xy_distribution": True, "all_xy": True, "ops": ["norm", "min", "max"], "format": "api"}
    )
    mon.set_monitor(model, 1, optimizer)
    x = torch.randn(3, 4)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    last_weight = model[3].weight.detach().numpy().copy()
    out = model(x)
    out.mul_(2.0)  # in-place on the view the model returned
    out.sum().backward()
    optimizer.step()
    actv = mon._session.core.latest.latest("actv")
    grads = mon._session.core.latest.latest("actv_grad")
    mon.stop()
    pre_relu = (x @ weight.T + bias).numpy()
    assert_stats_close(actv["0:0.output:0/rank0/actv"], pre_relu, ["norm", "min", "max"])  # before ReLU ran
    assert_stats_close(actv["0:1.input:0/rank0/actv"], pre_relu, ["norm", "min", "max"])
    assert_stats_close(actv["0:1.output:0/rank0/actv"], np.maximum(pre_relu, 0), ["norm", "min", "max"])
    relu_grad = (np.ones((3, 2)) * 2.0) @ last_weight
    assert_stats_close(grads["0:1.output_grad:0/rank0/actv_grad"], relu_grad, ["norm", "min", "max"])
    before_relu = relu_grad * (pre_relu > 0)  # ReLU's input: Linear's output before ReLU changed it
    assert_stats_close(grads["0:0.output_grad:0/rank0/actv_grad"], before_relu, ["norm", "min", "max"])
    assert_stats_close(grads["0:1.input_grad:0/rank0/actv_grad"], before_relu, ["norm", "min", "max"])


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]


class Structured(nn.Module):
    """Keyword inputs, a dataclass output (like HuggingFace ModelOutput), a changing structure."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, extra: bool = False):
        h = self.fc(x) * scale
        if extra:
            return {"a": h, "b": h * 2, "c": h * 3}
        return Output(logits=h, hidden=(x, h))


def test_keyword_inputs_structured_outputs_and_changing_structure():
    torch.manual_seed(0)
    model = Structured()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "ops": ["norm"], "format": "api", "targets": {"": {}}})
    mon.set_monitor(model, 2, optimizer)
    x, scale = torch.randn(2, 3), torch.tensor(2.0)
    first = model(x, scale=scale)
    first.logits.sum().backward()
    second = model(x, scale=scale, extra=True)
    second["c"].sum().backward()
    optimizer.step()
    actv = mon._session.core.latest.latest("actv")
    mon.stop()
    assert set(actv) >= {
        "0:.input_0:0/rank0/actv",
        "0:.input_1:0/rank0/actv",
        "0:.output_0:0/rank0/actv",
        "0:.output_1:0/rank0/actv",
        "0:.output_2:0/rank0/actv",
        "0:.output_2:1/rank0/actv",
    }
    assert actv["0:.input_1:0/rank0/actv"]["norm"] == pytest.approx(2.0)
    assert actv["0:.output_1:0/rank0/actv"]["norm"] == pytest.approx(float(x.norm()), rel=1e-6)


def test_format_strings_select_and_a_mismatch_falls_back_without_error():
    torch.manual_seed(0)
    model = Structured()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    targets = {"fc": {"input": "tuple[1]:0", "output": "tensor"}, "": {"output": "tuple[2]:1"}}
    mon = TrainerMon({"xy_distribution": True, "ops": ["norm"], "format": "api", "targets": targets})
    mon.set_monitor(model, 1, optimizer)
    x = torch.randn(2, 3)
    model(x, scale=torch.tensor(1.0)).logits.sum().backward()
    optimizer.step()
    actv = mon._session.core.latest.latest("actv")
    mon.stop()
    assert actv["0:fc.input:0/rank0/actv"]["norm"] == pytest.approx(float(x.norm()), rel=1e-6)
    assert "0:fc.output:0/rank0/actv" in actv
    assert "0:.output_0:0/rank0/actv" in actv  # the root's "tuple[2]:1" does not fit a dataclass: all tensors


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(2, 2)
        self.sometimes = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        x = self.always(x)
        return self.sometimes(x) if use else x


def test_a_module_that_did_not_run_has_no_row_for_that_step():
    model = Gated()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["norm"], "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    seen = []
    for use in (True, False):
        model(torch.randn(1, 2), use).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append({t for t in mon._session.core.latest.latest("actv") if "sometimes" in t})
    mon.stop()
    assert seen[0] and not seen[1]


@pytest.mark.parametrize(
    ("flag", "present", "absent"),
    [("forward_only", "actv", "actv_grad"), ("backward_only", "actv_grad", "actv")],
)
def test_forward_only_and_backward_only(flag, present, absent):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, flag: True, "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    model(torch.randn(3, 2, requires_grad=True)).sum().backward()
    optimizer.step()
    latest = mon._session.core.latest
    assert latest.latest(present) and not latest.latest(absent)
    mon.stop()


def test_eval_mode_forward_is_not_recorded():
    model = nn.Sequential(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    model.eval()
    with torch.no_grad():
        model(torch.randn(3, 2))
    model.train()
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    tags = set(mon._session.core.latest.latest("actv"))
    mon.stop()
    assert tags == {
        "0:.input:0/rank0/actv",
        "0:.output:0/rank0/actv",
        "0:0.input:0/rank0/actv",
        "0:0.output:0/rank0/actv",
    }


class _Holder(nn.Module):
    """A wrapper as DDP is one: its only child is ``module``, and its call is the child's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class _Residual(nn.Module):
    """A block of the model whose only child is called ``module``: its call is not the child's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.module(x)


class _WithAModuleCalledModule(nn.Module):
    """A model of its own with a child that happens to be called ``module``, next to another."""

    def __init__(self) -> None:
        super().__init__()
        self.module, self.head = nn.Linear(2, 2), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(x))


def _activation_rows(model: nn.Module, targets: dict | None = None) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    selection = {"targets": targets} if targets else {"all_xy": True}
    mon = TrainerMon({"xy_distribution": True, **selection, "format": "api"})
    mon.set_monitor(model, 1, optimizer)
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    record = mon._session.core.latest._latest["actv"]
    rows = dict(mon._session.core.latest.latest("actv"))
    assert len(record.values) == len(rows), "a row written twice"  # by tag it would count once
    mon.stop()
    return rows


def test_a_wrappers_only_child_gives_no_second_row_of_the_same_tensors():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def plain() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))

    alone = _activation_rows(plain())
    assert _activation_rows(_Holder(plain())) == alone  # DDP's "module": no ".input" twice
    checkpointed = plain()
    checkpointed[0] = checkpoint_wrapper(checkpointed[0])
    assert _activation_rows(checkpointed) == alone
    # "0" names the wrapper and, without its segment, the module inside: one row each, not two
    checkpointed = plain()
    checkpointed[0] = checkpoint_wrapper(checkpointed[0])
    assert _activation_rows(checkpointed, {"0": {}}) == _activation_rows(plain(), {"0": {}})
    assert {"0:module.input:0/rank0/actv", "0:head.input:0/rank0/actv"} <= set(
        _activation_rows(_WithAModuleCalledModule())
    )
    inside = set(_activation_rows(nn.Sequential(_Residual(nn.Linear(2, 2)), nn.Linear(2, 1))))
    assert {"0:0.output:0/rank0/actv", "0:0.module.output:0/rank0/actv"} <= inside


def test_a_wrappers_only_child_named_in_targets_is_monitored():
    model = _Holder(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "format": "api", "targets": {"module": {}}})
    mon.set_monitor(model, 1, optimizer)
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    tags = set(mon._session.core.latest.latest("actv"))
    mon.stop()
    assert tags == {"0:module.input:0/rank0/actv", "0:module.output:0/rank0/actv"}


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_training_is_bit_identical_with_activations_monitored(reentrant):
    batches = _batches(4, 2)

    def train(monitored: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyLM(reentrant=reentrant)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = None
        if monitored:
            mon = TrainerMon(
                {"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "wg_distribution": True}
            )
            mon.set_monitor(model, 2, optimizer)
        for step_batches in batches:
            for tokens in step_batches:
                _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        if mon is not None:
            mon.stop()
        return [p.detach().clone() for p in model.parameters()]

    for plain, monitored in zip(train(False), train(True)):
        assert torch.equal(plain, monitored)


class SkipBias(nn.Module):
    """Returns its bias Parameter for the caller to add, as Megatron's linear layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.bias


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * weight


class LeafNet(nn.Module):
    """A Parameter leaves one module as an output and enters another as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = SkipBias()
        self.scale = Scale()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.a(x)
        return self.head(self.scale(out + bias, self.weight)).pow(2).mean()


@pytest.mark.parametrize("pipelined", [False, True], ids=["forward-backward", "two forwards, then backwards"])
def test_a_parameter_a_module_returns_or_receives_gets_each_micro_batchs_gradient_once(pipelined):
    """A hook on a Parameter outlives the backward pass: registered per micro-step, it measured
    later micro-batches' gradients under earlier rows again (and piled up, step after step)."""
    torch.manual_seed(0)
    model, twin = LeafNet(), LeafNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "ops": ALL_OPS, "format": "api", "squash_name": False})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        inputs = [torch.randn(3, 4, generator=g) for _ in range(2)]
        twin.load_state_dict(model.state_dict())
        expected = [torch.autograd.grad(twin(x), [twin.a.bias, twin.weight]) for x in inputs]
        if pipelined:
            losses = [model(x) for x in inputs]
            for loss in losses:
                loss.backward()
        else:
            for x in inputs:
                model(x).backward()
        assert len(model.a.bias._backward_hooks) <= 1 and len(model.weight._backward_hooks) <= 1
        optimizer.step()
        optimizer.zero_grad()
        rows = mon._session.core.latest.latest("actv_grad")
        for micro, (bias_grad, weight_grad) in enumerate(expected):
            assert_stats_close(rows[f"0:a.output_grad_1:{micro}/rank0/actv_grad"], bias_grad.numpy())
            assert_stats_close(rows[f"0:scale.input_grad_1:{micro}/rank0/actv_grad"], weight_grad.numpy())
        names = [tag.split("/")[0] for tag in rows]
        per_micro = [sorted(n.rsplit(":", 1)[0] for n in names if n.endswith(f":{m}")) for m in (0, 1)]
        assert len(names) == len(set(names)) and per_micro[0] == per_micro[1], sorted(names)
    mon.stop()
    assert not model.a.bias._backward_hooks and not model.weight._backward_hooks


@pytest.mark.parametrize("without_grad", [torch.no_grad, torch.inference_mode])
def test_a_forward_without_backward_in_training_mode_is_no_micro_step(without_grad):
    """An RL step's old log-probabilities, a sample generated in a callback (from the model or
    from a submodule, as a wrapped language model's ``generate``): the model is in training mode
    but gradients are off, so no backward follows; micro-steps 0 and 1 stay the two micro-batches
    that train, under the modules' own names."""
    model = nn.Sequential(nn.Linear(2, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["min", "max"], "format": "api"})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    weight, bias = model[0].weight.detach().numpy().copy(), model[0].bias.detach().numpy().copy()
    inputs = [torch.randn(4, 2) for _ in range(2)]
    with without_grad():
        model(torch.full((4, 2), 100.0))
    for x in inputs:
        with without_grad():
            model(torch.full((4, 2), -100.0))
            model[0](torch.full((4, 2), 50.0))
        model(x).sum().backward()
    optimizer.step()
    latest = mon._session.core.latest
    actv, grads = latest.latest("actv"), latest.latest("actv_grad")
    mon.stop()
    assert {tag.split(":")[2].split("/")[0] for tag in actv} == {"0", "1"}
    assert not [tag for tag in [*actv, *grads] if "[" in tag]  # no call counted before the training's
    for micro, x in enumerate(inputs):
        expected = x.numpy() @ weight.T + bias
        row = actv[f"0:0.output:{micro}/rank0/actv"]
        np.testing.assert_allclose([row["min"], row["max"]], [expected.min(), expected.max()], rtol=1e-6)
        assert grads[f"0:0.output_grad:{micro}/rank0/actv_grad"]["min"] == 1.0


def test_a_root_checkpointed_reentrantly_is_still_counted():
    """The reentrant checkpoint runs its first forward with gradients off; an input that
    requires them says a backward follows."""
    model = nn.Sequential(nn.Linear(2, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ["min", "max"], "format": "api"})
    mon.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    for _ in range(2):
        checkpoint(model, torch.randn(4, 2, requires_grad=True), use_reentrant=True).sum().backward()
    optimizer.step()
    latest = mon._session.core.latest
    actv, grads = set(latest.latest("actv")), set(latest.latest("actv_grad"))
    mon.stop()
    assert {f"0:0.output:{micro}/rank0/actv" for micro in (0, 1)} <= actv
    assert {f"0:0.output_grad:{micro}/rank0/actv_grad" for micro in (0, 1)} <= grads
