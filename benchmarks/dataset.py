"""The Parquet dataset of ``trainmon compact`` against the CSV outputs it is made from.

Generates a run of R ranks x T tags x S steps (six statistics, values with the CSV writer's six
significant digits and a NaN count of 0, written by the monitor's own CSV writer), compacts it,
and reports the bytes of both and the time of a cross-rank query in DuckDB over the dataset: per
(data type, tensor, op, step), the ranks' median and the rank farthest from it.

    python benchmarks/dataset.py                       # 16 ranks x 500 tags x 200 steps
    python benchmarks/dataset.py --quick               # 4 ranks x 100 tags x 50 steps (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402
import numpy as np  # noqa: E402

from dashboards.convert.compact import FARTHEST_RANK_SQL, compact  # noqa: E402
from monitor.record import RowSet, StepRecord  # noqa: E402
from monitor.writers.csv import CsvWriter  # noqa: E402

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--tags", type=int, default=500)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ranks, tags, steps = (4, 100, 50) if args.quick else (args.ranks, args.tags, args.steps)
    rng = np.random.default_rng(0)
    names = [f"layers.{i // 4}.w{i % 4}.weight" for i in range(tags)]
    scale = rng.lognormal(size=(tags, len(OPS)))
    with tempfile.TemporaryDirectory() as root:
        for rank in range(ranks):
            directory = os.path.join(root, f"Jan02_03-04-05-rank{rank}-{rank:08x}")
            os.makedirs(directory)
            writer = CsvWriter(directory, 6, 50)
            rows = RowSet.build([0] * tags, names, rank, "post_grad")
            for step in range(steps):
                values = scale * (1 + 0.01 * rng.standard_normal((tags, len(OPS))))
                values[:, OPS.index("nans")] = 0.0  # a count, written exactly: no NaN in a healthy run
                writer.write(StepRecord("grad_reduced", step, OPS, rows, values))
                writer.end_step(step)
            writer.close()
        csv_bytes = directory_bytes(root)
        started = time.perf_counter()
        compact(root)
        compact_s = time.perf_counter() - started
        out = os.path.join(root, "dataset")
        parquet_bytes = directory_bytes(os.path.join(out, "values"))
        started = time.perf_counter()
        con = duckdb.connect()
        values = f"read_parquet('{out}/values/**/*.parquet', hive_partitioning = true)"
        con.execute(f"CREATE VIEW v AS SELECT * FROM {values}")
        outliers = con.execute(FARTHEST_RANK_SQL).fetchall()
        query_s = time.perf_counter() - started
    values = ranks * tags * steps * len(OPS)
    print(f"{ranks} ranks x {tags} tags x {steps} steps x {len(OPS)} ops = {values:,} values")
    csv_mib, parquet_mib = csv_bytes / 2**20, parquet_bytes / 2**20
    ratio = parquet_bytes / csv_bytes
    print(f"  CSV {csv_mib:.1f} MiB, Parquet {parquet_mib:.1f} MiB: {ratio:.2f} of the CSV")
    groups = len(outliers)
    print(f"  compact {compact_s:.1f} s; cross-rank query {query_s:.2f} s ({groups:,} groups)")


if __name__ == "__main__":
    main()
