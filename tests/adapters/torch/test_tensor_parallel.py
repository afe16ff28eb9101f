"""Tensor parallelism with FSDP2 on a (dp 2, tp 2) mesh of four real gloo ranks, against an
unsharded replica.

``up`` is column-parallel, ``down`` row-parallel (its bias replicated over tp), ``norm`` is left
whole by tensor parallelism, so FSDP2 shards it over the dp sub-mesh only; ``down`` has 7 outputs,
so dp shards are uneven. The two tp ranks of a dp rank see that dp rank's batch. References: an
unsharded replica's gradient on the dp rank's batches (unreduced), its mean over dp ranks
(reduced), its own AdamW (parameters, moments). Whole values (``shard_reduce``) must equal the
replica's on every rank; pieces written with their element counts must merge to them with each
element counted once (no row from a replica); unreduced rows are this rank's tensor-parallel
piece of its dp rank's gradient; activations of the column-parallel module are this rank's
columns of the replica's.
"""

from __future__ import annotations

import copy

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

STEPS, WORLD, DP, TP = 3, 4, 2, 2
#: tensor-parallel matmuls sum in another order than the replica's (a replica counted twice, or
#: one shard's norm, is off by 41% or more)
TOLERANCE = 1e-3
PREFIXES = STEP_PREFIXES
CONFIG = {**DATA_TYPES["all"], "ops": ALL_OPS, "format": "api"}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 16)
        self.down = torch.nn.Linear(16, 7)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def _parallel() -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Block()
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, replica


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _batch(dp_rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def _train_step(model, optimizer, dp_rank: int, step: int) -> None:
    model(_batch(dp_rank, step)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _worker(rank: int, world_size: int, workdir: str) -> None:
    from monitor import TrainerMon

    dp_rank = rank // TP
    model, replica = _parallel()
    optimizer, replica_optimizer = _optimizer(model.parameters()), _optimizer(replica.parameters())
    monitors = {
        "merged": TrainerMon({**CONFIG, "shard_reduce": True}).set_monitor(model, 1, optimizer),
        "pieces": TrainerMon(CONFIG).set_monitor(model, 1, optimizer),
    }
    activations = TrainerMon({"xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "api"})
    activations.set_monitor(model, 1, optimizer)
    steps = []
    for step in range(STEPS):
        replica.zero_grad()
        hidden = replica.up(_batch(dp_rank, step))  # column-parallel: this rank holds columns of it
        columns = hidden.shape[1] // TP
        up_output = flat_values(hidden[:, (rank % TP) * columns : (rank % TP + 1) * columns])
        replica(_batch(dp_rank, step)).pow(2).mean().backward()
        local = [p.grad.clone() for p in replica.parameters()]
        reduced = [g.clone() for g in local]
        for g in reduced:  # every dp rank's gradient is on its TP ranks: the mean over all ranks
            dist.all_reduce(g)
            g /= WORLD
        ref = replica_references(replica, replica_optimizer, local, reduced)
        _train_step(model, optimizer, dp_rank, step)
        got = {key: {prefix: mon._latest(prefix) for prefix in PREFIXES} for key, mon in monitors.items()}
        up_row = activations._latest("actv")[f"0:up.output:0/rank{rank}/actv"]
        steps.append({"ref": ref, "got": got, "up_output": [up_output, up_row]})
    backends = sorted({type(mon._session.backend).__name__ for mon in monitors.values()})
    trained = [p.to_local().detach().clone() for p in model.parameters()]
    for mon in (*monitors.values(), activations):
        mon.stop()
    plain, _ = _parallel()
    plain_optimizer = _optimizer(plain.parameters())
    for step in range(STEPS):
        _train_step(plain, plain_optimizer, dp_rank, step)
    identical = all(torch.equal(a, p.to_local()) for a, p in zip(trained, plain.parameters()))
    save_result(workdir, rank, {"steps": steps, "backends": backends, "identical": identical})


def _check_unreduced(step: int, per_rank: list[dict]) -> None:
    """Per dp rank: whole rows equal its gradient; tensor-parallel pieces merge to it."""
    for dp_rank in range(DP):
        ranks = [dp_rank * TP + tp for tp in range(TP)]
        want = per_rank[ranks[0]]["steps"][step]["ref"]["grad_unreduced"]
        for name, values in want.items():
            for key in ("merged", "pieces"):
                rows = [
                    latest_rows(per_rank[r]["steps"][step]["got"][key], "grad_unreduced")[name] for r in ranks
                ]
                what = f"step {step} dp {dp_rank} {key} grad_unreduced {name}"
                if "numel" not in rows[0] or not rows[0]["partial"]:  # whole on every tp rank
                    for row in rows:
                        assert_stats_close(row, np.array(values), what=what, rel=TOLERANCE)
                    continue
                assert all(row["partial"] for row in rows), what
                whole = merge_piece_rows(rows)
                assert whole["numel"] == len(values), what
                assert_stats_close(whole, np.array(values), what=what, rel=TOLERANCE)


def _check_step(step: int, per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):  # activations of a tensor-parallel module: the local piece
        want, row = result["steps"][step]["up_output"]
        assert_stats_close(row, np.array(want), what=f"step {step} rank {rank} up.output", rel=TOLERANCE)
    ref = per_rank[0]["steps"][step]["ref"]
    for prefix in PREFIXES:
        if prefix == "grad_unreduced":
            _check_unreduced(step, per_rank)
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


def test_fsdp2_with_tensor_parallelism_on_a_2d_mesh_equals_an_unsharded_replica(tmp_path):
    per_rank = run_ranks(_worker, WORLD, str(tmp_path))
    for result in per_rank:
        assert result["backends"] == ["DTensorBackend"], result["backends"]
        assert result["identical"], "training changed by the monitors"
    for step in range(STEPS):
        _check_step(step, per_rank)
