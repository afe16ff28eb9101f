"""What ``trainmon compact`` reads: a part's CSV and live Parquet files as one SQL query of rows
(step, micro_step, vpp_stage, name, _file, op, value), with the readers' rules: complete lines
only, rows that do not parse left out and said, live files merged away while listed read again."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from typing import Any

from dashboards.convert.compact_tables import quoted
from dashboards.csvfiles import header_columns, header_ops
from monitor.anomaly.rank_csv import read_complete_lines
from monitor.writers.parquet_files import layout_problem

logger = logging.getLogger("trainmon")

_LABELS = {"vpp_stage": "BIGINT", "name": "VARCHAR", "step": "BIGINT", "micro_step": "BIGINT"}


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
        f"FROM read_parquet([{', '.join(quoted(p) for p in files)}])"
        for index, files in parquet_dirs.values()
    ]
    csv_rows = _csv_values(con, csv_files)
    return " UNION ALL ".join(([csv_rows] if csv_rows else []) + selects) or None


def _csv_values(con: Any, paths: dict[int, str]) -> str | None:
    """Every value of these CSV files (by their ``_file``) as a row (step, micro_step,
    vpp_stage, name, _file, op, value); None where they hold no statistic. Complete lines only,
    as every reader takes them: a run killed while writing leaves its last line cut short, and
    read as a row it would give a wrong value (``-0.0`` of ``-0.016``) and lose the rest. The
    newest file (the one a live run may be appending to between a check and DuckDB's read) and any
    file not ending a line are read from a copy of their complete lines in memory."""
    selects, ops, has_micro = [], [], False
    newest = max(paths, default=None)
    for index, path in paths.items():
        file_ops = list(header_ops(path))
        if not file_ops:  # empty, or a header without statistics: nothing to read
            if not_a_header(path):
                logger.warning("trainmon compact: skipping %s: not a monitor CSV header", path)
            continue
        ops += [op for op in file_ops if op not in ops]
        with open(path, encoding="utf-8", errors="replace") as handle:
            header = handle.readline().strip().split(",")
        has_micro |= "micro_step" in header
        types = {**{c: t for c, t in _LABELS.items() if c in header}, **dict.fromkeys(file_ops, "DOUBLE")}
        columns = ", ".join(f"{quoted(c)}: {quoted(t)}" for c, t in types.items())
        if index != newest and _ends_a_line(path):
            source = (
                f"read_csv({quoted(path)}, header = true, columns = {{{columns}}}, auto_detect = false, "
                "ignore_errors = true, store_rejects = true)"
            )
        else:  # read now into a table, so that its rows that do not parse are said under its name
            source = f"complete_lines_{index}"
            con.register("complete_lines", con.read_csv(
                io.BytesIO(read_complete_lines(path)), header=True, columns=types, auto_detect=False,
                ignore_errors=True, store_rejects=True,
            ))  # fmt: skip
            con.execute(f"CREATE OR REPLACE TEMP TABLE {source} AS SELECT * FROM complete_lines")
            con.unregister("complete_lines")
            say_rejected(con, path)
        selects.append(f"SELECT *, {index} AS _file FROM {source}")
    if not ops:
        return None
    union = " UNION ALL BY NAME ".join(selects)
    micro = "micro_step" if has_micro else "CAST(NULL AS BIGINT) AS micro_step"
    op_columns = ", ".join(f'"{op}"' for op in ops)
    return f"""
        SELECT step, micro_step, vpp_stage, name, _file, op, value FROM (
            UNPIVOT (SELECT step, {micro}, vpp_stage, name, _file, {op_columns} FROM ({union}))
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
                f"max(value) FROM read_parquet({quoted(path)})"
            ).fetchall()
        except Exception:  # any failure to decode: DuckDB raises several kinds
            damaged.append(path)
    return damaged


def say_rejected(con: Any, path: str | None = None) -> None:
    """The CSV rows just read that did not parse (a value that is no number): left out, as every
    reader leaves them, and said once per file (``path``: the file of the only read since the last
    call, read from memory), as csv2tb says it; a file whose steps span two of the dataset's files
    is read once for each."""
    import duckdb

    try:
        found = con.execute(
            "SELECT s.file_path, count(DISTINCT e.line) FROM reject_errors e "
            "JOIN reject_scans s USING (scan_id, file_id) GROUP BY 1 ORDER BY 1"
        ).fetchall()
    except duckdb.CatalogException:  # nothing was read with store_rejects yet
        return
    con.execute("CREATE TEMP TABLE IF NOT EXISTS rejects_said (file VARCHAR PRIMARY KEY)")
    for read, count in found:
        name = path or read
        if con.execute("SELECT count(*) FROM rejects_said WHERE file = ?", [name]).fetchone()[0]:
            continue
        con.execute("INSERT INTO rejects_said VALUES (?)", [name])
        logger.warning("trainmon compact: %s: skipped %d row(s) that did not parse", name, count)
    con.execute("DELETE FROM reject_errors")
    con.execute("DELETE FROM reject_scans")


def not_a_header(path: str) -> bool:
    """Whether a CSV file's first line is there but is no monitor CSV header (damaged, another
    tool's file, not UTF-8), as the other readers say of it; an empty file is not."""
    with open(path, "rb") as handle:
        first = handle.readline()
    if not first.strip():
        return False
    try:
        header_columns(first.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError, StopIteration):
        return True
    return False


def _ends_a_line(path: str) -> bool:
    """Whether a file's last byte ends a line (an empty file has no line to cut short)."""
    with open(path, "rb") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return True
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"
