"""The monitor's CSV files read by DuckDB, with the rules every reader keeps.

A file's header names its columns (msprobe's layout: ``vpp_stage,name,step[,micro_step],<ops>``,
its ``shape``/``dtype`` columns read as text and left out). Only complete lines are read: a run
killed while writing leaves its last line cut short, and read as a row it would give a wrong
value (``-0.0`` of ``-0.016``). The readers (``read``) join the complete lines of the files
that share a header and parse them in one pass, each row given back its file; ``compact``'s
out-of-core query (``relation``) hands DuckDB the files themselves, except the newest of a set
(the one a live run may be appending to between a check and the read) and any file not ending a
line, which it reads from a copy of their complete lines in memory. A row that does not parse
(a wrong field count, a value that is no number, an empty cell, a step that is no integer) is
left out and counted per file, never guessed. A tensor called ``nan`` stays a name.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitor.query import engine
from monitor.query.engine import cursor, quoted, quoted_path
from monitor.writers.eventfile import open_regular

#: header columns that are labels, not statistics, and the SQL types they are read as (integers
#: as doubles, so that a step of ``2.5`` is refused rather than rounded).
LABEL_TYPES = {"vpp_stage": "DOUBLE", "name": "VARCHAR", "step": "DOUBLE", "micro_step": "DOUBLE"}
#: msprobe columns that hold no number.
IGNORED_COLUMNS = ("shape", "dtype")
#: the largest step, micro-step or stage read (every integer up to it is a double exactly)
_LARGEST_LABEL = 2.0**53
#: DuckDB's text for NULL: none, so that an empty number is a row that does not parse.
_NO_NULL = "\x01"


def header_fields(header: str) -> list[str]:
    """The columns of a header line."""
    return next(csv.reader([header]), [])


def read_header(path: str | os.PathLike, probe: int = 65536) -> str | None:
    """A file's first line (None: the file has no complete line).

    Raises:
        OSError: unreadable, or not a regular file (symlinks are refused).
    """
    return peek(path, probe)[0]


def peek(path: str | os.PathLike, probe: int = 65536) -> tuple[str | None, bool]:
    """A file's first line (None: it has no complete line) and whether its last byte ends a line
    (an empty file has no line to cut short).

    Raises:
        OSError: unreadable, or not a regular file (symlinks are refused).
    """
    fd = open_regular(path)
    try:
        head = os.pread(fd, probe, 0)
        size = os.fstat(fd).st_size
        while b"\n" not in head and len(head) < size:  # a header of very many statistics
            more = os.pread(fd, len(head), len(head))
            if not more:  # cut short meanwhile
                break
            head += more
        last = head[size - 1 : size] if size <= len(head) else os.pread(fd, 1, size - 1)
    finally:
        os.close(fd)
    end = head.find(b"\n")
    header = head[:end].rstrip(b"\r").decode("utf-8", "replace") if end >= 0 else None
    return header, size == 0 or last == b"\n"


def read_complete_lines(path: str | os.PathLike) -> bytes:
    """A file's bytes up to its last line break (a file being written may end mid-line).

    Raises:
        OSError: unreadable, or not a regular file (symlinks are refused).
    """
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read()
    finally:
        os.close(fd)
    end = data.rfind(b"\n")
    return data if end == len(data) - 1 else data[: end + 1]  # no copy when the last line is whole


def column_types(fields: Sequence[str]) -> dict[str, str]:
    """The SQL type of each column of a monitor header (``fields`` in order)."""
    return {f: LABEL_TYPES.get(f, "VARCHAR" if f in IGNORED_COLUMNS else "DOUBLE") for f in fields}


def _options(types: dict[str, str]) -> str:
    columns = ", ".join(f"{quoted(c)}: {quoted(t)}" for c, t in types.items())
    return (
        f"header = true, columns = {{{columns}}}, auto_detect = false, ignore_errors = true, "
        f"store_rejects = true, nullstr = {quoted(_NO_NULL)}"
    )


def relation(
    con: Any, paths: Sequence[str], fields: Sequence[str], tag: str = ""
) -> tuple[str, dict[int, int]]:
    """SQL of the rows of these files (which share the header ``fields``) in connection ``con``,
    for a query that reads them out of core: their columns and ``file``, the place of each row's
    file in ``paths``; and the rows that did not parse of the files read from memory now (into
    temporary tables of ``con`` named after ``tag``), by place. The last file (a live run may be
    appending to it) and any that does not end a line are read from memory; ``rejected`` gives
    the others' rows that did not parse once the SQL has run.

    Raises:
        OSError: a file cannot be read, or is not a regular file.
    """
    types = column_types(fields)
    on_disk = [i for i, path in enumerate(paths) if i < len(paths) - 1 and peek(path)[1]]
    selects, counts = [], {}
    if on_disk:
        listed = ", ".join(quoted_path(paths[i]) for i in on_disk)
        index = "CAST(file_index AS BIGINT)"
        if on_disk != list(range(len(on_disk))):
            index = f"{on_disk}[{index} + 1]"
        selects.append(f"SELECT *, {index} AS file FROM read_csv([{listed}], {_options(types)})")
    for i in sorted(set(range(len(paths))) - set(on_disk)):
        table = f"complete_lines{tag}_{i}"
        con.register("complete_lines", con.read_csv(
            io.BytesIO(read_complete_lines(paths[i])), header=True, columns=types, auto_detect=False,
            ignore_errors=True, store_rejects=True, na_values=_NO_NULL,
        ))  # fmt: skip
        con.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT *, {i} AS file FROM complete_lines")
        con.unregister("complete_lines")
        dropped = sum(rejected(con).values())
        if dropped:
            counts[i] = dropped
        selects.append(f"SELECT * FROM {table}")
    return " UNION ALL ".join(selects), counts


def rejected(con: Any) -> dict[str, int]:
    """The rows that did not parse in the reads of ``con`` since the last call, by file path (a
    file read from memory under the name DuckDB gave it)."""
    import duckdb

    try:
        found = con.execute(
            "SELECT s.file_path, count(DISTINCT e.line) FROM reject_errors e "
            "JOIN reject_scans s USING (scan_id, file_id) GROUP BY 1 ORDER BY 1"
        ).fetchall()
    except duckdb.CatalogException:  # nothing was read with store_rejects yet
        return {}
    con.execute("DELETE FROM reject_errors")
    con.execute("DELETE FROM reject_scans")
    return dict(found)


@dataclass
class CsvRows:
    """The rows of files that share a header: Arrow columns (``vpp_stage``, ``step``,
    ``micro_step`` as int64, ``name`` dictionary-encoded, the ops as float64), ``file`` (int64
    numpy: the place of each row's file) and the rows left out because they did not parse, by
    place."""

    table: Any
    file: np.ndarray
    dropped: dict[int, int]


def read(paths: Sequence[str], fields: Sequence[str], columns: Sequence[str]) -> CsvRows:
    """The ``columns`` of these CSV files, which share the header ``fields``: their complete lines
    joined under one header and parsed in one pass (most of the cost of many small files, one a
    step, is per file, not per row); a file with a quote, whose quoted name could hold a line
    break, is parsed alone, and so is each file of a batch the parser cannot read whole (a file
    it cannot read at all has every line counted as dropped). Windows line ends read as ``\n``.

    Raises:
        OSError: a file cannot be read, or is not a regular file (symlinks are refused).
    """
    import pyarrow as pa

    texts = [read_complete_lines(path) for path in paths]
    texts = [text.replace(b"\r\n", b"\n") if b"\r" in text else text for text in texts]
    bodies = [text[text.find(b"\n") + 1 :] if text else b"" for text in texts]
    joined = [i for i, body in enumerate(bodies) if b'"' not in body]
    batches = [joined] + [[i] for i in range(len(paths)) if i not in set(joined)]
    tables, files, dropped = [], [], {}
    for batch in batches:
        counts = np.array([bodies[i].count(b"\n") for i in batch], dtype=np.int64)
        parsed = _parse(bodies, batch, fields, columns)
        if parsed is None and len(batch) == 1:  # not even its own lines parse: all dropped
            dropped[batch[0]] = dropped.get(batch[0], 0) + int(counts[0])
            continue
        line_file = np.repeat(np.array(batch, dtype=np.int64), counts)
        kept = np.ones(len(line_file), dtype=bool)
        if parsed is not None:
            table, rejected_lines = parsed
            kept[rejected_lines] = False
        if parsed is None or kept.sum() != table.num_rows:  # lines not counted as rows: file by file
            if len(batch) > 1:
                batches += [[i] for i in batch]
                continue
            # which lines are the rows is unknown (a blank line, a line break in a quoted name):
            # the rows that did not parse are the ones the parser rejected
            dropped[batch[0]] = dropped.get(batch[0], 0) + len(rejected_lines)
            kept = np.ones(table.num_rows, dtype=bool)
            line_file = np.full(table.num_rows, batch[0], dtype=np.int64)
        for index, count in zip(*np.unique(line_file[~kept], return_counts=True)):
            dropped[int(index)] = dropped.get(int(index), 0) + int(count)
        tables.append(table)
        files.append(line_file[kept])
    if len(tables) > 1:  # names coded by the ENUM (of any index width) or encoded from text: one type
        coded = pa.dictionary(pa.int32(), pa.string())
        tables = [
            t.set_column(t.schema.get_field_index("name"), "name", t["name"].cast(coded)) for t in tables
        ]
    if not tables:  # every batch dropped whole: the empty result of a header alone
        table, _ = _parse([b""], [0], fields, columns) or (None, None)
        tables, files = [table], [np.zeros(0, dtype=np.int64)]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return _whole_labels(CsvRows(table, np.concatenate(files), dropped), columns)


def _parse(
    bodies: list[bytes], batch: list[int], fields: Sequence[str], columns: Sequence[str]
) -> tuple[Any, np.ndarray] | None:
    """The rows of these files' bodies under the header ``fields``, and the places (among their
    lines) of the lines that did not parse; None where DuckDB cannot read them at all (its CSV
    state machine refuses some damage outright instead of rejecting a row)."""
    import duckdb

    header = ",".join(f'"{f}"' if "," in f or '"' in f else f for f in fields).encode() + b"\n"
    con = cursor()
    try:
        con.register("csv_rows", con.read_csv(
            io.BytesIO(header + b"".join(bodies[i] for i in batch)), header=True,
            columns=column_types(fields), auto_detect=False, ignore_errors=True, store_rejects=True,
            na_values=_NO_NULL,
        ))  # fmt: skip
        listed = [c if c == "name" else f'"{c}"' for c in columns]
        table = engine.fetch_coded(con, listed, "csv_rows")
        try:
            lines = con.execute("SELECT DISTINCT line FROM reject_errors").fetchnumpy()["line"]
        except duckdb.CatalogException:  # no reject table: nothing was rejected
            lines = np.zeros(0, dtype=np.int64)
    except (duckdb.InvalidInputException, duckdb.ConversionException):
        return None
    finally:
        con.close()
    return table, np.sort(lines.astype(np.int64)) - 2  # line 1 is the header


def _whole_labels(rows: CsvRows, columns: Sequence[str]) -> CsvRows:
    """``rows`` without those whose step, micro-step or stage is no integer (a step of 2.5 is left
    out, not rounded; counted in ``dropped``), those columns as int64."""
    import pyarrow as pa
    import pyarrow.compute as pc

    labels = [c for c in columns if LABEL_TYPES.get(c) == "DOUBLE"]
    table, file, whole = rows.table, rows.file, None
    for label in labels:
        column = table[label]
        ok = pc.and_(pc.equal(column, pc.trunc(column)), pc.less_equal(pc.abs(column), _LARGEST_LABEL))
        whole = ok if whole is None else pc.and_(whole, ok)
    if whole is not None and not pc.all(whole).as_py():
        keep = whole.to_numpy(zero_copy_only=False)
        for index, count in zip(*np.unique(file[~keep], return_counts=True)):
            rows.dropped[int(index)] = rows.dropped.get(int(index), 0) + int(count)
        table, file = table.filter(whole), file[keep]
    for label in labels:
        table = table.set_column(table.schema.get_field_index(label), label, table[label].cast(pa.int64()))
    return CsvRows(table, file, rows.dropped)
