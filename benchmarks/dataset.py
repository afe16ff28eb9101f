"""The Parquet dataset of ``trainmon compact`` against the CSV outputs it is made from.

Generates a run of R ranks x T tags x S steps (six statistics, values with the CSV writer's six
significant digits and a NaN count of 0, written by the monitor's own CSV writer), compacts it,
and reports the bytes of both and the time of a cross-rank query in DuckDB over the dataset: per
(data type, tensor, op, step), the ranks' median and the rank farthest from it.

    python benchmarks/dataset.py                       # 16 ranks x 500 tags x 200 steps
    python benchmarks/dataset.py --quick               # 4 ranks x 100 tags x 50 steps (CI)
    python benchmarks/dataset.py --direct 1000         # 10^9 values, see below

``--direct R`` skips the CSV: DuckDB writes a dataset of R ranks x 1,000 tensors x 1,000 steps
(one statistic, 32-bit values, the layout ``compact`` writes) and the same cross-rank query runs
in a separate process under a memory limit (``--memory``, default 4GB; DuckDB spills to a
temporary directory beyond it), whose wall time and peak RSS are reported: out-of-core analysis
at a scale one machine cannot hold in memory.
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

from dashboards.convert.compact import FARTHEST_RANK_SQL, STEPS_PER_FILE, compact  # noqa: E402
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
    parser.add_argument("--direct", type=int, metavar="RANKS", help="a dataset written by DuckDB, no CSV")
    parser.add_argument("--memory", default="4GB", help="DuckDB's memory limit with --direct")
    parser.add_argument("--spark", action="store_true", help="with --direct, also the query in Spark")
    args = parser.parse_args()
    if args.direct:
        direct(args.direct, args.memory, args.spark)
        return
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


#: the query of ``direct``, in its own process (its peak RSS is then the query's alone)
QUERY = """
import resource, sys, time
import duckdb
sys.path.insert(0, sys.argv[4])
from dashboards.convert.compact import FARTHEST_RANK_SQL
con = duckdb.connect()
con.execute(f"SET memory_limit = '{sys.argv[2]}'")
con.execute(f"SET temp_directory = '{sys.argv[3]}'")
values = f"read_parquet('{sys.argv[1]}/values/**/*.parquet', hive_partitioning = true)"
con.execute(f"CREATE VIEW v AS SELECT * FROM {values}")
started = time.perf_counter()
(groups,) = con.execute(f"SELECT count(*) FROM ({FARTHEST_RANK_SQL})").fetchone()
print(groups, time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


#: the same query in Spark local mode (two cores, a 4 GB driver, 16 shuffle partitions: the default
#: 200 partitions cost half as much again on this machine), in its own process
SPARK_QUERY = """
import sys, time
sys.path.insert(0, sys.argv[2])
from pyspark.sql import SparkSession
from dashboards.convert.compact import FARTHEST_RANK_SQL
spark = (
    SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
    .config("spark.driver.memory", "4g").config("spark.sql.shuffle.partitions", "16").getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
spark.read.parquet(sys.argv[1] + "/values").createOrReplaceTempView("v")
started = time.perf_counter()
groups = spark.sql(f"SELECT count(*) FROM ({FARTHEST_RANK_SQL})").collect()[0][0]
print(groups, time.perf_counter() - started)
spark.stop()
"""


def direct(ranks: int, memory: str, spark: bool, tags: int = 1000, steps: int = 1000) -> None:
    """``ranks`` x ``tags`` x ``steps`` values written by DuckDB in the dataset's layout, then the
    cross-rank query under ``memory`` in a process of its own (and in Spark with ``spark``)."""
    import subprocess

    assert steps <= STEPS_PER_FILE, "a part here is one file, as compact writes so few steps"
    with tempfile.TemporaryDirectory() as root:
        out, spill = os.path.join(root, "dataset"), os.path.join(root, "spill")
        os.makedirs(os.path.join(out, "values"))
        con = duckdb.connect()
        con.execute(f"SET memory_limit = '{memory}'")
        con.execute(f"SET temp_directory = '{spill}'")
        started = time.perf_counter()
        for rank in range(ranks):  # one rank a statement: no sort of the whole run
            part = os.path.join(out, "values", "data_type=grad_unreduced", f"rank={rank}")
            file = os.path.join(part, f"steps-0-{STEPS_PER_FILE - 1}.parquet")
            os.makedirs(part)
            con.execute(
                f"""COPY (SELECT s.range AS step, NULL::BIGINT AS micro_step, 0::BIGINT AS vpp_stage,
                           'layers.' || (t.range // 8) || '.fc' || (t.range % 8) || '.weight' AS name,
                           'norm' AS op, CAST(exp(0.05 * (random() - 0.5) * 3.4) AS FLOAT) AS value
                    FROM range({tags}) t, range({steps}) s)
                    TO '{file}' (FORMAT parquet, COMPRESSION zstd, PARQUET_VERSION V2)"""
            )
        written_s = time.perf_counter() - started
        con.close()
        values = ranks * tags * steps
        print(
            f"{ranks} ranks x {tags} tags x {steps} steps = {values:,} values, written in {written_s:.0f} s"
        )
        print(f"  Parquet {directory_bytes(out) / 2**20:.0f} MiB")
        done = subprocess.run(
            [sys.executable, "-c", QUERY, out, memory, spill, str(ROOT)],
            capture_output=True,
            text=True,
            check=True,
        )
        groups, query_s, peak_mib = done.stdout.split()[-3:]
        print(
            f"  cross-rank query under a {memory} limit: {float(query_s):.1f} s, "
            f"peak RSS {float(peak_mib):.0f} MiB ({int(groups):,} groups; "
            f"{float(query_s) / values * 1e9:.1f} ns a value)"
        )
        if spark:
            command = [sys.executable, "-c", SPARK_QUERY, out, str(ROOT)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            groups, query_s = done.stdout.split()[-2:]
            rate = values / float(query_s) / 2
            print(f"  the same in Spark local[2]: {float(query_s):.1f} s ({rate:,.0f} values a core-second)")


if __name__ == "__main__":
    main()
