"""The query layer: one DuckDB database per process, closed before a fork, and the CSV files of
several processes read alike."""

from __future__ import annotations

import os

from monitor.anomaly.workers import map_in_workers
from monitor.query import csv_files, engine

HEADER = "vpp_stage,name,step,norm\n"


def _read(path: str) -> tuple[list[str], list[float], int]:
    fields = csv_files.header_fields(HEADER.strip())
    rows = csv_files.read([path], fields, fields)
    return rows.table["name"].to_pylist(), rows.table["norm"].to_numpy().tolist(), os.getpid()


def test_the_database_is_closed_before_a_fork_and_workers_read_as_this_process(tmp_path):
    path = tmp_path / "g_0-0.csv"
    path.write_text(HEADER + "".join(f"0,layer.{i},0,{i / 7!r}\n" for i in range(50)), encoding="utf-8")
    here = _read(str(path))
    engine.cursor().close()
    assert engine._database is not None  # open in this process after a read
    child = os.fork()
    if child == 0:  # the child leaves at once, whatever happens
        os._exit(0)
    os.waitpid(child, 0)
    assert engine._database is None  # closed before the fork: DuckDB's threads are not carried over
    there = map_in_workers(_read, [str(path)] * 4, 2)
    assert all(result[:2] == here[:2] for result in there)
    assert {result[2] for result in there} != {os.getpid()}  # read in worker processes
    assert here[0] == [f"layer.{i}" for i in range(50)] and here[1] == [i / 7 for i in range(50)]


def test_a_path_with_glob_characters_is_read_as_that_file_only(tmp_path):
    """DuckDB expands ``[``, ``*`` and ``?`` in a path; an output directory may hold them."""
    import duckdb

    from monitor.query.parquet_values import file_ops, read_wide

    for directory, op in (("runs[1]", "norm"), ("runs1", "max"), ("a*b", "min"), ("axb", "mean")):
        (tmp_path / directory).mkdir()
        target = (tmp_path / directory / "steps-0000000000-0000000000.parquet").as_posix()
        duckdb.sql(
            "SELECT 0::BIGINT AS rank, 0::BIGINT AS step, NULL::BIGINT AS micro_step, "
            f"0::BIGINT AS vpp_stage, 'w' AS name, '{op}' AS op, 1.0::DOUBLE AS value"
        ).write_parquet(target)
    assert file_ops(str(tmp_path / "runs[1]" / "steps-0000000000-0000000000.parquet")) == ("norm",)
    wide = read_wide([str(tmp_path / "a*b" / "steps-0000000000-0000000000.parquet")])
    assert wide.ops == ("min",) and wide.names == ["w"]
