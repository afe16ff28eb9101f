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


class Checkpointed(torch.nn.Module):
    """A block run under activation checkpointing (torchtitan wraps, then compiles each block):
    torch.compile traces its body as a higher-order op, which refuses any store of Python state."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.fixture(autouse=True)
def _no_compiled_code_seen_yet(monkeypatch):
    """As in a fresh process: no compiled code has run the monitor's hooks (a process-wide note)."""
    monkeypatch.setattr("adapters.torch.compiled.COMPILED_CODE.ran_hooks", False)


def _compile(model: Net, style: str, backend: str) -> torch.nn.Module:
    """The module to call: the model compiled as a whole, or the model with compiled blocks
    (``checkpointed``: each checkpointed, then compiled)."""
    if style == "whole":
        return torch.compile(model, backend=backend)
    for i, block in enumerate(model.blocks):
        if style == "in-place":
            block.compile(backend=backend)
        elif style == "checkpointed":
            model.blocks[i] = torch.compile(Checkpointed(block), backend=backend)
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


def test_attention_features_alone_attached_after_compile_give_eagers_rows():
    """The attention features' forward hooks are module hooks too: attached after the first
    compiled call, alone, they still see every call."""
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


def _graphs_run_per_step(monitored: bool, style: str) -> tuple[list[int], list[dict], list[int]]:
    """Per step of six (step_interval 2: steps 0, 2 and 4 collected): how many compiled graphs ran
    (a backend that counts its calls), dynamo's graph breaks, and the frames it compiled."""
    from torch._dynamo.backends.registry import lookup_backend

    runs = {"n": 0}

    def counting_backend(graph, example_inputs):
        compiled = lookup_backend("aot_eager")(graph, example_inputs)

        def run(*args):
            runs["n"] += 1
            return compiled(*args)

        return run

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon(CONFIG).set_monitor(model, 1, optimizer) if monitored else None
    call = _compile(model, style, counting_backend)
    ran, breaks, compiled = [], [], []
    for _ in range(6):
        counters.clear()
        before = runs["n"]
        call(torch.randn(2, 5, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ran.append(runs["n"] - before)
        breaks.append(dict(counters["graph_break"]))
        compiled.append(counters["frames"].get("total", 0))
    if mon is not None:
        mon.stop()
    return ran, breaks, compiled


@pytest.mark.parametrize("style", ["whole", "in-place", "checkpointed"])
def test_steps_not_collected_run_the_unmonitored_compiled_code_and_collected_ones_run_eagerly(style):
    """The monitor's hooks leave nothing in compiled code: no graph break on any step, nothing
    compiled after the first uncollected step, and the steps that are not collected run exactly
    the compiled graphs of an unmonitored model; collected steps run eagerly (no compiled graph).
    The monitor is attached before the model is compiled. Checkpointed blocks: a hook's note
    that compiled code ran it, stored inside the checkpoint, failed each trace, and the blocks
    ran eagerly on every step."""
    plain, plain_breaks, _ = _graphs_run_per_step(False, style)
    ran, breaks, compiled = _graphs_run_per_step(True, style)
    assert not any(plain_breaks) and plain[1] > 0, (plain, plain_breaks)
    assert not any(breaks), f"graph breaks: {breaks}"
    assert ran[1::2] == plain[1::2], f"compiled graphs run per step: {ran}, unmonitored {plain}"
    # a whole model compiled after set_monitor runs its first step compiled, unmeasured (said);
    # compiled blocks are found at the first forward
    first = plain[0] if style == "whole" else 0
    assert ran[0::2] == [first, 0, 0], f"compiled graphs run on collected steps: {ran}"
    assert not any(compiled[2:]), f"frames compiled per step: {compiled}"


def _tensor_parallel_worker(rank: int, world_size: int, workdir: str) -> None:
    """A tensor-parallel block (column- then row-parallel) compiled as a whole, beside an eager
    twin from the same seed; activations collected every other step."""
    from tests.adapters.torch.distributed import save_result
    from tests.adapters.torch.test_tensor_parallel import LAYOUTS, _parallel

    layout = LAYOUTS["tp-accumulation"]  # dp 1, tp 2
    config = {"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "api", "step_interval": 2}
    rows = {}
    for style in ("eager", "compiled"):
        torch._dynamo.reset()
        model, _ = _parallel(layout)
        optimizer = torch.optim.AdamW(model.parameters())
        if style == "compiled":  # before set_monitor: a whole model compiled after is learnt of late
            model.compile(backend="aot_eager")
        mon = TrainerMon(config).set_monitor(model, 1, optimizer)
        rows[style] = []
        for step in range(4):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            rows[style].append({prefix: mon._latest(prefix) for prefix in ("actv", "actv_grad")})
        mon.stop()
    graphs = counters["stats"]["unique_graphs"]
    save_result(workdir, rank, {**rows, "breaks": sum(counters["graph_break"].values()), "graphs": graphs})


@pytest.mark.distributed
def test_a_compiled_tensor_parallel_block_gives_eagers_activations(tmp_path):
    """Hooks on tensor-parallel modules inside compiled code: the collected steps give the eager
    twin's rows, the others compile and run without a graph break."""
    from tests.adapters.torch.distributed import run_ranks

    for result in run_ranks(_tensor_parallel_worker, 2, str(tmp_path)):
        assert result["breaks"] == 0 and result["graphs"] > 0, result
        _assert_same_rows(
            result["eager"][0::2], result["compiled"][0::2], rel=1e-5, prefixes=("actv", "actv_grad")
        )


def _compiled_then_sharded_worker(rank: int, world_size: int, workdir: str) -> None:
    """torchtitan's order: each block compiled (assigned), then ``fully_shard`` per block and on
    the model, which makes each block's class ``FSDPOptimizedModule``; activations every other
    step, beside an eager twin."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.adapters.torch.distributed import save_result

    config = {
        "xy_distribution": True,
        "all_xy": True,
        "ops": ["norm", "max"],
        "format": "api",
        "step_interval": 2,
    }
    rows = {}
    for style in ("eager", "compiled"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        if style == "compiled":
            _compile(model, "assigned", "aot_eager")
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        mon = TrainerMon(config).set_monitor(model, 1, optimizer)
        rows[style] = []
        for step in range(4):
            x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            rows[style].append({prefix: mon._latest(prefix) for prefix in ("actv", "actv_grad")})
        mon.stop()
    save_result(workdir, rank, {**rows, "classes": sorted({type(b).__name__ for b in model.blocks})})


@pytest.mark.distributed
def test_blocks_compiled_then_sharded_give_eagers_activations_from_the_first_step(tmp_path):
    """fully_shard makes a compiled block's class FSDPOptimizedModule, which the class's name
    alone did not tell to be compiled: the first collected step ran compiled, its blocks'
    activation rows missing."""
    from tests.adapters.torch.distributed import run_ranks

    for result in run_ranks(_compiled_then_sharded_worker, 2, str(tmp_path)):
        assert result["classes"] == ["FSDPOptimizedModule"], result["classes"]
        assert any("blocks.1.fc2" in tag for tag in result["compiled"][0]["actv"])
        _assert_same_rows(
            result["eager"][0::2], result["compiled"][0::2], rel=1e-5, prefixes=("actv", "actv_grad")
        )


def test_steps_that_measure_run_eagerly_and_the_stance_found_is_put_back():
    """Two monitors of one process (activations every 2nd and every 3rd step): torch.compile's
    stance is "force_eager" on the steps either collects, the user's own on the others and after
    both stopped."""
    from torch._dynamo import eval_frame

    xy = {"xy_distribution": True, "format": "api"}
    models = [_compile(Net(), "in-place", "aot_eager"), _compile(Net(), "in-place", "aot_eager")]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    seen = []
    with torch.compiler.set_stance("eager_on_recompile"):
        monitors = [
            TrainerMon({**xy, "step_interval": interval}).set_monitor(model, 1, optimizer)
            for interval, model, optimizer in zip((2, 3), models, optimizers)
        ]
        for _ in range(7):
            seen.append(eval_frame._stance.stance)
            for model, optimizer in zip(models, optimizers):
                model(torch.randn(2, 5, 6)).pow(2).mean().backward()
                optimizer.step()
        for mon in monitors:
            mon.stop()
        after = eval_frame._stance.stance
    eager, found = "force_eager", "eager_on_recompile"
    assert seen == [eager, found, eager, eager, eager, found, eager], seen
    assert after == found


def test_an_eager_model_leaves_the_stance_alone():
    """A model without compiled modules measures without touching torch.compile's stance (other
    compiled code of the process stays compiled)."""
    from torch._dynamo import eval_frame

    torch._dynamo.reset()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "format": "api"}).set_monitor(model, 1, optimizer)
    model(torch.randn(2, 5, 6)).pow(2).mean().backward()
    optimizer.step()
    assert eval_frame._stance.stance == "default" and mon._latest("actv")
    mon.stop()


@pytest.mark.parametrize("compiled", ["whole model", "forward method"])
def test_compiled_code_met_only_when_it_runs_costs_its_first_step_and_says_so(trainmon_log, compiled):
    """A model compiled as a whole after set_monitor, or whose forward method is compiled: the
    monitor learns of the compiled code when it first runs the hooks. That step's activations are
    missing (said once); collected steps after it run eagerly with every row, also in a later
    collection (stop and start): the knowledge is the process's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "all_xy": True, "format": "api"}).set_monitor(
        model, 1, optimizer
    )
    call = model
    if compiled == "whole model":
        call = torch.compile(model, backend="aot_eager")
    else:
        model.forward = torch.compile(model.forward, backend="aot_eager")
    got = []
    for step in range(4):
        if step == 2:
            mon.stop()
            mon.start()
        call(torch.randn(2, 5, 6)).pow(2).mean().backward()
        optimizer.step()
        got.append(len(mon._latest("actv")))
    mon.stop()
    said = [
        r.getMessage()
        for r in trainmon_log.records
        if "compiled code ran the monitor's hooks" in r.getMessage()
    ]
    rows = len(_run(None, config={"xy_distribution": True, "all_xy": True, "format": "api"})[0]["actv"])
    first = 0 if compiled == "whole model" else 2  # the root's input and output: its hooks run eagerly
    assert got == [first, rows, rows, rows], got
    assert len(said) == 1, said
