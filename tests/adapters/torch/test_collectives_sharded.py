"""Collective statistics under FSDP2, FSDP1 and DTensor tensor parallelism on two real gloo
ranks, checked against an unsharded replica. FSDP's all-gathers and reduce-scatters go through
torch.distributed's functions: the gathered output is the whole parameters, the reduce-scatter's
input this rank's own gradient of them, before any reduction (FSDP1 first divides it by its
pre-divide factor). Tensor parallelism's go through torch's functional collectives: a row-parallel
layer's forward all-reduce returns the layer's whole output, a column-parallel layer's backward
all-reduce the whole input gradient.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.adapters.torch.distributed import run_ranks, save_result
from tests.training import MLP

pytestmark = [pytest.mark.distributed]


def _shard(model: torch.nn.Module, case: str, world_size: int) -> torch.nn.Module:
    """Each Linear a unit and the root one more (its LayerNorm), gathered once a step."""
    if case == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # no second gather in backward
            device_id=torch.device("cpu"),
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh, reshard_after_forward=False)


def _worker(rank: int, world_size: int, workdir: str) -> None:
    from monitor import TrainerMon

    case = os.environ["FSDP_CASE"]
    torch.manual_seed(0)
    model = MLP()
    replica = copy.deepcopy(model)
    sharded = _shard(model, case, world_size)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.05)
    config = {"cc_distribution": {"enable": True}, "format": "api", "ops": ["norm"], "collect_times": 1}
    if os.environ["MERGED"] == "1":  # the monitor's own gathers that merge the pieces are not the run's
        config.update(wg_distribution=True, param_distribution=True, mv_distribution=True, shard_reduce=True)
    mon = TrainerMon(config)
    mon.set_monitor(sharded, 1, optimizer)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    sharded(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    comm = {tag.split("/")[0].removeprefix("0:"): row for tag, row in mon._latest("comm").items()}
    mon.stop()
    replica(x).pow(2).mean().backward()
    save_result(
        workdir,
        rank,
        {
            "comm": comm,
            "units": len(list(replica.layers)) + 1,
            "params": sum(float((p.detach().double() ** 2).sum()) for p in replica.parameters()) ** 0.5,
            "local_grads": sum(float((p.grad.double() ** 2).sum()) for p in replica.parameters()) ** 0.5,
        },
    )


@pytest.mark.parametrize("merged", [False, True], ids=["pieces", "shard_reduce"])
@pytest.mark.parametrize("case", ["fsdp2", "fsdp1"])
def test_fsdps_gathers_and_reduce_scatters_are_recorded_with_the_replicas_numbers(tmp_path, case, merged):
    """With shard_reduce the monitor gathers the pieces' statistics itself: those calls are its
    own, not the run's, and change no row."""
    results = run_ranks(_worker, 2, str(tmp_path), {"FSDP_CASE": case, "MERGED": str(int(merged))})
    for rank, result in enumerate(results):
        comm = result["comm"]
        gathered = [name for name in comm if name.startswith("all_gather") and name.endswith(".post_0")]
        scattered = [name for name in comm if name.startswith("reduce_scatter") and name.endswith(".post_1")]
        assert len(gathered) == 1 and len(scattered) == 1, f"rank {rank}: {sorted(comm)}"
        gather, scatter = comm[gathered[0]], comm[scattered[0]]
        assert gather["calls"] == scatter["calls"] == result["units"]
        assert gather["norm"] == pytest.approx(result["params"], rel=1e-5)  # padding adds zeros only
        # FSDP1 divides gradients by its pre-divide factor before the reduce-scatter (2 on 2 ranks)
        divided = 2.0 if case == "fsdp1" else 1.0
        assert scatter["norm"] == pytest.approx(result["local_grads"] / divided, rel=1e-5)


def _tensor_parallel_worker(rank: int, world_size: int, workdir: str) -> None:
    import torch.distributed._functional_collectives as functional
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from monitor import TrainerMon

    original = functional.all_reduce
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    replica = copy.deepcopy(model)
    parallelize_module(
        model, init_device_mesh("cpu", (world_size,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = {"cc_distribution": {"enable": True, "cc_pre_hook": True}, "format": "api", "ops": ["norm"]}
    mon = TrainerMon({**config, "collect_times": 1})
    mon.set_monitor(model, 1, optimizer)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    model(x).pow(2).mean().backward()
    optimizer.step()
    comm = {tag.split("/")[0].removeprefix("0:"): row for tag, row in mon._latest("comm").items()}
    mon.stop()
    same = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    output = replica(same)
    output.pow(2).mean().backward()
    save_result(
        workdir,
        rank,
        {
            "comm": comm,
            "output": output.detach().norm().item(),
            "input_grad": same.grad.norm().item(),
            "restored": functional.all_reduce is original,
        },
    )


def test_tensor_parallel_functional_collectives_are_recorded_with_the_replicas_numbers(tmp_path):
    for rank, result in enumerate(run_ranks(_tensor_parallel_worker, 2, str(tmp_path))):
        comm = result["comm"]
        assert set(comm) == {"functional_all_reduce.pre_0", "functional_all_reduce.post_0"}, comm
        post = comm["functional_all_reduce.post_0"]
        assert post["calls"] == 2  # the row-parallel forward, the column-parallel backward
        want = (result["output"] ** 2 + result["input_grad"] ** 2) ** 0.5
        assert post["norm"] == pytest.approx(want, rel=1e-5), f"rank {rank}"
        assert result["restored"], "stop() puts the functional collectives back"
