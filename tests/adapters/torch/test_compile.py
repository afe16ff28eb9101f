"""torch.compile: whole-model and per-block compiled models give eager's rows for every data type,
attention features included, whether the monitor attached before or after the first compiled call.

Per-block compile is tested both ways users write it: ``block.compile()`` in place and
``torch.compile(block)`` assigned into the ModuleList. Most cases use the ``aot_eager`` backend
(dynamo and AOT autograd as with inductor, without the minutes of C++ compilation on a CPU
machine); one case runs inductor itself, on CPU and, where a GPU is present, on it (its Triton
kernels). Graph breaks are read from dynamo's own counters.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from monitor import TrainerMon
from tests.adapters.torch.helpers import ALL_OPS
from tests.shared_configs import STEP_PREFIXES

pytestmark = pytest.mark.slow

PREFIXES = ("actv", "actv_grad", *STEP_PREFIXES, "attention_hook", "linear_hook")
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "mg_direction": True,
    "recording_l2_features": True,
    "l2_targets": {"attention_hook": ["blocks.0.attention", "blocks.1.attention"], "linear_hook": []},
    "sa_order": "b,s,h,d",
    "ops": ALL_OPS,
    "format": "api",
    "step_interval": 2,
}
STEPS = 4
#: where inductor's case runs: its C++ kernels on CPU, its Triton kernels on a GPU where present
INDUCTOR_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Attention(torch.nn.Module):
    """Causal attention of Q and K ("b,s,h,d") over Q as values, back to (b, s, h*d)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
        causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("bhst,bthd->bshd", probs, q).flatten(-2)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(8, 16)
        self.attention = Attention()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).unflatten(-1, (2, 2, 4)).unbind(-3)
        x = x + self.attention(q, k)
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _compile(model: Net, style: str, backend: str) -> torch.nn.Module:
    """The module to call: the model compiled as a whole, or the model with compiled blocks."""
    if style == "whole":
        return torch.compile(model, backend=backend)
    for i, block in enumerate(model.blocks):
        if style == "in-place":
            block.compile(backend=backend)
        else:
            model.blocks[i] = torch.compile(block, backend=backend)
    return model


def _run(
    style: str | None,
    when: str = "before",
    backend: str = "aot_eager",
    config: dict = CONFIG,
    device: str = "cpu",
) -> list[dict]:
    """Two warm-up steps, then STEPS steps; every data type's latest rows after each of those."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    call: torch.nn.Module = model
    mon = None
    if style is not None and when == "before":
        mon = TrainerMon(config).set_monitor(model, 1, optimizer)
        call = _compile(model, style, backend)
    elif style is not None:
        call = _compile(model, style, backend)

    def step(seed: int) -> None:
        x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(seed)).to(device)
        call(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step(100)
    step(101)
    if mon is None:  # eager, or attached after the first compiled calls (to what the user holds)
        mon = TrainerMon(config).set_monitor(call, 1, optimizer)
    rows = []
    for seed in range(STEPS):
        step(seed)
        rows.append({prefix: mon._latest(prefix) for prefix in PREFIXES})
    mon.stop()
    return rows


def _assert_same_rows(
    eager: list[dict],
    compiled: list[dict],
    rel: float,
    abs_tol: float | None = None,
    prefixes: tuple[str, ...] = PREFIXES,
) -> None:
    """Every row of every data type equal within ``rel`` (and ``abs_tol`` for values near zero,
    such as a mean that cancels: by default a hundredth of ``rel``)."""
    abs_tol = rel * 1e-2 if abs_tol is None else abs_tol
    for step, (want, got) in enumerate(zip(eager, compiled)):
        for prefix in prefixes:
            assert want[prefix], f"step {step} {prefix}: no rows in eager mode"
            assert set(got[prefix]) == set(want[prefix]), (
                f"step {step} {prefix}: {set(got[prefix]) ^ set(want[prefix])}"
            )
            for tag, row in want[prefix].items():
                for op, value in row.items():
                    assert got[prefix][tag][op] == pytest.approx(value, rel=rel, abs=abs_tol, nan_ok=True), (
                        f"step {step} {tag} {op}"
                    )


@pytest.fixture(scope="module")
def eager_rows() -> list[dict]:
    return _run(None)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("style", ["whole", "in-place", "assigned"])
def test_compiled_models_give_eagers_rows(eager_rows, style, when):
    _assert_same_rows(eager_rows, _run(style, when), rel=1e-5)


@pytest.mark.parametrize("style", ["in-place", "assigned"])
def test_attaching_before_the_first_compiled_call_resets_nothing(style, trainmon_log):
    """Blocks compiled but not yet run hold no compiled code without the hooks: nothing to reset."""
    torch._dynamo.reset()
    counters.clear()  # as in a fresh process: nothing compiled yet
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    call = _compile(model, style, "aot_eager")
    mon = TrainerMon(CONFIG).set_monitor(call, 1, optimizer)
    call(torch.randn(2, 5, 6)).pow(2).mean().backward()
    optimizer.step()
    assert mon._latest("actv")
    mon.stop()
    assert not [r for r in trainmon_log.records if "caches are reset" in r.getMessage()]


def test_attention_features_alone_attached_after_compile_give_eagers_rows():
    """The attention features' forward hooks are module hooks too: attached after the first
    compiled call, with no other module hook to recompile for, they still run."""
    config = {key: CONFIG[key] for key in ("recording_l2_features", "l2_targets", "sa_order", "format")}
    eager_rows, compiled_rows = _run(None, config=config), _run("in-place", "after", config=config)
    assert all(len(rows["attention_hook"]) == 2 for rows in eager_rows), eager_rows
    _assert_same_rows(eager_rows, compiled_rows, rel=1e-5, prefixes=("attention_hook", "linear_hook"))


@pytest.mark.parametrize("device", INDUCTOR_DEVICES)
def test_inductor_gives_eagers_rows_within_float_tolerance(eager_rows, device):
    # inductor's own kernels (softmax, GELU, fused matmuls) round differently, and the differences
    # grow through the blocks: a mean that cancels to 0.16 differs in its fifth digit, and the
    # sign of a gradient element near zero may flip, which moves mg_direction's share of agreeing
    # signs by a whole element (compared with aot_eager above, which rounds as eager does)
    eager_rows = eager_rows if device == "cpu" else _run(None, device=device)
    compiled = _run("assigned", "before", backend="inductor", device=device)
    prefixes = tuple(p for p in PREFIXES if p != "other")
    _assert_same_rows(eager_rows, compiled, rel=1e-3, abs_tol=1e-4, prefixes=prefixes)


def test_graph_breaks_only_on_collected_steps_and_only_the_monitors_own():
    """Steps 0 and 2 are collected (step_interval 2): compiling the collected variant breaks the
    graph at each hooked call, by the monitor's eager body only; compiling the variant of the
    steps in between breaks nothing; after both exist nothing compiles again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon(CONFIG).set_monitor(model, 1, optimizer)
    call = _compile(model, "assigned", "aot_eager")
    breaks, compiled = [], []
    for _ in range(6):
        counters.clear()
        call(torch.randn(2, 5, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        breaks.append(dict(counters["graph_break"]))
        compiled.append(counters["frames"].get("total", 0))
    mon.stop()
    assert breaks[0], "no graph break on a collected step: the hooks did not run"
    assert all("torch.compiler.disable" in reason for reason in breaks[0]), list(breaks[0])
    # each compiled block runs the hooks of seven modules (itself and six inside), a pre-hook
    # and a hook each, and its attention module's l2 hook: at most one break for each (19 of
    # the 30 with torch 2.13)
    hooked_calls = len(model.blocks) * (7 * 2 + 1)
    assert sum(breaks[0].values()) <= hooked_calls, (sum(breaks[0].values()), hooked_calls)
    assert breaks[1] == {}, f"graph breaks on a step that is not collected: {list(breaks[1])}"
    assert compiled[1] > 0, "the step that is not collected did not compile its own variant"
    assert all(not b for b in breaks[2:]) and not any(compiled[2:]), (breaks, compiled)
