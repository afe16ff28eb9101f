"""Promise 7: under torch.compile the monitor records what eager records, also when attached to a
model that already ran compiled.

The model (an MLP: no dropout, whose random masks differ between eager and compiled code) is
compiled with ``torch.compile`` and monitored; every data type's rows (tags) and values are
compared with an eager run from the same seeds. The ``aot_eager`` backend runs the same kernels as
eager, so values agree to rounding; one test runs the default CPU backend (inductor, which
generates and compiles C++: about 15-30 s here) and compares within float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from monitor import TrainerMon
from tests.reliability.training import MLP, make_batches

BACKEND = "aot_eager"
STEPS = 4
GRAD_ACC = 2
OPS = ["min", "max", "norm", "mean"]
KINDS = {
    "wg": ({"wg_distribution": True}, ["grad_unreduced", "grad_reduced"]),
    "param": ({"param_distribution": True}, ["param_origin", "param_updated"]),
    "mv": ({"mv_distribution": True}, ["exp_avg", "exp_avg_sq"]),
    "mg_direction": ({"mg_direction": True}, ["other"]),
    "xy": ({"xy_distribution": True, "all_xy": True}, ["actv", "actv_grad"]),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code and counters of one test never leak into the next."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _monitored(config: dict, compiled: str | None, backend: str = BACKEND, fullgraph: bool = False) -> dict:
    """Per step, per data type: ``{tag: {op: value}}``.

    compiled: None (eager), "before" (set_monitor on the compiled model before its first call, the
    usual order) or "after" (the compiled model has already run a step when set_monitor is called).
    """
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    target = model if compiled is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    if compiled == "after":
        target(torch.ones(5, 6)).pow(2).mean().backward()
        optimizer.zero_grad()
    mon = TrainerMon({"format": "api", "ops": OPS, **config})
    mon.set_monitor(target, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    prefixes = {p for _, ps in KINDS.values() for p in ps}
    steps = []
    for batches in make_batches(STEPS, GRAD_ACC, seed=3):
        for x in batches:
            target(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({p: mon._core.latest.latest(p) for p in prefixes})
    mon.stop()
    return {"steps": steps}


def _assert_same(eager: dict, compiled: dict, prefixes: list[str], rel: float) -> None:
    for step, (want, got) in enumerate(zip(eager["steps"], compiled["steps"], strict=True)):
        for prefix in prefixes:
            assert want[prefix], f"eager recorded no {prefix}"
            assert sorted(got[prefix]) == sorted(want[prefix]), f"step {step} {prefix}: other rows"
            for tag, row in want[prefix].items():
                scale = rel * abs(row["norm"]) + 1e-12  # rounding is relative to the tensor's size
                for op, value in row.items():
                    assert got[prefix][tag][op] == pytest.approx(value, rel=rel, abs=scale), (step, tag, op)


@pytest.mark.parametrize("kind", ["wg", "param", "mv", "mg_direction"])
def test_a_compiled_model_gives_the_eager_rows_and_values(kind):
    config, prefixes = KINDS[kind]
    _assert_same(_monitored(config, None), _monitored(config, "before"), prefixes, rel=1e-6)


def test_a_compiled_model_keeps_the_eager_names_unsquashed():
    config = {"wg_distribution": True, "squash_name": False}
    _assert_same(_monitored(config, None), _monitored(config, "before"), ["grad_reduced"], rel=1e-6)


def test_activations_of_a_compiled_model_match_eager():
    config, prefixes = KINDS["xy"]
    _assert_same(_monitored(config, None), _monitored(config, "before"), prefixes, rel=1e-6)


def test_attaching_to_an_already_compiled_model_records_its_activations(trainmon_log):
    """Compiled code never runs module hooks added after it was compiled: the monitor makes it
    compile again once, and says so."""
    config, prefixes = KINDS["xy"]
    seen = len(trainmon_log.records)
    compiled = _monitored(config, "after")
    said = [r.getMessage() for r in trainmon_log.records[seen:] if "compiles again" in r.getMessage()]
    assert len(said) == 1, said
    _assert_same(_monitored(config, None), compiled, prefixes, rel=1e-6)


def test_code_compiled_with_fullgraph_trains_on_with_what_is_read_outside_it(trainmon_log, monkeypatch):
    """fullgraph=True makes any graph break an error, and measuring inside compiled code needs
    one: the module hooks traced there measure nothing (said once) instead of failing the run;
    gradients and parameters, read outside compiled code, are eager's, so training is too."""
    monkeypatch.setattr("adapters.torch.compiled._said_fullgraph", False)
    config = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True}
    compiled = _monitored(config, "before", fullgraph=True)
    assert not torch._dynamo.utils.counters["graph_break"]
    _assert_same(_monitored(config, None), compiled, [*KINDS["wg"][1], *KINDS["param"][1]], rel=1e-6)
    assert not any(step["actv"] or step["actv_grad"] for step in compiled["steps"])
    said = [r.getMessage() for r in trainmon_log.records if "fullgraph=True" in r.getMessage()]
    assert len(said) == 1, said


def _compiled_graphs_per_step(config: dict) -> tuple[list[int], list[int]]:
    """Per step of a compiled, monitored model: dynamo's count of compiled graphs so far, and how
    many times compiled graphs ran in that step (a backend that counts its calls)."""
    from torch._dynamo.backends.registry import lookup_backend

    runs = {"n": 0}

    def counting_backend(graph, example_inputs):
        compiled = lookup_backend(BACKEND)(graph, example_inputs)

        def run(*args):
            runs["n"] += 1
            return compiled(*args)

        return run

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend=counting_backend)
    mon = TrainerMon({"format": "api", "ops": OPS, **config})
    mon.set_monitor(compiled, grad_acc_steps=GRAD_ACC, optimizer=optimizer)
    graphs, ran = [], []
    for batches in make_batches(6, GRAD_ACC, seed=3):
        before = runs["n"]
        for x in batches:
            compiled(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        ran.append(runs["n"] - before)
    mon.stop()
    return graphs, ran


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_monitor_does_not_make_the_compiled_model_recompile_or_fall_back(kind):
    graphs, ran = _compiled_graphs_per_step(KINDS[kind][0])
    assert graphs[1] == graphs[-1], f"compiled graphs after each step: {graphs}"  # no recompiles
    assert all(n >= GRAD_ACC for n in ran), f"compiled graphs run per step: {ran}"  # still compiled


@pytest.mark.slow
def test_the_default_cpu_backend_gives_the_eager_values():
    """inductor (C++ code generated and compiled here); float32 kernels differ in rounding only."""
    config = {
        "wg_distribution": True,
        "param_distribution": True,
        "mv_distribution": True,
        "mg_direction": True,
    }
    prefixes = [p for kind in ("wg", "param", "mv", "mg_direction") for p in KINDS[kind][1]]
    eager = _monitored(config, None)
    compiled = _monitored(config, "before", backend="inductor")
    _assert_same(eager, compiled, prefixes, rel=1e-3)
