"""The dataset on Spark: ``spark.read.parquet`` of what ``trainmon compact`` wrote (Parquet
version-2 encodings, hive partitions) gives every value, and the documented cross-rank query runs
unchanged in Spark SQL and DuckDB, both checked against numpy on the csv module's reading.

Spark runs in local mode on this machine's JVM; the test is skipped only where pyspark or Java is
missing (the README's set-up installs pyspark)."""

from __future__ import annotations

import shutil

import duckdb
import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")

if shutil.which("java") is None:
    pytest.skip("no Java runtime for Spark on this machine", allow_module_level=True)

from dashboards.convert.compact import FARTHEST_RANK_SQL, compact  # noqa: E402
from monitor.anomaly.peers_sql import cross_rank_sql  # noqa: E402
from monitor.files import make_private_dir  # noqa: E402
from monitor.record import RowSet, StepRecord  # noqa: E402
from monitor.writers.csv import CsvWriter  # noqa: E402
from tests.dashboards.conftest import NAMES, OPS, TASKS, read_csv_rows  # noqa: E402


def _random_run(root, ranks: int, steps: int, prefixes: tuple[str, ...]) -> dict:
    """A run whose ranks differ at random (no ties for the farthest rank), by the CSV writer."""
    rng = np.random.default_rng(7)
    dirs = {}
    for rank in range(ranks):
        dirs[rank] = root / f"Jan02_03-04-05-rank{rank}-{rank:08x}"
        make_private_dir(dirs[rank])
        writer = CsvWriter(dirs[rank], 6, 2)
        for step in range(steps):
            for prefix in prefixes:
                rows = RowSet.build([0] * len(NAMES), list(NAMES), rank, TASKS[prefix])
                values = rng.lognormal(size=(len(NAMES), len(OPS)))
                values[:, OPS.index("nans")] = rng.integers(0, 1000, len(NAMES))
                writer.write(StepRecord(prefix, step, OPS, rows, values))
            writer.end_step(step)
        writer.close()
    return dirs


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("trainmon-dataset-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.mark.slow
def test_spark_reads_every_value_and_runs_the_cross_rank_query_as_duckdb_does(tmp_path, spark):
    dirs = _random_run(tmp_path, ranks=4, steps=5, prefixes=("grad_reduced", "exp_avg"))
    compact(str(tmp_path))
    values = spark.read.parquet(str(tmp_path / "dataset" / "values"))
    columns = {"rank", "step", "micro_step", "vpp_stage", "data_type", "name", "op", "value"}
    assert set(values.columns) == columns
    expected = {}  # (rank, data type, name, step, op) -> value, from the CSV files
    for rank, directory in dirs.items():
        for prefix in ("grad_reduced", "exp_avg"):
            for row in read_csv_rows(directory, prefix):
                for op, value in row["values"].items():
                    expected[(rank, prefix, row["name"], row["step"], op)] = value
    got = {(r["rank"], r["data_type"], r["name"], r["step"], r["op"]): r["value"] for r in values.collect()}
    assert got.keys() == expected.keys()
    for key, value in expected.items():  # 32-bit floats: six significant digits, as the CSV has them
        assert float(f"{got[key]:.6g}") == value, key

    values.createOrReplaceTempView("v")
    on_spark = {tuple(r) for r in spark.sql(FARTHEST_RANK_SQL).collect()}
    con = duckdb.connect()
    con.execute(
        f"CREATE VIEW v AS SELECT * FROM read_parquet('{tmp_path}/dataset/values/**/*.parquet', "
        "hive_partitioning = true)"
    )
    on_duckdb = set(con.execute(FARTHEST_RANK_SQL).fetchall())
    ranks = sorted(dirs)
    reference = set()
    for prefix, name, step, op in {(p, n, s, o) for _, p, n, s, o in expected}:
        column = np.array([expected[(rank, prefix, name, step, op)] for rank in ranks])
        farthest = ranks[int(np.argmax(np.abs(column - np.median(column))))]
        reference.add((prefix, 0, name, None, op, step, farthest))  # chunk 0, no micro-steps
    assert on_duckdb == reference
    assert on_spark == reference

    # the cross-rank analysis itself, as SQL: the same outliers on both engines
    query = cross_rank_sql(k_mad=3.0, types=("grad_reduced", "exp_avg"))
    key = ("data_type", "rank", "step", "micro_step", "name", "op")
    spark_rows = {tuple(r[k] for k in key): r.asDict() for r in spark.sql(query).collect()}
    cursor = con.execute(query)
    columns = [d[0] for d in cursor.description]
    duckdb_rows = {
        tuple(r[k] for k in key): r for r in (dict(zip(columns, row)) for row in cursor.fetchall())
    }
    assert spark_rows.keys() == duckdb_rows.keys() and len(spark_rows) > 0
    for found, row in spark_rows.items():
        for column in ("value", "peers_median", "scale", "deviation_mads"):
            assert row[column] == pytest.approx(duckdb_rows[found][column], rel=1e-6), (found, column)
