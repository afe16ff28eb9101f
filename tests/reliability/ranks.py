"""One two-rank gloo job shared by the promises that need real collectives (1, 2 and 5).

Each rank trains the same DDP model three times, from the same seeds: without the monitor, with
everything on including cc_distribution, and with cc_distribution whose measuring fails from step
FAULT_STEP on (an injected exception inside the collective monitor). Starting ranks costs seconds,
so the three runs share one job; the tests read the per-rank results.
"""

from __future__ import annotations

import glob
import logging
import os

import torch
import torch.distributed as dist

from monitor import TrainerMon
from tests.adapters.torch.distributed import save_result
from tests.reliability.training import EVERYTHING, Net, hook_state

STEPS = 20
FAULT_STEP = 5
C10D = dist.distributed_c10d
WRAPPED_NAMES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "barrier", "send")


def _identities() -> dict[str, list[int]]:
    return {name: [id(getattr(dist, name)), id(getattr(C10D, name))] for name in WRAPPED_NAMES}


def _comm_steps(directory: str) -> list[int]:
    steps = set()
    for path in glob.glob(os.path.join(directory, "comm_*.csv")):
        with open(path, encoding="utf-8") as handle:
            steps |= {int(line.split(",")[2]) for line in handle.readlines()[1:]}
    return sorted(steps)


def _train(rank: int, config: dict | None, fault: bool = False) -> dict:
    """DDP plus the collectives a training script typically adds (loss all_reduce, a broadcast,
    an all_gather of a metric); returns losses, parameters and what the monitor wrote."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from adapters.torch import collectives

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ddp = DDP(model)
    hooks_before = hook_state(ddp, optimizer)
    mon = None
    if config is not None:
        mon = TrainerMon(config)
        mon.set_monitor(ddp, grad_acc_steps=1, optimizer=optimizer)
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger("trainmon").addHandler(handler)
    original_measure = collectives.CollectiveMonitor._measure
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    try:
        for step in range(STEPS):
            if fault and step == FAULT_STEP:

                def broken(self, token, phase):
                    raise RuntimeError("injected: collective statistic failed")

                collectives.CollectiveMonitor._measure = broken
            x = torch.randn(4, 6, generator=generator)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            scale = torch.tensor([1.0 / (rank + 1)])
            dist.broadcast(scale, src=0)
            gathered = [torch.zeros(1) for _ in range(2)]
            dist.all_gather(gathered, logged.reshape(1) * scale)
            losses.append([loss.item(), logged.item(), *(g.item() for g in gathered)])
            optimizer.step()
            optimizer.zero_grad()
    finally:
        collectives.CollectiveMonitor._measure = original_measure
        logging.getLogger("trainmon").removeHandler(handler)
    result = {"losses": losses, "params": [p.detach().tolist() for p in model.parameters()], "errors": errors}
    if mon is not None:
        mon.stop()
        result["comm_steps"] = _comm_steps(mon.output_dir)
        result["grad_steps"] = sorted(set(_steps(mon.output_dir, "grad_reduced")))
        result["hooks_restored"] = hook_state(ddp, optimizer) == hooks_before
    return result


def _steps(directory: str, prefix: str) -> list[int]:
    steps = []
    for path in glob.glob(os.path.join(directory, f"{prefix}_*.csv")):
        with open(path, encoding="utf-8") as handle:
            steps += [int(line.split(",")[2]) for line in handle.readlines()[1:]]
    return steps


def worker(rank: int, world_size: int, workdir: str) -> None:
    """Plain, monitored and faulted runs on this rank; results to ``result{rank}.json``."""
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, f"out{rank}")
    identities = _identities()
    cc = {"cc_distribution": {"enable": True, "cc_pre_hook": True}}
    results = {
        "plain": _train(rank, None),
        "monitored": _train(rank, {**EVERYTHING, **cc}),
        "faulted": _train(rank, {"wg_distribution": True, **cc}, fault=True),
    }
    results["identities_restored"] = _identities() == identities
    save_result(workdir, rank, results)
