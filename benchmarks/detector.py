"""Time to evaluate the anomaly rules over one step of 100,000 (tag, op) values.

The detector (monitor/anomaly/detector.py) with AnomalyTurbulence, AnomalyNan and AnomalyZScore
gets one StepRecord per step: ceil(100,000 / 6) tags x the six ops, lognormal values with a few
NaNs. Warm-up evaluations first (they grow the per-tag state arrays and cache the row index, as
the first collected steps of a run do); then each evaluation is timed and the median, best and
worst are printed with the anomalies found (a quiet signal: the rules must not fire much).

    python benchmarks/detector.py              # 100,000 values, 50 timed steps
    python benchmarks/detector.py --quick      # 10 timed steps, a second (CI)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from monitor.anomaly.detector import Detector  # noqa: E402
from monitor.anomaly.rules import AnomalyNan, AnomalyTurbulence, AnomalyZScore  # noqa: E402
from monitor.record import RowSet, StepRecord  # noqa: E402

OPS = ("min", "max", "norm", "zeros", "nans", "mean")
TARGET_MS = 5.0


def make_rows(values: int) -> RowSet:
    """Megatron-like parameter tags, enough of them for ``values`` (tag, op) cells."""
    rows = math.ceil(values / len(OPS))
    names = [f"module.decoder.layers.{i // 12}.mlp.linear_fc{i % 12}.weight" for i in range(rows)]
    return RowSet.build([0] * rows, names, 0, "post_grad")


def make_steps(rows: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Per step a (rows, ops) float64 array: lognormal per-tag levels with small noise, a few NaNs."""
    rng = np.random.default_rng(seed)
    level = rng.lognormal(0.0, 2.0, (rows, len(OPS)))
    out = []
    for _ in range(steps):
        v = level * rng.lognormal(0.0, 0.05, level.shape)
        v[:, OPS.index("nans")] = 0.0
        v[rng.integers(0, rows, 3), OPS.index("norm")] = np.nan
        out.append(v)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=100_000, help="(tag, op) values per step")
    parser.add_argument("--steps", type=int, default=50, help="timed evaluations")
    parser.add_argument("--warmup", type=int, default=12, help="untimed evaluations first")
    parser.add_argument("--quick", action="store_true", help="10 timed steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 10
    rows = make_rows(args.values)
    rules = [AnomalyTurbulence(threshold=0.5), AnomalyNan(), AnomalyZScore()]
    detector = Detector(rules, rank=0)
    data = make_steps(len(rows), args.warmup + args.steps)
    times, cpu, found = [], [], 0
    for step, values in enumerate(data):
        record = StepRecord("grad_reduced", step, OPS, rows, values, np.arange(len(rows)))
        started, started_cpu = time.perf_counter(), time.thread_time()
        anomalies = detector.evaluate(record)
        elapsed, elapsed_cpu = time.perf_counter() - started, time.thread_time() - started_cpu
        if step >= args.warmup:
            times.append(elapsed * 1000)
            cpu.append(elapsed_cpu * 1000)
            found += len(anomalies)
    median = statistics.median(times)
    verdict = "" if args.quick else ("met" if median < TARGET_MS else "NOT met")
    print(
        f"{len(rows):,} tags x {len(OPS)} ops = {len(rows) * len(OPS):,} values, rules "
        f"{', '.join(type(r).__name__ for r in rules)}; {args.warmup} warm-up + {args.steps} timed steps"
    )
    print(
        f"evaluate: median {median:.2f} ms, best {min(times):.2f} ms, worst {max(times):.2f} ms "
        f"(target < {TARGET_MS:g} ms: {verdict or 'not judged in --quick'}); "
        f"{found} anomalies in the timed steps ({found / args.steps:.1f} a step)"
    )
    print(
        f"          CPU time of the evaluating thread: median {statistics.median(cpu):.2f} ms, "
        f"best {min(cpu):.2f} ms (wall and CPU differ when the machine is shared)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
