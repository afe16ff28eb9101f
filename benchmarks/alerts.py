"""What alert sinks and evidence bundles cost the training step, with an endpoint that never answers.

An MLP trains with the recommended alert rules on weight gradients and moments; every
``--every`` steps one gradient is multiplied by 1e4 for one step, so an incident opens (and closes
a few quiet steps later) again and again. Blocks of steps rotate between three monitors: the
same config without sinks (A), with sinks (B): a webhook whose server accepts the connection
and never answers, a command that sleeps, a JSON-lines file, and an ``on_incident`` callback that
sleeps; and with evidence bundles for every incident (C). Each block is a fresh TrainerMon
(attaching and ``stop()`` untimed); its cost is the CPU and the wall time per step, the writer's
``flush()`` included. Delivery runs on the sinks' own threads, so B/A should be 1 within noise,
in wall time too. Bundles are written on the training thread, and while they are wanted each
step waits for the writer to judge it: C/A is what that costs.

    python benchmarks/alerts.py            # 8 rounds of 40-step blocks
    python benchmarks/alerts.py --quick    # 3 rounds of 40-step blocks
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from blocks import RECOMMENDED_RULES  # noqa: E402

import monitor.alerts.dispatch as dispatch  # noqa: E402
from monitor import TrainerMon  # noqa: E402

#: what a stopped block still queued for the hanging sinks is abandoned after this long (untimed).
dispatch.CLOSE_WAIT_S = 0.2


def silent_server() -> tuple[socket.socket, str]:
    """A listening socket nobody reads from: a webhook's request hangs until its timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server, f"http://127.0.0.1:{server.getsockname()[1]}/hook"


def config(**alert: object) -> dict:
    return {
        "wg_distribution": True,
        "mv_distribution": True,
        "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
        "format": "csv",
        "alert": {"rules": RECOMMENDED_RULES, "dump": True, **alert},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 40-step blocks")
    parser.add_argument("--pairs", type=int, default=8, help="rounds of one block of each monitor")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per block")
    parser.add_argument("--every", type=int, default=16, help="steps between injected spikes")
    args = parser.parse_args()
    pairs, steps = (3, 40) if args.quick else (args.pairs, args.steps)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 256)
    counter = [0]

    def step() -> None:
        counter[0] += 1
        model(batch).pow(2).mean().backward()
        if counter[0] % args.every == 0:
            model[3].weight.grad.mul_(1e4)
        optimizer.step()
        optimizer.zero_grad()

    server, url = silent_server()
    with tempfile.TemporaryDirectory() as out:
        os.environ["MONITOR_OUTPUT_DIR"] = out
        sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
        sinks = [
            {"type": "webhook", "url": url, "ranks": "all", "timeout_s": 30, "retries": 3},
            {"type": "command", "argv": sleeper, "ranks": "all", "timeout_s": 30},
            {"type": "file", "path": "incidents.jsonl", "ranks": "all", "max_per_hour": 100000},
        ]
        plans = {"A": config(), "B": config(sinks=sinks), "C": config(bundle={"incidents": 1000})}
        blocks: dict[str, list[tuple[float, float, int]]] = {name: [] for name in plans}
        for pair in range(pairs):
            for name in ("A", "B", "C")[pair % 3 :] + ("A", "B", "C")[: pair % 3]:
                mon = TrainerMon(plans[name]).set_monitor(model, 1, optimizer)
                if name == "B":
                    mon.on_incident(lambda message: time.sleep(30))
                step()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    step()
                mon.flush()
                cpu, wall = (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps
                blocks[name].append((cpu, wall, len(mon.incidents)))
                mon.stop()
        with open(os.path.join(out, "incidents.jsonl"), encoding="utf-8") as handle:
            delivered = sum(1 for _ in handle)
        bundles = len(list(Path(out).glob("**/bundle_incident*")))
    server.close()
    print(
        f"alerts: {pairs} rounds x 3 blocks x {steps} steps; A per step: CPU "
        f"{statistics.median(a[0] for a in blocks['A']) * 1e3:.1f} ms"
    )
    for name, what in (("B", "a hanging webhook, a sleeping command and callback"), ("C", "bundles")):
        cpu = statistics.median(b[0] / a[0] for a, b in zip(blocks["A"], blocks[name]))
        wall = statistics.median(b[1] / a[1] for a, b in zip(blocks["A"], blocks[name]))
        added = statistics.median(b[1] - a[1] for a, b in zip(blocks["A"], blocks[name]))
        print(
            f"  step time with {what} / without: CPU {cpu:.3f}, wall {wall:.3f} "
            f"({added * 1e3:+.2f} ms a step; medians over rounds)"
        )
    opened = sum(b[2] for b in blocks["B"])
    print(f"  incidents opened with sinks: {opened}; in the file sink: {delivered}; bundles: {bundles}")
    if opened == 0 or delivered == 0 or bundles == 0:
        sys.exit("no incident was delivered or kept: the benchmark measured nothing")


if __name__ == "__main__":
    main()
