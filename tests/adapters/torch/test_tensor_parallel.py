"""Tensor parallelism with FSDP2 on a (dp 2, tp 2) mesh of four real gloo ranks, against an
unsharded replica.

``up`` is column-parallel, ``down`` row-parallel (its bias replicated over tp), ``norm`` is left
whole by tensor parallelism, so FSDP2 shards it over the dp sub-mesh only; ``down`` has 7 outputs,
so dp shards are uneven. The two tp ranks of a dp rank see that dp rank's batch. References: an
unsharded replica's gradient on the dp rank's batches (unreduced), its mean over dp ranks
(reduced), its own AdamW (parameters, moments). Whole values (``shard_reduce``) must equal the
replica's on every rank (unreduced gradients: its dp rank's, on each of its tp ranks); pieces
written with their element counts must merge to them with each element counted once (no row
from a replica); without ``shard_reduce`` unreduced rows are this rank's tensor-parallel piece
of its dp rank's gradient and activations of the column-parallel module are this rank's columns
of the replica's; with it every activation and activation gradient of
the tensor-parallel modules, and of the modules they feed, is the replica's whole tensor.

Tensor parallelism alone, with sequence parallelism, on a 1-D mesh of two ranks: ``norm`` is
``SequenceParallel`` (each rank normalises its half of the sequence), so its gradient comes out
as a partial sum over the tp ranks, which every gradient row must complete (one rank's partial
sum is not its gradient); ``up`` is column-parallel on the gathered sequence, ``down``
row-parallel back to sequence shards. The replica sees the whole sequence.

Sequence parallelism on a residual block, ``h = mix(inp(x)); h + down(relu(up(norm(h))))``:
``inp`` is ``SequenceParallel`` handing on plain sequence parts, ``mix`` a plain module on them:
its rows are pieces too (``norm`` is made of its output), and ``norm``'s input gradient is the
whole dL/dh, the residual's share included.

Tensor parallelism alone on a residual block, ``h + down(relu(up(h)))`` after a plain ``inp``: the
column-parallel ``up``'s input gradient is the whole dL/dh, the residual branch's share included,
as the replica's (tensor parallelism hands ``up`` a DTensor made from h, whose own gradient is
``up``'s share alone).

Tensor parallelism alone with two micro-batches a step: the unreduced rows are the step's sum of
both micro-batches' gradients (the replica's accumulated gradient), activations are the first
micro-batch's.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.adapters.torch.helpers import (
    ALL_OPS,
    assert_stats_close,
    flat_values,
    latest_rows,
    merge_piece_rows,
    replica_references,
)
from tests.shared_configs import DATA_TYPES, STEP_PREFIXES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 3
#: tensor-parallel matmuls sum in another order than the replica's (a replica counted twice, or
#: one shard's norm, is off by 41% or more). Such differences would carry into later steps (after
#: Adam's first update, m / sqrt(v) = +-1, an element whose gradient is near zero can move the
#: other way): the replica therefore restarts each step from the parallel model's parameters and
#: moments (``_follow``), and every step is compared on its own.
TOLERANCE = 1e-3
PREFIXES = STEP_PREFIXES
CONFIG = {**DATA_TYPES["all"], "ops": ALL_OPS, "format": "api"}
ACTIVATIONS = {"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "api"}
SPECTRAL = {"recording_l2_features": True, "shard_reduce": True, "format": "api"}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 7)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


class SequenceBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


class SequenceResidualBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.mix = torch.nn.Tanh()
        self.norm = torch.nn.LayerNorm(6)
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.inp(x))
        return h + self.down(torch.relu(self.up(self.norm(h))))


class ResidualBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return h + self.down(torch.relu(self.up(h)))


@dataclass(frozen=True)
class Layout:
    """A parallel layout: ranks, the mesh's dp and tp sizes, and whether tp shards the sequence."""

    dp: int
    tp: int
    sequence_parallel: bool = False
    micro_batches: int = 1
    residual: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp


LAYOUTS = {
    "fsdp2-tp-2d": Layout(dp=2, tp=2),
    "tp-sequence-parallel": Layout(dp=1, tp=2, sequence_parallel=True),
    "tp-accumulation": Layout(dp=1, tp=2, micro_batches=2),
    "tp-residual": Layout(dp=1, tp=2, residual=True),
    "tp-sequence-residual": Layout(dp=1, tp=2, sequence_parallel=True, residual=True),
}


def _parallel(layout: Layout) -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    if layout.sequence_parallel:
        model = SequenceResidualBlock() if layout.residual else SequenceBlock()
        with torch.no_grad():  # not LayerNorm's initial ones and zeros, which hide a wrong sum
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.uniform_(-0.5, 0.5)
        replica = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (layout.tp,), mesh_dim_names=("tp",))
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
        if layout.residual:
            plan["inp"] = SequenceParallel(use_local_output=True)
        parallelize_module(model, mesh, plan)
        return model, replica
    model = ResidualBlock() if layout.residual else Block()
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout.dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model, replica


def _watch_replica(replica: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Hooks that keep each submodule's first input and its output (gradients retained), by row
    name (``up.input``); filled by the replica's next forward."""
    kept: dict[str, torch.Tensor] = {}

    def hook(name, module, args, output):
        for direction, tensor in (("input", args[0]), ("output", output)):
            if tensor.requires_grad:
                tensor.retain_grad()
            kept[f"{name}.{direction}"] = tensor

    for name, module in replica.named_children():
        module.register_forward_hook(functools.partial(hook, name))
    return kept


def _whole_activations(kept: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The replica's activations and their gradients by row name (``up.output_grad``)."""
    out = {}
    for key, tensor in kept.items():
        out[key] = flat_values(tensor)
        if tensor.grad is not None:
            out[f"{key}_grad"] = flat_values(tensor.grad)
    return out


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _batch(layout: Layout, dp_rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """The whole batch of a dp rank's micro-batch (the replica's input)."""
    shape = (2, 4, 6) if layout.sequence_parallel else (4, 6)
    seed = 1000 * step + 100 * micro + dp_rank
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _model_input(layout: Layout, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """What this rank's model sees: its dp rank's batch, or its part of the sequence."""
    batch = _batch(layout, rank // layout.tp, step, micro)
    if not layout.sequence_parallel:
        return batch
    length = batch.shape[1] // layout.tp
    return batch[:, (rank % layout.tp) * length : (rank % layout.tp + 1) * length]


def _loss(output: torch.Tensor, layout: Layout, step: int) -> torch.Tensor:
    """Mean square over the whole batch's outputs: the sequence parts' losses add up to it."""
    rows = _batch(layout, 0, step).numel() // 6  # input features: 6
    return output.pow(2).sum() / (rows * output.shape[-1])


def _train_step(model, optimizer, layout: Layout, rank: int, step: int) -> None:
    for micro in range(layout.micro_batches):
        _loss(model(_model_input(layout, rank, step, micro)), layout, step).backward()
    optimizer.step()
    optimizer.zero_grad()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective of its mesh), or the plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _follow(replica, replica_optimizer, model, optimizer) -> None:
    """The replica takes the parallel model's parameters and Adam moments after a step, so that
    the next step is compared from the same state."""
    with torch.no_grad():
        for mine, theirs in zip(replica.parameters(), model.parameters()):
            mine.copy_(_whole(theirs))
            for key in ("exp_avg", "exp_avg_sq"):
                replica_optimizer.state[mine][key].copy_(_whole(optimizer.state[theirs][key]))


def _worker(rank: int, world_size: int, workdir: str, layout: Layout) -> None:
    from monitor import TrainerMon

    dp_rank, tp_rank = divmod(rank, layout.tp)
    model, replica = _parallel(layout)
    optimizer, replica_optimizer = _optimizer(model.parameters()), _optimizer(replica.parameters())
    micro_batches = layout.micro_batches
    monitors = {
        "merged": TrainerMon({**CONFIG, "shard_reduce": True}).set_monitor(model, micro_batches, optimizer),
        "pieces": TrainerMon(CONFIG).set_monitor(model, micro_batches, optimizer),
    }
    activations = TrainerMon(ACTIVATIONS).set_monitor(model, micro_batches, optimizer)
    whole = TrainerMon({**ACTIVATIONS, "shard_reduce": True}).set_monitor(model, micro_batches, optimizer)
    spectral = TrainerMon(SPECTRAL).set_monitor(model, micro_batches, optimizer)
    kept = _watch_replica(replica)
    try:  # some ranks unmonitored would leave the others waiting in the partial sums' collective
        TrainerMon({**CONFIG, "module_ranks": [0]}).set_monitor(model, micro_batches, optimizer)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    steps = []
    for step in range(STEPS):
        replica.zero_grad()
        batch = _batch(layout, dp_rank, step)
        if layout.sequence_parallel:
            up_input = replica.norm(replica.mix(replica.inp(batch)) if layout.residual else batch)
        else:
            up_input = replica.inp(batch) if layout.residual else batch
        hidden = replica.up(up_input)  # column-parallel: this rank holds columns of it
        columns = hidden.shape[-1] // layout.tp
        up_output = flat_values(hidden[..., tp_rank * columns : (tp_rank + 1) * columns])
        _loss(replica(batch), layout, step).backward()
        first_activations = _whole_activations(kept)  # the rows' micro-step 0
        for micro in range(1, micro_batches):
            _loss(replica(_batch(layout, dp_rank, step, micro)), layout, step).backward()
        local = [p.grad.clone() for p in replica.parameters()]
        reduced = [g.clone() for g in local]
        for g in reduced:  # every dp rank's gradient is on its TP ranks: the mean over all ranks
            dist.all_reduce(g)
            g /= layout.world
        norms = {  # the replica's weights before this step's update, as the monitor reads them
            name: [torch.linalg.matrix_norm(module.weight, 2).item(), module.weight.norm().item()]
            for name, module in replica.named_children()
            if isinstance(module, torch.nn.Linear)
        }
        ref = replica_references(replica, replica_optimizer, local, reduced)
        _train_step(model, optimizer, layout, rank, step)
        _follow(replica, replica_optimizer, model, optimizer)
        got = {key: {prefix: mon._latest(prefix) for prefix in PREFIXES} for key, mon in monitors.items()}
        up_row = activations._latest("actv")[f"0:up.output:0/rank{rank}/actv"]
        merged = {prefix: whole._latest(prefix) for prefix in ("actv", "actv_grad")}
        measured = {
            key.split(":")[1].split(".")[0]: row for key, row in spectral._latest("linear_hook").items()
        }
        steps.append(
            {
                "ref": ref,
                "got": got,
                "up_output": [up_output, up_row],
                "activations": [first_activations, merged],
                "spectral": [norms, measured],
            }
        )
    backends = sorted({type(mon._session.backend).__name__ for mon in monitors.values()})
    trained = [_local(p).detach().clone() for p in model.parameters()]
    for mon in (*monitors.values(), activations, whole, spectral):
        mon.stop()
    plain, _ = _parallel(layout)
    plain_optimizer = _optimizer(plain.parameters())
    for step in range(STEPS):
        _train_step(plain, plain_optimizer, layout, rank, step)
    identical = all(torch.equal(a, _local(p)) for a, p in zip(trained, plain.parameters()))
    save_result(
        workdir, rank, {"steps": steps, "backends": backends, "identical": identical, "refused": refused}
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local piece; a parameter tensor parallelism left whole, itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def _check_unreduced(layout: Layout, step: int, per_rank: list[dict]) -> None:
    """Per dp rank: whole rows (every row with shard_reduce) equal its gradient; tensor-parallel
    pieces merge to it."""
    for dp_rank in range(layout.dp):
        ranks = [dp_rank * layout.tp + tp for tp in range(layout.tp)]
        want = per_rank[ranks[0]]["steps"][step]["ref"]["grad_unreduced"]
        for name, values in want.items():
            for key in ("merged", "pieces"):
                rows = [
                    latest_rows(per_rank[r]["steps"][step]["got"][key], "grad_unreduced")[name] for r in ranks
                ]
                what = f"step {step} dp {dp_rank} {key} grad_unreduced {name}"
                if key == "merged":  # shard_reduce: whole on every tp rank
                    assert all(row["numel"] == len(values) and not row["partial"] for row in rows), what
                if "numel" not in rows[0] or not rows[0]["partial"]:  # whole on every tp rank
                    for row in rows:
                        assert_stats_close(row, np.array(values), what=what, rel=TOLERANCE)
                    continue
                assert all(row["partial"] for row in rows), what
                whole = merge_piece_rows(rows)
                assert whole["numel"] == len(values), what
                assert_stats_close(whole, np.array(values), what=what, rel=TOLERANCE)


def _check_activations(step: int, rank: int, result: dict) -> None:
    """Without shard_reduce the column-parallel output is this rank's columns; with it every row of
    up, down and norm is the replica's whole tensor (activation gradients included)."""
    want, row = result["steps"][step]["up_output"]
    assert_stats_close(row, np.array(want), what=f"step {step} rank {rank} up.output", rel=TOLERANCE)
    references, merged = result["steps"][step]["activations"]
    assert len(references) >= 10, sorted(references)  # inputs, outputs and their gradients
    for key, values in references.items():
        prefix = "actv_grad" if key.endswith("_grad") else "actv"
        row = merged[prefix][f"0:{key}:0/rank{rank}/{prefix}"]
        what = f"step {step} rank {rank} {key} (shard_reduce)"
        assert_stats_close(row, np.array(values), what=what, rel=TOLERANCE)


def _check_spectral_norms(step: int, rank: int, result: dict) -> None:
    """Weights held in pieces (column- and row-parallel, FSDP2 rows): with shard_reduce each
    rank's spectral norm and stable rank are the whole weight's, within 1% of the replica's SVD."""
    norms, measured = result["steps"][step]["spectral"]
    assert sorted(measured) == sorted(norms), (sorted(measured), sorted(norms))
    assert {"down", "up"} <= set(norms), sorted(norms)
    for name, (sigma, frobenius) in norms.items():
        row = measured[name]
        what = f"step {step} rank {rank} {name}"
        assert row["kernel_norm"] == pytest.approx(sigma, rel=0.01), what
        assert row["sr"] == pytest.approx(frobenius / sigma, rel=0.01), what


def _check_step(layout: Layout, step: int, per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):
        _check_activations(step, rank, result)
        _check_spectral_norms(step, rank, result)
    ref = per_rank[0]["steps"][step]["ref"]
    for prefix in PREFIXES:
        if prefix == "grad_unreduced":
            _check_unreduced(layout, step, per_rank)
            continue
        pieces = [latest_rows(r["steps"][step]["got"]["pieces"], prefix) for r in per_rank]
        for name, values in ref[prefix].items():
            what = f"step {step} {prefix} {name}"
            for rank, result in enumerate(per_rank):
                merged = latest_rows(result["steps"][step]["got"]["merged"], prefix)[name]
                if prefix == "other":
                    assert merged["mean"] == pytest.approx(ref["other"][name], abs=1e-12), f"{what} r{rank}"
                    continue
                assert merged["numel"] == len(values) and merged["partial"] == 0, f"{what} r{rank}"
                assert_stats_close(merged, np.array(values), what=f"{what} r{rank} merged", rel=TOLERANCE)
            rows = [p[name] for p in pieces if name in p]
            assert sum(r["numel"] for r in rows) == len(ref["param_origin"][name]), f"{what}: {rows}"
            if prefix == "other":
                n = np.array([r["numel"] for r in rows])
                share = (np.array([r["mean"] for r in rows]) * n).sum() / n.sum()
                assert share == pytest.approx(ref["other"][name], abs=1e-12), what
                continue
            assert_stats_close(merge_piece_rows(rows), np.array(values), what=f"{what} pieces", rel=TOLERANCE)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tensor_parallel_statistics_equal_an_unsharded_replica(tmp_path, name):
    layout = LAYOUTS[name]
    per_rank = run_ranks(functools.partial(_worker, layout=layout), layout.world, str(tmp_path))
    for result in per_rank:
        assert result["backends"] == ["DTensorBackend"], result["backends"]
        assert result["identical"], "training changed by the monitors"
        assert result["refused"].startswith("module_ranks: expected empty with tensor parallelism"), result
    for step in range(STEPS):
        _check_step(layout, step, per_rank)


def _failing_rank_worker(rank: int, world_size: int, workdir: str) -> None:
    """Tensor parallelism on two ranks; rank 1's activation statistics and unreduced gradients
    fail from step 1 on."""
    import logging

    import adapters.torch.activations as activations_module
    from adapters.torch.grads import UnreducedGrads
    from monitor import TrainerMon

    layout = Layout(dp=1, tp=2)
    model, _ = _parallel(layout)
    optimizer = _optimizer(model.parameters())
    config = {**ACTIVATIONS, "wg_distribution": True, "shard_reduce": True}
    mon = TrainerMon(config).set_monitor(model, 1, optimizer)
    local: list[torch.Tensor] = []
    model.up.register_forward_hook(lambda module, args, output: local.append(output.detach().clone()))
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("trainmon").addHandler(handler)
    rows, unreduced = [], []
    for step in range(3):
        if step == 1 and rank == 1:

            def broken(*args, **kwargs):
                raise RuntimeError("injected")

            activations_module.tensor_stats = broken
            UnreducedGrads._local = broken
        _train_step(model, optimizer, layout, rank, step)
        rows.append(mon._latest("actv").get(f"0:up.output:0/rank{rank}/actv"))
        unreduced.append(mon._latest("grad_unreduced").get(f"0:up.weight/rank{rank}/acc_grad"))
    mon.stop()
    result = {
        "rows": rows,
        "unreduced": unreduced,
        "local": [flat_values(t) for t in local],
        "messages": messages,
    }
    save_result(workdir, rank, result)


def test_a_rank_whose_activations_fail_leaves_its_mates_per_rank_not_waiting(tmp_path):
    """The header all-gather: rank 1 measures nothing from step 1 on, so rank 0's rows of that
    step stay its own piece (no merge, no rank left waiting in the merge's all-gather), for
    activations and unreduced gradients alike. Rank 1's activation hooks stay on (said), since
    they take partial sums with rank 0; its unreduced gradients are switched off."""
    first, second = run_ranks(_failing_rank_worker, 2, str(tmp_path))
    assert any("grad_unreduced failed and is switched off" in m for m in second["messages"]), second[
        "messages"
    ]
    assert any("actv failed" in m and "stays on" in m for m in second["messages"]), second["messages"]
    assert any("measured different tensor-parallel rows" in m for m in first["messages"]), first["messages"]
    merged, alone = first["rows"][0], first["rows"][1]
    assert merged["norm"] > np.linalg.norm(first["local"][0]) * 1.01  # step 0: both ranks' columns
    assert_stats_close(alone, np.array(first["local"][1]), what="rank 0 up.output at step 1", rel=1e-6)
    whole, pieces = first["unreduced"][0], first["unreduced"][2]
    assert not whole["partial"] and pieces["partial"] and pieces["numel"] * 2 == whole["numel"]


def _failing_once_worker(rank: int, world_size: int, workdir: str) -> None:
    import logging

    import adapters.torch.activations as activations_module
    from monitor import TrainerMon

    layout = LAYOUTS["tp-sequence-parallel"]
    model, _ = _parallel(layout)
    optimizer = _optimizer(model.parameters())
    mon = TrainerMon({**ACTIVATIONS, "shard_reduce": True}).set_monitor(model, 1, optimizer)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("trainmon").addHandler(handler)
    measure, failures = activations_module.tensor_stats, [1 if rank == 1 else 0]

    def once(*args, **kwargs):
        if failures[0] and mon_step[0] == 1:
            failures[0] -= 1
            raise RuntimeError("injected")
        return measure(*args, **kwargs)

    activations_module.tensor_stats = once
    mon_step, grads = [0], []
    for step in range(3):
        mon_step[0] = step
        _train_step(model, optimizer, layout, rank, step)
        grads.append(mon._latest("actv_grad").get(f"0:up.input_grad:0/rank{rank}/actv_grad"))
    mon.stop()
    save_result(workdir, rank, {"messages": messages, "grads": grads})


def test_a_rank_whose_activation_hook_fails_still_takes_the_partial_sums_its_mate_waits_in(tmp_path):
    """The input gradient of a column-parallel layer that gathers the sequence (the DTensor it
    makes of its caller's sequence shard) is a partial sum that the hooks complete with an
    all-reduce of the mesh: rank 1, whose activation statistics failed once, keeps its
    hooks on (said), so rank 0 is not left in that all-reduce alone and both train to the end,
    their rows of the steps after merged as before."""
    first, second = run_ranks(_failing_once_worker, 2, str(tmp_path))
    assert any("actv failed" in m and "stays on" in m for m in second["messages"]), second
    assert not any("switched off" in m for m in first["messages"] + second["messages"])
    for step in (0, 2):
        assert first["grads"][step] is not None, step
        assert first["grads"][step] == second["grads"][step], step  # merged: the same whole tensor


def _second_optimizer_worker(rank: int, world_size: int, workdir: str) -> None:
    """The tensor-parallel layers are updated by an optimizer of their own; the one given to
    set_monitor holds only the plain LayerNorm parameters."""
    from monitor import TrainerMon

    layout = Layout(dp=1, tp=2)
    model, _ = _parallel(layout)
    parallel = [p for name, p in model.named_parameters() if not name.startswith("norm.")]
    plain = [p for name, p in model.named_parameters() if name.startswith("norm.")]
    optimizer, parallel_optimizer = _optimizer(plain), torch.optim.SGD(parallel, lr=0.1)
    config = {"wg_distribution": True, "param_distribution": True, "ops": ALL_OPS, "format": "api"}
    mon = TrainerMon({**config, "shard_reduce": True}).set_monitor(model, 1, optimizer)
    steps = []
    for step in range(2):
        _loss(model(_model_input(layout, rank, step)), layout, step).backward()
        expected = {  # DTensor's own gather of the whole tensors, before the update
            "grad_reduced": {
                n: flat_values(m.weight.grad.full_tensor())
                for n, m in (("up", model.up), ("down", model.down))
            },
            "param_origin": {
                n: flat_values(m.weight.full_tensor()) for n, m in (("up", model.up), ("down", model.down))
            },
        }
        optimizer.step()  # the monitored step first: its hooks read the layers before either update
        parallel_optimizer.step()
        optimizer.zero_grad()
        parallel_optimizer.zero_grad()
        steps.append({"expected": expected, "got": {p: mon._latest(p) for p in expected}})
    mon.stop()
    save_result(workdir, rank, {"steps": steps, "backend": type(mon._session.backend).__name__})


def test_layers_updated_by_another_optimizer_than_the_one_given_are_read_as_dtensors(tmp_path):
    """The monitor took DTensors for tensor parallelism only where the given optimizer held
    some: here it read them as plain tensors, which failed and switched gradients and parameters
    off for the run. Their merged rows are the whole tensors'."""
    for rank, result in enumerate(run_ranks(_second_optimizer_worker, 2, str(tmp_path))):
        assert result["backend"] == "DTensorBackend"
        for step, got in enumerate(result["steps"]):
            for prefix, expected in got["expected"].items():
                rows = latest_rows(got["got"], prefix)
                for name, values in expected.items():
                    what = f"rank {rank} step {step} {prefix} {name}"
                    assert_stats_close(rows[f"{name}.weight"], np.array(values), what=what)


class ShardedInput(torch.nn.Module):
    """A row-parallel layer that scatters the sequence, feeding a plain module that FSDP2 shards
    over the dp ranks: FSDP2's pre-forward hands that module views of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.block = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(x))


def _sharded_input_worker(rank: int, world_size: int, workdir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from monitor import TrainerMon

    torch.manual_seed(0)
    model = ShardedInput()
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = _optimizer(model.parameters())
    mon = TrainerMon({**ACTIVATIONS, "shard_reduce": True}).set_monitor(model, 1, optimizer)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(7))  # the same on every rank
    model(x).pow(2).mean().backward()
    optimizer.step()
    rows = mon._latest("actv")
    mon.stop()
    whole = flat_values(replica.embed(x))
    save_result(workdir, rank, {"rows": {t.split("/")[0]: r for t, r in rows.items()}, "whole": whole})


def test_a_sequence_shard_that_fsdp2_hands_a_module_as_a_view_keeps_its_mesh(tmp_path):
    """With shard_reduce, the module's input row is the whole tensor, as the row of the output it
    is: the view FSDP2's pre-forward makes of it was taken for a whole tensor of its own."""
    for result in run_ranks(_sharded_input_worker, 4, str(tmp_path)):
        rows = result["rows"]
        for name in ("0:embed.output:0", "0:block.input:0"):
            assert_stats_close(rows[name], np.array(result["whole"]), what=name, rel=TOLERANCE)
