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
def _fresh_dynamo(monkeypatch):
    """Compiled code, counters and stance of one test never leak into the next."""
    monkeypatch.setattr("adapters.torch.compiled.COMPILED_CODE.ran_hooks", False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch.compiler.set_stance("default")


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
    """Compiled code never runs module hooks added after it was compiled; the collected steps run
    eagerly, so the hooks see every call, with nothing compiled again."""
    config, prefixes = KINDS["xy"]
    compiled = _monitored(config, "after")
    _assert_same(_monitored(config, None), compiled, prefixes, rel=1e-6)


def test_code_compiled_with_fullgraph_gives_the_eager_activations(trainmon_log):
    """fullgraph=True makes any graph break an error: the monitor's hooks leave nothing in the
    compiled code, which the steps not collected run, and collected steps run it eagerly, so
    activations are recorded there too."""
    config = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "param_distribution": True,
        "step_interval": 2,
    }
    compiled = _monitored(config, "before", fullgraph=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    prefixes = [*KINDS["wg"][1], *KINDS["param"][1], *KINDS["xy"][1]]
    _assert_same(_monitored(config, None), compiled, prefixes, rel=1e-6)
    assert not [r for r in trainmon_log.records if r.levelname == "WARNING"]


def _train_compiled(step_is: str, user_stance: str | None = None) -> tuple[list[int], list[str]]:
    """A compiled model trained with an optimizer step that is ``step_is`` "eager", "compiled", or
    "compiled with the model" (forward, backward and step compiled as one function); activations
    every other step. Per step: the activation rows written for it and torch.compile's stance seen
    at the step's start; and the stance after stop(). The user sets ``user_stance`` as step 2
    begins."""
    from torch._dynamo import eval_frame

    torch.manual_seed(0)
    model = torch.compile(MLP(), backend=BACKEND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon({"xy_distribution": True, "format": "api", "ops": OPS, "step_interval": 2})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    @torch.compile(backend=BACKEND)
    def update() -> None:
        optimizer.step()

    @torch.compile(backend=BACKEND)
    def train_step(x: torch.Tensor) -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()

    rows, stances = [], []
    for step, (x,) in enumerate(make_batches(6, 1, seed=3)):
        if step == 2 and user_stance is not None:
            torch.compiler.set_stance(user_stance)
        stances.append(eval_frame._stance.stance)
        if step_is == "compiled with the model":
            train_step(x)
        else:
            model(x).pow(2).mean().backward()
            if step_is == "compiled":
                update()
            else:
                optimizer.step()
        optimizer.zero_grad()
        record = mon._core.latest._latest.get("actv")  # the latest collected step's record
        rows.append(len(record.as_dict()) if record is not None and record.step == step else 0)
    mon.stop()
    stances.append(eval_frame._stance.stance)
    torch.compiler.set_stance("default")
    return rows, stances


@pytest.mark.parametrize("step_is", ["compiled", "compiled with the model"])
def test_a_compiled_optimizer_step_trains_and_collected_steps_record_activations(step_is):
    """The monitor's step end runs inside the compiled optimizer step: its switch of torch.compile's
    stance runs eagerly there (traced, it would stop the training)."""
    rows, stances = _train_compiled(step_is)
    assert all(rows[0::2]) and not any(rows[1::2]), rows
    assert stances == ["force_eager", "default"] * 3 + ["default"], stances


def test_a_stance_the_user_sets_holds_on_the_steps_the_monitor_does_not_measure(trainmon_log, monkeypatch):
    """The user's stance, set within a collected step, replaces the monitor's there (that step's
    activations inside compiled code are missing, said once); it stays on the steps not collected,
    and after stop(); the monitor sets its own again for the steps it measures."""
    monkeypatch.setattr("adapters.torch.compiled.Stance._said_replaced", False)
    rows, stances = _train_compiled("eager", user_stance="fail_on_recompile")
    assert rows[0] and rows[4] and not any(rows[1:4]) and not rows[5], rows
    user = "fail_on_recompile"
    assert stances == ["force_eager", "default", user, user, "force_eager", user, user], stances
    said = [r.getMessage() for r in trainmon_log.records if "stance was changed" in r.getMessage()]
    assert len(said) == 1, said


def test_a_monitor_dropped_without_stop_gives_the_stance_back():
    import gc

    from torch._dynamo import eval_frame

    model = torch.compile(MLP(), backend=BACKEND)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"xy_distribution": True, "format": "api"}).set_monitor(model, 1, optimizer)
    assert eval_frame._stance.stance == "force_eager"
    core = mon._session.collection.core  # its writer thread, ended below for the tests after this
    del mon, model, optimizer
    gc.collect()
    assert eval_frame._stance.stance == "default"
    core.close()


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


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "xy"])
def test_the_monitor_does_not_make_the_compiled_model_recompile_or_fall_back(kind):
    graphs, ran = _compiled_graphs_per_step(KINDS[kind][0])
    assert graphs[1] == graphs[-1], f"compiled graphs after each step: {graphs}"  # no recompiles
    assert all(n >= GRAD_ACC for n in ran), f"compiled graphs run per step: {ran}"  # still compiled


def test_activations_make_collected_steps_alone_run_eagerly():
    """Module hooks measure on collected steps only, which run the compiled code eagerly; the
    others run it compiled, and nothing compiles again from step to step."""
    graphs, ran = _compiled_graphs_per_step({**KINDS["xy"][0], "step_interval": 2})
    assert graphs[1] == graphs[-1], f"compiled graphs after each step: {graphs}"
    assert ran[0::2] == [0, 0, 0], f"compiled graphs run on collected steps: {ran}"
    assert all(n >= GRAD_ACC for n in ran[1::2]), f"compiled graphs run per step: {ran}"


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


def test_a_fullgraph_model_trains_on_when_monitoring_ends_inside_a_step():
    """collect_times ends monitoring inside the optimizer's post-hook, whose hooks then go at the
    next forward; a model compiled as a whole with fullgraph=True runs that forward's cleanup in
    compiled code, where removing hooks cannot be traced: they stay, inert, and the run goes on."""
    model = torch.compile(MLP(), backend=BACKEND, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon({"wg_distribution": True, "collect_times": 1, "format": "api"})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    for (x,) in make_batches(4, 1, seed=3):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.stop()
    assert mon._latest("grad_reduced")


def _call_stacks(tmp_path, compiled: bool) -> list[str]:
    """stack_info.csv's module names after three steps of the MLP, compiled as a whole but given
    to set_monitor uncompiled (as the Hugging Face Trainer gives it), or eager."""
    import csv
    import glob

    torch.manual_seed(0)
    model = MLP()
    call = torch.compile(model, backend=BACKEND) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path / ("compiled" if compiled else "eager")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONITOR_OUTPUT_DIR", str(out))
        mon = TrainerMon({"stack_info": True, "wg_distribution": True, "format": "csv"})
        mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        for (x,) in make_batches(3, 1, seed=3):
            call(x).pow(2).mean().backward()
            optimizer.step()
        mon.stop()
    (path,) = glob.glob(str(out / "**" / "stack_info.csv"), recursive=True)
    with open(path, newline="") as f:
        return [row["module_name"] for row in csv.DictReader(f)]


def test_call_stacks_are_written_when_compiled_code_ran_the_first_step(tmp_path):
    """Traced at the first step, the stack hooks record nothing; the file waits for a step that
    records them (run eagerly), instead of being written empty for good."""
    eager = _call_stacks(tmp_path, compiled=False)
    assert eager and _call_stacks(tmp_path, compiled=True) == eager
