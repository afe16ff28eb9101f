"""What ``trainmon compact`` reads: a part's CSV and live Parquet files as one SQL query of rows
(step, micro_step, vpp_stage, name, _file, op, value), with the readers' rules: complete lines
only, rows that do not parse left out and said, live files merged away while listed read again."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from dashboards.csvfiles import header_columns
from monitor.query import csv_files
from monitor.query.csv_files import header_fields, read_header
from monitor.query.engine import quoted_path
from monitor.writers.parquet_files import layout_problem

logger = logging.getLogger("trainmon")


def table_values(con: Any, paths: Sequence[str]) -> str | None:
    """Every value of these CSV and live Parquet files as a row (step, micro_step, vpp_stage,
    name, _file, op, value), ``_file`` the place in ``paths`` of the CSV file, or of a rank
    directory's first Parquet file (None where they hold no statistic)."""
    csv_files, parquet_dirs = {}, {}
    for index, path in enumerate(paths):
        problem = layout_problem(path) if path.endswith(".parquet") else None
        if problem is not None:
            if not os.path.exists(path):  # merged away by the live run since it was listed
                raise FileNotFoundError(path)
            logger.warning("trainmon compact: skipping %s: %s", path, problem)  # cut short, other columns
        elif path.endswith(".parquet"):  # values/data_type=*/ in a rank directory
            rank_dir = os.path.dirname(os.path.dirname(os.path.dirname(path)))
            parquet_dirs.setdefault(rank_dir, (index, []))[1].append(path)
        else:
            csv_files[index] = path
    selects = [
        f"SELECT step, micro_step, vpp_stage, name, {index} AS _file, op, value "
        f"FROM read_parquet([{', '.join(quoted_path(p) for p in files)}])"
        for index, files in parquet_dirs.values()
    ]
    csv_rows = _csv_values(con, csv_files)
    return " UNION ALL ".join(([csv_rows] if csv_rows else []) + selects) or None


def _csv_values(con: Any, paths: dict[int, str]) -> str | None:
    """Every value of these CSV files (by their ``_file``) as a row (step, micro_step,
    vpp_stage, name, _file, op, value); None where they hold no statistic. The files of each
    header are read by the query layer (monitor.query.csv_files: complete lines only, as every
    reader takes them); a step, micro-step or stage that is no integer leaves its row out."""
    groups: dict[str, list[int]] = {}
    ops: list[str] = []
    for index, path in paths.items():
        header = read_header(path)
        try:
            found = header_columns(header)[1] if header is not None else ()
        except ValueError:  # damaged, another tool's file
            logger.warning("trainmon compact: skipping %s: not a monitor CSV header", path)
            continue
        if found:  # an empty file, or a header without statistics, has nothing to read
            groups.setdefault(header, []).append(index)
            ops += [op for op in found if op not in ops]
    selects, has_micro = [], False
    for number, (header, members) in enumerate(groups.items()):
        fields = header_fields(header)
        has_micro |= "micro_step" in fields
        sql, dropped = csv_files.relation(con, [paths[i] for i in members], fields, tag=f"_{number}")
        for place, count in dropped.items():
            _say(con, paths[members[place]], count)
        whole = " AND ".join(f"{c} = trunc({c})" for c in fields if c in ("vpp_stage", "step", "micro_step"))
        selects.append(f"SELECT * EXCLUDE (file), {members}[file + 1] AS _file FROM ({sql}) WHERE {whole}")
    if not ops:
        return None
    union = " UNION ALL BY NAME ".join(selects)
    micro = "CAST(micro_step AS BIGINT) AS micro_step" if has_micro else "CAST(NULL AS BIGINT) AS micro_step"
    op_columns = ", ".join(f'"{op}"' for op in ops)
    return f"""
        SELECT step, micro_step, vpp_stage, name, _file, op, value FROM (
            UNPIVOT (SELECT CAST(step AS BIGINT) AS step, {micro}, CAST(vpp_stage AS BIGINT) AS vpp_stage,
                            name, _file, {op_columns} FROM ({union}))
            ON {op_columns} INTO NAME op VALUE value)
    """


def unreadable_parquet(con: Any, paths: Sequence[str]) -> list[str]:
    """The Parquet files among ``paths`` whose columns cannot be decoded in full (damaged data
    behind a footer that reads fine)."""
    damaged = []
    for path in paths:
        if not path.endswith(".parquet"):
            continue
        try:
            con.execute(
                "SELECT max(step), max(micro_step), max(vpp_stage), max(length(name)), max(length(op)), "
                f"max(value) FROM read_parquet({quoted_path(path)})"
            ).fetchall()
        except Exception:  # any failure to decode: DuckDB raises several kinds
            damaged.append(path)
    return damaged


def say_rejected(con: Any) -> None:
    """The CSV rows just read that did not parse (a value that is no number): left out, as every
    reader leaves them, and said once per file, as csv2tb says it; a file whose steps span two of
    the dataset's files is read once for each."""
    for path, count in csv_files.rejected(con).items():
        _say(con, path, count)


def _say(con: Any, path: str, count: int) -> None:
    con.execute("CREATE TEMP TABLE IF NOT EXISTS rejects_said (file VARCHAR PRIMARY KEY)")
    if con.execute("SELECT count(*) FROM rejects_said WHERE file = ?", [path]).fetchone()[0]:
        return
    con.execute("INSERT INTO rejects_said VALUES (?)", [path])
    logger.warning("trainmon compact: %s: skipped %d row(s) that did not parse", path, count)
