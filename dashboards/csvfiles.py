"""Reading the monitor's CSV files as tables, one per file, for the dashboards (the layout msprobe writes).

The layout (file names, header) is monitor.anomaly.rank_csv's, the one place that knows it;
``list_csv_files`` is re-exported from there. The reading is the query layer's
(monitor.query.csv_files: DuckDB, complete lines only): a row that does not parse (wrong field
count, a value that is not a number) is skipped and counted, never guessed; the msprobe columns
``shape`` and ``dtype`` are ignored.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from monitor.anomaly.rank_csv import LABELS, Table, as_table, header_columns, list_csv_files
from monitor.query import csv_files
from monitor.writers.eventfile import open_regular

__all__ = [
    "CsvBounds",
    "CsvTable",
    "csv_bounds",
    "header_ops",
    "list_csv_files",
    "read_csv_file",
    "read_csv_files",
]


@dataclass
class CsvTable:
    """The rows of one CSV file as arrays.

    Attributes:
        ops: statistic columns, in header order.
        vpp_stages: int64 (n,).
        names: the name of each row (n,).
        micro_steps: int64 (n,), or None when the file has no micro_step column.
        steps: int64 (n,).
        values: float64 (n, len(ops)); ``nan``/``inf`` as written.
        skipped: rows that did not parse and were left out.
    """

    ops: tuple[str, ...]
    vpp_stages: np.ndarray
    names: list[str]
    micro_steps: np.ndarray | None
    steps: np.ndarray
    values: np.ndarray
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.names)

    def slice(self, start: int, stop: int) -> CsvTable:
        """Rows [start, stop), as copies (a slice does not keep the whole table alive)."""
        micro = None if self.micro_steps is None else self.micro_steps[start:stop].copy()
        return CsvTable(
            self.ops,
            self.vpp_stages[start:stop].copy(),
            self.names[start:stop],
            micro,
            self.steps[start:stop].copy(),
            self.values[start:stop].copy(),
        )

    @property
    def nbytes(self) -> int:
        """Approximate memory held (for cache accounting)."""
        names = sum(len(n) + 56 for n in self.names)
        micro = 0 if self.micro_steps is None else self.micro_steps.nbytes
        return self.values.nbytes + self.steps.nbytes + self.vpp_stages.nbytes + micro + names


class CsvBounds(NamedTuple):
    """The statistics of a CSV file and the steps of its first and last complete rows."""

    ops: tuple[str, ...]
    first_step: int
    last_step: int


def _step_of(line: bytes) -> int:
    fields = next(csv.reader([line.decode("utf-8", errors="replace")]))
    return int(fields[2])


def csv_bounds(path: str | os.PathLike, probe: int = 65536) -> CsvBounds | None:
    """Ops and first/last step of a CSV file from its first and last lines only; None when it has
    no complete data row (or they do not parse)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, probe, 0)
        tail = os.pread(fd, probe, max(0, size - probe))
    finally:
        os.close(fd)
    lines = head.split(b"\n")
    if len(lines) < 3:  # header, one data row, then what follows the last newline
        return None
    end = tail.rfind(b"\n")
    start = tail.rfind(b"\n", 0, end) + 1
    try:
        _, ops = header_columns(lines[0].decode("utf-8", errors="replace"))
        return CsvBounds(ops, _step_of(lines[1]), _step_of(tail[start:end]))
    except (ValueError, IndexError, StopIteration):
        return None


def header_ops(path: str | os.PathLike) -> tuple[str, ...]:
    """The statistic columns named in a CSV file's header (empty when there is no monitor header).

    Raises:
        OSError: unreadable, or not a regular file (symlinks are refused).
    """
    header = csv_files.read_header(path)
    try:
        return header_columns(header)[1] if header is not None else ()
    except ValueError:
        return ()


def read_csv_file(path: str | os.PathLike) -> CsvTable:
    """Parse one monitor CSV file (complete lines only).

    Raises:
        ValueError: the first line is not a monitor CSV header.
        OSError: the path is not a regular file (symlinks are refused).
    """
    return read_csv_files([path])[0]


def read_csv_files(paths: Sequence[str | os.PathLike]) -> list[CsvTable]:
    """``read_csv_file`` of each path; the files that share a header are read in one query.

    Raises:
        ValueError: a file's first line is not a monitor CSV header.
        OSError: a file is not a regular file (symlinks are refused) or cannot be read.
    """
    tables: list[CsvTable] = [_empty(())] * len(paths)
    groups: dict[str, list[int]] = {}
    for index, path in enumerate(paths):
        header = csv_files.read_header(path)
        if header is not None:
            groups.setdefault(header, []).append(index)
    for header, members in groups.items():
        try:
            has_micro, ops = header_columns(header)
        except ValueError:
            raise ValueError(f"not a monitor CSV header: {header[:200]!r}") from None
        fields = csv_files.header_fields(header)
        columns = [*LABELS[: 4 if has_micro else 3], *ops]
        rows = csv_files.read([os.fspath(paths[i]) for i in members], fields, columns)
        table, file = as_table(rows.table, has_micro, ops), rows.file
        if np.any(file[1:] < file[:-1]):  # read in the files' order, as DuckDB keeps it: else sorted
            order = np.argsort(file, kind="stable")
            table, file = table.rows(order), file[order]
        bounds = np.searchsorted(file, np.arange(len(members) + 1))
        for place, index in enumerate(members):
            start, stop = bounds[place], bounds[place + 1]
            # copies: a file's table (cached on its own) must not keep the whole group's alive
            part = table.rows(np.arange(start, stop))
            tables[index] = as_csv_table(part, rows.dropped.get(place, 0))
    return tables


def as_csv_table(table: Table, skipped: int = 0) -> CsvTable:
    """A rank_csv Table (names coded) as a CsvTable (a name per row)."""
    return CsvTable(
        table.ops,
        table.vpp.astype(np.int64),
        np.array(table.names, dtype=object)[table.codes].tolist(),
        table.micro,
        table.steps,
        table.values,
        skipped,
    )


def _empty(ops: tuple[str, ...]) -> CsvTable:
    ints = np.zeros(0, np.int64)
    return CsvTable(ops, ints, [], None, ints.copy(), np.zeros((0, len(ops))))
