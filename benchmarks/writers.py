"""Scalars per second of the output writers, side by side in one run.

Compares trainmon's TensorBoardWriter, torch's SummaryWriter.add_scalar once per scalar (what
msprobe does; skipped when torch is missing), trainmon's CsvWriter and its ParquetWriter (skipped
when pyarrow is missing; its time includes merging the steps' files into one at close).
Each writer gets the same records; the time covers writing, the per-step flush and close. Every
output is read back afterwards (not timed) and its scalar count checked.

    python benchmarks/writers.py            # 2,000 rows x 6 ops x 50 steps
    python benchmarks/writers.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from monitor.record import RowSet, StepRecord  # noqa: E402
from monitor.writers.tensorboard import TensorBoardWriter  # noqa: E402

OPS = ("min", "max", "norm", "zeros", "mean", "nans")


def make_data(rows: int, steps: int) -> tuple[RowSet, list[np.ndarray]]:
    """One RowSet of Megatron-like parameter names and one float64 (rows, ops) array per step."""
    names = [f"module.decoder.layers.{i // 8}.mlp.linear_fc{i % 8}.weight" for i in range(rows)]
    rowset = RowSet.build([i % 2 for i in range(rows)], names, 0, "post_grad")
    rng = np.random.default_rng(0)
    values = []
    for _ in range(steps):
        v = rng.standard_normal((rows, len(OPS))) * 10.0 ** rng.integers(-8, 8, (rows, len(OPS)))
        v.ravel()[:: max(1, v.size // 7)] = np.nan
        values.append(v)
    return rowset, values


def run_trainmon(writer: object, rowset: RowSet, values: list[np.ndarray]) -> None:
    """Feed records the way the writer thread does: write, then end_step, then close at the end."""
    for step, v in enumerate(values):
        writer.write(StepRecord("grad", step, OPS, rowset, v))
        writer.end_step(step)
    writer.close()


def bench_tensorboard(out: str, rowset: RowSet, values: list[np.ndarray]) -> float:
    start = time.perf_counter()
    run_trainmon(TensorBoardWriter(out), rowset, values)
    return time.perf_counter() - start


def bench_torch(out: str, rowset: RowSet, values: list[np.ndarray]) -> float:
    from torch.utils.tensorboard import SummaryWriter

    tags = [f"{tag}_{op}" for tag in rowset.tags for op in OPS]
    start = time.perf_counter()
    writer = SummaryWriter(out)  # msprobe's settings: defaults
    for step, v in enumerate(values):
        for tag, number in zip(tags, v.ravel().tolist()):
            writer.add_scalar(tag, number, step)
    writer.close()
    return time.perf_counter() - start


def bench_csv(out: str, rowset: RowSet, values: list[np.ndarray]) -> float:
    from monitor.writers.csv import CsvWriter

    start = time.perf_counter()
    run_trainmon(CsvWriter(out, ndigits=6, step_count_per_record=1), rowset, values)
    return time.perf_counter() - start


def bench_parquet(out: str, rowset: RowSet, values: list[np.ndarray]) -> float:
    from monitor.writers.parquet import ParquetWriter

    start = time.perf_counter()
    run_trainmon(ParquetWriter(out, rank=0), rowset, values)
    return time.perf_counter() - start


def count_parquet_scalars(out: str) -> int:
    import pyarrow.parquet as pq

    from monitor.writers.parquet_files import live_prefixes

    return sum(pq.read_table(paths).num_rows for paths in live_prefixes(out).values())


def count_event_scalars(out: str) -> int:
    """Scalars in all event files of ``out`` (TFRecord framing parsed here; CRCs are the tests' job)."""
    from tensorboard.compat.proto.event_pb2 import Event

    total = 0
    for path in glob.glob(os.path.join(out, "events.out.tfevents.*")):
        data = Path(path).read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            total += sum(1 for value in event.summary.value if value.HasField("simple_value"))
            pos += 16 + length
    return total


def count_csv_scalars(out: str) -> int:
    import pandas as pd

    total = 0
    for path in glob.glob(os.path.join(out, "*.csv")):
        frame = pd.read_csv(path)
        total += frame[[op for op in OPS if op in frame.columns]].size
    return total


def available() -> list[tuple[str, Callable[[str, RowSet, list[np.ndarray]], float], Callable[[str], int]]]:
    """The writers to compare: (label, benchmark, read-back counter)."""
    found = [("trainmon TensorBoardWriter", bench_tensorboard, count_event_scalars)]
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        print(f"skipping torch SummaryWriter: {exc}")
    else:
        found.append(("torch SummaryWriter.add_scalar", bench_torch, count_event_scalars))
    try:
        import monitor.writers.csv  # noqa: F401
    except ImportError as exc:
        print(f"skipping CsvWriter: {exc}")
    else:
        found.append(("trainmon CsvWriter", bench_csv, count_csv_scalars))
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        print(f"skipping ParquetWriter: {exc}")
    else:
        found.append(("trainmon ParquetWriter", bench_parquet, count_parquet_scalars))
    return found


def du(out: str) -> int:
    return sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    """Run every available writer on the same data; print a table; non-zero exit on a count mismatch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="300 rows x 10 steps, a few seconds")
    args = parser.parse_args(argv)
    rows, steps = (300, 10) if args.quick else (args.rows, args.steps)
    rowset, values = make_data(rows, steps)
    expected = rows * len(OPS) * steps
    print(f"{rows} rows x {len(OPS)} ops x {steps} steps = {expected:,} scalars")
    print(f"{'writer':32s} {'seconds':>8s} {'scalars/s':>12s} {'MB':>8s}  read back")
    failed = False
    for label, bench, count in available():
        with tempfile.TemporaryDirectory(prefix="trainmon-bench-") as out:
            seconds = bench(out, rowset, values)
            got = count(out)
            ok = got == expected
            failed |= not ok
            verdict = "ok" if ok else f"MISMATCH: {got:,} of {expected:,}"
            print(f"{label:32s} {seconds:8.3f} {expected / seconds:12,.0f} {du(out) / 1e6:8.2f}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
