"""Memory and handles of a long monitored run: RSS, open descriptors and live Python objects.

Trains a small model with every data type on (CSV output rolling over files, anomaly rules with
the dump) and reports, at a few checkpoints, the resident set size, the number of open file
descriptors and the number of live Python objects (tensors among them). A per-step leak shows as
RSS and object counts that keep growing; the report gives the RSS change from step 200 to the end.

    python benchmarks/leak.py              # 2,000 steps (a few minutes on one CPU thread)
    python benchmarks/leak.py --steps 600  # shorter
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # also when imported as a module by the tests
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from blocks import EVERY_DATA_TYPE  # noqa: E402

from monitor import TrainerMon  # noqa: E402
from tests.training import MLP, make_batches, train  # noqa: E402

CONFIG = {
    **EVERY_DATA_TYPE,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
    "format": "csv",
    "step_count_per_record": 50,
    "alert": {"rules": [{"rule_name": "AnomalyZScore", "args": {"threshold": 50}}], "dump": True},
}


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_objects() -> Counter:
    """Live objects tracked by the garbage collector, by type name (after a full collection)."""
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


class Run:
    """The shared fixture's MLP with AdamW and the monitor attached; ``steps(n)`` trains n more
    steps of two micro-batches."""

    def __init__(self, config: dict | None = None, width: int = 32, batch: int = 8) -> None:
        torch.manual_seed(0)
        self.model = MLP((16, width, width))
        self.batch = batch
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.mon = TrainerMon(config or CONFIG)
        self.mon.set_monitor(self.model, grad_acc_steps=2, optimizer=self.optimizer)
        self.done = 0

    def steps(self, n: int) -> None:
        batches = make_batches(n, 2, seed=self.done + 1, features=16, batch=self.batch)
        train(self.model, self.optimizer, batches)
        self.done += n
        self.mon.flush()


def report(step: int, rss: int, fds: int, objects: Counter) -> None:
    print(f"step {step:5d}: RSS {rss / 2**20:8.1f} MiB, {fds} fds, {sum(objects.values())} objects")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        os.environ["MONITOR_OUTPUT_DIR"] = out
        run = Run()
        run.steps(200)
        base_rss, base_fds, base_objects = rss_bytes(), open_descriptors(), live_objects()
        report(run.done, base_rss, base_fds, base_objects)
        while run.done < args.steps:
            run.steps(min(200, args.steps - run.done))
            rss, fds, objects = rss_bytes(), open_descriptors(), live_objects()
            report(run.done, rss, fds, objects)
        grown = {k: v for k, v in (objects - base_objects).items() if v > 10}
        run.mon.stop()
    print(
        f"RSS step 200 -> {run.done}: {100 * (rss - base_rss) / base_rss:+.2f}% "
        f"({(rss - base_rss) / 2**10:+.0f} KiB); fds {base_fds} -> {fds}; "
        f"object types grown by more than 10: {grown or 'none'}"
    )


if __name__ == "__main__":
    main()
