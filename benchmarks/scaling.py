"""Cost per parameter tensor as the tensor count grows: does the monitor stay flat?

The model is N/2 ``Linear(16, 16)`` layers applied to one input and summed (N parameter
tensors of 256 or 16 elements), trained with AdamW (foreach) on one thread: a model where the
per-tensor work, not the arithmetic, is the cost, as in a mixture-of-experts model with
thousands of expert tensors.

Each (tensor count, scenario) runs in its own process. The cost per tensor is measured in two
parts from neighbouring steps, which share the machine's load (benchmarks/blocks.py): "collect",
a collected step minus its two uncollected neighbours (attached, every other step collected),
and "idle", an attached step that is not collected minus its two detached neighbours. Their sum,
divided by N, is the cost per tensor. For comparison the process also trains in alternating
unmonitored and monitored blocks ("blocks": the median over pairs of B - A); on this shared
machine single pairs of blocks scatter by +-20 us a tensor, neighbouring steps far less.

With ``--ranks 2`` the model is wrapped in DDP (``--sharding ddp-inner``: in DDP too, the monitor
given the model inside the wrapper, as the trainers' callbacks are; ``--sharding fsdp2``: sharded
by FSDP2 in units of 100 layers) and trained on that many gloo ranks, each on its own data; rank
0's CPU time is reported (each rank spends the same). There the hooks see each gradient before
the reduction and ``grad_reduced`` is measured again after it (FSDP2: this rank's shard).

Scenarios: ``wg`` (weight gradients before and after reduction), ``wg+mv+param`` (also Adam's
moments and the parameters before and after the step), ``all`` (everything the 6.9M benchmark
switches on: also mg_direction, activations with all_xy, the alert rules with the dump), all
with min, max, norm and mean.

    python benchmarks/scaling.py                        # 200 -> 20,000 tensors (~10 min)
    python benchmarks/scaling.py --counts 2000,8000 --scenarios wg
    python benchmarks/scaling.py --counts 2000,8000 --scenarios wg --ranks 2   # under DDP
    python benchmarks/scaling.py --counts 2000 --ranks 2 --sharding fsdp2     # under FSDP2
    python benchmarks/scaling.py --quick                # 200 and 2,000 tensors, wg (CI, < 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from blocks import (  # noqa: E402
    EVERYTHING_WITH_ALERTS,
    alternate,
    attached_among_detached,
    chosen_scenarios,
    collected_among_idle,
    files_written,
    free_port,
    pairs_of,
    run_worker,
)

OPS = ["min", "max", "norm", "mean"]
SCENARIOS = {
    "wg": {"wg_distribution": True},
    "wg+mv+param": {"wg_distribution": True, "mv_distribution": True, "param_distribution": True},
    "all": EVERYTHING_WITH_ALERTS,
}
#: extra CPU time per tensor (us) at 8,000 tensors, and the most the cost per tensor may grow
#: from 2,000 to 8,000 tensors (1.0 is linear).
TARGET_US_AT_8000 = {"wg": 8.0}
TARGET_GROWTH = 1.25


#: how a model on several ranks is wrapped
SHARDINGS = ("ddp", "ddp-inner", "fsdp2")
#: layers of one FSDP2 unit
FSDP_UNIT = 100


def _work(count: int, scenario: str, pairs: int, steps: int, ranks: int, sharding: str) -> dict:
    """Train with alternating blocks (on ``ranks`` ranks); rank 0's CPU time of every block."""
    if ranks == 1:
        return _train(count, scenario, pairs, steps, sharding)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="trainmon-scaling-ranks-") as shared:
        mp.start_processes(
            _rank_entry,
            args=(ranks, free_port(), shared, (count, scenario, pairs, steps, sharding)),
            nprocs=ranks,
            start_method="spawn",
        )
        return json.loads(Path(shared, "rank0.json").read_text())


def _rank_entry(rank: int, ranks: int, port: int, shared: str, arguments: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(os.environ.get("MONITOR_OUTPUT_DIR", shared), f"r{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        result = _train(*arguments)
    finally:
        dist.destroy_process_group()
    Path(shared, f"rank{rank}.json").write_text(json.dumps(result))


def _train(count: int, scenario: str, pairs: int, steps: int, sharding: str) -> dict:
    """Train with alternating blocks; the CPU time of every block."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from monitor import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class ManyLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(count // 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(layer(x) for layer in self.layers)

    model = ManyLinear()
    if dist.is_initialized() and sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for start in range(0, len(model.layers), FSDP_UNIT):
            fully_shard(list(model.layers[start : start + FSDP_UNIT]))
        fully_shard(model)
    elif dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    # the model inside the DDP wrapper, as the trainers' callbacks are given it
    watched = model.module if sharding == "ddp-inner" and dist.is_initialized() else model
    if dist.is_initialized():
        torch.manual_seed(dist.get_rank() + 1)  # each rank its own data
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    inputs = torch.randn(8, 16)

    def step() -> None:
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def attach(**extra: int) -> TrainerMon:
        mon = TrainerMon({"targets": {}, "ops": OPS, **SCENARIOS[scenario], **extra})
        mon.set_monitor(watched, grad_acc_steps=1, optimizer=optimizer)
        return mon

    blocks, mon = alternate(step, attach, pairs, steps)
    every_other = attach(step_interval=2)
    collect = collected_among_idle(step, every_other, 4 * pairs + 3)
    every_other.stop()
    never = attach(start_step=10**9)
    never.stop()
    idle = attached_among_detached(step, never, 4 * pairs + 1)
    return {"blocks": blocks, "collect": collect, "idle": idle, "files": files_written(mon)}


def measure(
    count: int, scenario: str, pairs: int, steps: int, out_root: str, ranks: int = 1, sharding: str = "ddp"
) -> dict:
    """One (tensor count, scenario) in a fresh process: per-step CPU times and the cost per tensor."""
    what = f"{count} tensors, {scenario}" + (f", {ranks} ranks, {sharding}" if ranks > 1 else "")
    worker = f"{count}:{scenario}:{ranks}:{sharding}"
    arguments = ["--worker", worker, "--pairs", str(pairs), "--steps", str(steps)]
    result = run_worker(__file__, arguments, os.path.join(out_root, f"{count}-{scenario}"), what)
    if not result["files"]:  # a part that switched itself off would look cheap
        raise RuntimeError(f"{what}: nothing written")
    plains = [plain for plain, _ in pairs_of(result["blocks"])]
    extras = [watched - plain for plain, watched in pairs_of(result["blocks"])]
    collect, idle = (1e6 * statistics.median(result[part]) / count for part in ("collect", "idle"))
    return {
        "count": count,
        "scenario": scenario,
        "plain_ms": 1000 * statistics.median(plains),
        "collect_us": collect,
        "idle_us": idle,
        "us_per_tensor": collect + idle,
        "blocks_us": 1e6 * statistics.median(extras) / count,
        "blocks_spread_us": (1e6 * min(extras) / count, 1e6 * max(extras) / count),
        "ratio": 1 + (collect + idle) * count / 1e6 / statistics.median(plains),
    }


def report(results: list[dict]) -> bool:
    """Print the table and the targets; True when every target that applies is met."""
    head = (
        f"{'tensors':>8s} {'scenario':12s} {'plain step':>11s} {'collect':>9s} {'idle':>8s} "
        f"{'per tensor':>11s} {'ratio':>6s} {'blocks':>9s} {'(pairs)':>15s}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        lo, hi = r["blocks_spread_us"]
        print(
            f"{r['count']:8d} {r['scenario']:12s} {r['plain_ms']:8.1f} ms {r['collect_us']:6.1f} us "
            f"{r['idle_us']:5.1f} us {r['us_per_tensor']:8.1f} us {r['ratio']:6.2f} {r['blocks_us']:6.1f} us "
            f"{f'{lo:.1f}-{hi:.1f}':>15s}"
        )
    met = True
    by = {(r["count"], r["scenario"]): r for r in results}
    for scenario in dict.fromkeys(r["scenario"] for r in results):
        target = TARGET_US_AT_8000.get(scenario)
        if target is not None and (8000, scenario) in by:
            value = by[(8000, scenario)]["us_per_tensor"]
            ok = value <= target and _resolved(by[(8000, scenario)])
            met &= ok
            verdict = "met" if ok else "NOT met" if _resolved(by[(8000, scenario)]) else UNRESOLVED
            print(f"{scenario}: {value:.1f} us per tensor at 8,000 (target <= {target}): {verdict}")
        if (2000, scenario) in by and (8000, scenario) in by:
            growth = by[(8000, scenario)]["us_per_tensor"] / by[(2000, scenario)]["us_per_tensor"]
            resolved = _resolved(by[(8000, scenario)]) and _resolved(by[(2000, scenario)])
            ok = growth <= TARGET_GROWTH and resolved
            met &= ok
            print(
                f"{scenario}: cost per tensor at 8,000 / at 2,000 = {growth:.2f} "
                f"(target <= {TARGET_GROWTH}): {'met' if ok else 'NOT met' if resolved else UNRESOLVED}"
            )
    return met


#: the verdict where a part of the cost came out below zero
UNRESOLVED = (
    "not resolved (collect or idle came out below zero: the machine's load moved by more than "
    "the cost; run again)"
)


def _resolved(result: dict) -> bool:
    """Both parts of the cost are at least zero: a negative one is the load's change, not a saving."""
    return result["collect_us"] >= 0 and result["idle_us"] >= 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--counts", default="200,2000,8000,20000", help="parameter tensor counts, comma-separated"
    )
    parser.add_argument(
        "--scenarios", default="wg,wg+mv+param,all", help=f"comma-separated, of: {','.join(SCENARIOS)}"
    )
    parser.add_argument("--pairs", type=int, default=4, help="pairs of blocks (unmonitored, monitored)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--ranks", type=int, default=1, help="train on this many gloo ranks")
    parser.add_argument(
        "--sharding", default="ddp", choices=SHARDINGS, help="how the model is wrapped on several ranks"
    )
    parser.add_argument("--quick", action="store_true", help="200 and 2,000 tensors, wg, 2 pairs (CI)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        count, scenario, ranks, sharding = args.worker.split(":")
        print(json.dumps(_work(int(count), scenario, args.pairs, args.steps, int(ranks), sharding)))
        return 0
    if args.ranks < 1:
        parser.error(f"--ranks: expected a whole number of ranks >= 1, got {args.ranks}")
    if args.sharding != "ddp" and args.ranks == 1:
        parser.error(f"--sharding {args.sharding}: expected --ranks 2 or more, got --ranks 1")
    if args.quick:
        args.counts, args.scenarios, args.pairs, args.steps = "200,2000", "wg", 2, 2
    counts = [int(c) for c in args.counts.split(",")]
    scenarios = chosen_scenarios(parser, args.scenarios, SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="trainmon-scaling-") as out_root:
        results = [
            measure(c, s, args.pairs, args.steps, out_root, args.ranks, args.sharding)
            for s in scenarios
            for c in counts
        ]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    met = report(results)
    return 0 if met or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
