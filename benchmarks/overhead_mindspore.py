"""Step-time overhead of the monitor on MindSpore (PyNative, CPU), beside benchmarks/overhead.py.

A net of 6 ``Dense(512, 512)`` + ReLU layers, batch 64, ``nn.Adam``, one thread. Each scenario
runs in its own process; CPU time of the whole process. The figure judged against the targets
comes from paired twins (benchmarks/blocks.py): a second, monitored copy of the net collecting
every step, stepping in turn with the unmonitored one; the mean of the per-round differences,
with its 95% margin, resolves a collected step's cost to a few percent, where single steps
scatter by +-20% on this shared machine (for ``uncollected`` the twin collects its first step
only). "margin": above the target by no more than that margin. Printed beside it: the
neighbours' ratio, the cost of collecting (a collected step minus its two uncollected
neighbours, every other step collected) plus the cost of being attached (an attached step that
is not collected minus its two detached neighbours); and the blocks' (alternating unmonitored
and monitored blocks, the median over pairs of monitored / unmonitored CPU time per step).

Scenarios: ``wg``, ``mv``, ``param``, ``xy`` (with all_xy), ``all`` (all of them with the six
ops and the alert rules with the anomaly dump), and ``uncollected`` (everything on, but
``step_interval`` 1000: the cost of a step that is not collected).

    python benchmarks/overhead_mindspore.py                 # every scenario (~10 min)
    python benchmarks/overhead_mindspore.py --quick         # a smaller net, 2 pairs (CI)
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
    RECOMMENDED_RULES,
    alternate,
    attached_among_detached,
    chosen_scenarios,
    collected_among_idle,
    files_written,
    mean_and_margin,
    paired_twins,
    pairs_of,
    run_worker,
)

FOUR_OPS = ["min", "max", "norm", "mean"]
SIX_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
EVERYTHING = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ops": SIX_OPS,
    "alert": {"rules": RECOMMENDED_RULES, "dump": True},
}
SCENARIOS = {
    "wg": {"wg_distribution": True},
    "mv": {"mv_distribution": True},
    "param": {"param_distribution": True},
    "xy": {"xy_distribution": True, "all_xy": True},
    "all": EVERYTHING,
    "uncollected": {**EVERYTHING, "step_interval": 1000},
}
#: CPU-time ratio targets
TARGETS = {"wg": 1.05, "mv": 1.05, "param": 1.05, "xy": 1.25, "all": 1.50, "uncollected": 1.01}


def _work(scenario: str, width: int, pairs: int, steps: int) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from monitor import TrainerMon

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.CellList([nn.Dense(width, width) for _ in range(6)])
            self.act = nn.ReLU()

        def construct(self, x):
            for layer in self.layers:
                x = self.act(layer(x))
            return x

    inputs = ms.Tensor(np.random.default_rng(0).normal(size=(64, width)).astype(np.float32))

    def training() -> tuple:
        net = Net()
        optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-3)
        grad_fn = ms.value_and_grad(lambda x: net(x).square().mean(), None, optimizer.parameters)

        def step() -> None:
            loss, grads = grad_fn(inputs)
            optimizer(grads)
            loss.asnumpy()  # the step is done (PyNative may run asynchronously)

        return net, optimizer, step

    net, optimizer, step = training()

    def attach(**extra: int) -> TrainerMon:
        mon = TrainerMon({"targets": {}, "ops": FOUR_OPS, **SCENARIOS[scenario], **extra})
        mon.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)
        return mon

    # a monitored twin (collecting every step, or for "uncollected" none after its first), in
    # turn with ``step``
    twin_net, twin_optimizer, twin_step = training()
    twin = TrainerMon({"targets": {}, "ops": FOUR_OPS, **SCENARIOS[scenario]})
    twin.set_monitor(twin_net, grad_acc_steps=1, optimizer=twin_optimizer)

    def watched() -> None:
        twin_step()
        twin.flush()

    paired = paired_twins(step, watched, 32 * pairs)
    twin.stop()
    twin_files = files_written(twin)
    blocks, mon = alternate(step, attach, pairs, steps)
    collect = [0.0]  # "uncollected" measures only the cost of being attached
    if scenario != "uncollected":
        every_other = attach(step_interval=2)
        collect = collected_among_idle(step, every_other, 4 * pairs + 3)
        every_other.stop()
    never = attach(start_step=10**9)
    never.stop()
    idle = attached_among_detached(step, never, 4 * pairs + 1)
    return {
        "blocks": blocks,
        "collect": collect,
        "idle": idle,
        "paired": paired,
        "files": files_written(mon),
        "twin_files": twin_files,
    }


def measure(scenario: str, width: int, pairs: int, steps: int, out_root: str) -> dict:
    arguments = ["--worker", scenario, "--width", str(width), "--pairs", str(pairs), "--steps", str(steps)]
    result = run_worker(__file__, arguments, os.path.join(out_root, scenario), scenario)
    for part in ("files", "twin_files"):  # a part that switched itself off looks cheap
        if not result[part] and scenario != "uncollected":
            raise RuntimeError(f"{scenario}: nothing written ({part})")
    ratios = [watched / plain for plain, watched in pairs_of(result["blocks"])]
    plain = statistics.median(plain for plain, _ in pairs_of(result["blocks"]))
    collect, idle = (statistics.median(result[part]) for part in ("collect", "idle"))
    paired, margin = mean_and_margin(result["paired"])
    neighbours = 1 + (collect + idle) / plain
    return {
        "scenario": scenario,
        "ratio": 1 + paired / plain,  # the verdict's figure
        "margin": margin / plain,
        "neighbours": neighbours,
        "collect_ms": 1000 * collect,
        "idle_ms": 1000 * idle,
        "blocks_ratio": statistics.median(ratios),
        "blocks_spread": (min(ratios), max(ratios)),
        "plain_ms": 1000 * plain,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: %(default)s")
    parser.add_argument("--width", type=int, default=512, help="units of each Dense layer")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="width 128, 2 pairs of 2 steps (CI)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_work(args.worker, args.width, args.pairs, args.steps)))
        return 0
    if args.quick:
        args.width, args.pairs, args.steps = 128, 2, 2
    names = chosen_scenarios(parser, args.scenarios, SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="trainmon-ms-overhead-") as out_root:
        results = [measure(name, args.width, args.pairs, args.steps, out_root) for name in names]
    print(
        f"{'scenario':12s} {'plain step':>11s} {'cpu ratio':>9s} {'(95%)':>7s} {'target':>7s}{'':8s} "
        f"{'neighbours':>10s} {'collect':>10s} {'idle':>9s} {'blocks':>7s} {'(pairs min-max)':>15s}"
    )
    met = True
    for r in results:
        target = TARGETS.get(r["scenario"])
        within = target is None or r["ratio"] <= target
        ok = args.quick or within or r["ratio"] - r["margin"] <= target  # not shown to lie above it
        met &= ok
        lo, hi = r["blocks_spread"]
        verdict = "" if args.quick else "met" if within else "margin" if ok else "NOT met"
        margin = f"+-{r['margin']:.3f}"
        print(
            f"{r['scenario']:12s} {r['plain_ms']:8.1f} ms {r['ratio']:9.3f} {margin:>7s} "
            f"{target if target else '':>7} {verdict:7s} {r['neighbours']:10.3f} {r['collect_ms']:7.2f} ms "
            f"{r['idle_ms']:6.2f} ms {r['blocks_ratio']:7.3f} {f'{lo:.2f}-{hi:.2f}':>15s}"
        )
    return 0 if met or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
