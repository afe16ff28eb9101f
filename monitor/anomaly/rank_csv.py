"""Reading one run's per-rank CSV outputs: the one place that knows their layout.

A run's output root holds ``{time}-rank{R}-{id}/`` directories with ``{prefix}_{a}-{b}.csv`` files
(``.{n}.csv`` when an appended run had other columns), header ``vpp_stage,name,step[,micro_step],
<ops>`` (msprobe's layout; its ``shape``/``dtype`` columns are ignored). The listing and header
helpers here also serve the dashboards' reader (dashboards.csvfiles); the arrays are for the
cross-rank analysis (monitor.anomaly.windows), which also reads a data type written with
``format: parquet`` (monitor.writers.parquet_files) into the same arrays, a window of steps at a
time. The files of one data type and header on a rank are read in one query of the query layer
(monitor.query.csv_files: complete lines only, rows that do not parse dropped and counted, never
guessed). Symlinked files and directories are not followed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import monitor.writers.parquet_files as parquet_files
from monitor.files import RANK_DIR_PATTERN, in_time_range, parse_time_tag
from monitor.query import csv_files, parquet_values
from monitor.query.csv_files import (
    IGNORED_COLUMNS,
    LABEL_TYPES,
    header_fields,
)

#: ``{prefix}_{a}-{b}.csv``; ``.{n}.csv`` when an appended run had other columns (monitor.writers.csv).
CSV_NAME = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+?)_(?P<start>\d+)-(?P<end>\d+)(?:\.(?P<part>\d+))?\.csv$")
#: header columns that are labels, not statistics.
LABELS = tuple(LABEL_TYPES)


class DuplicateRankError(ValueError):
    """A rank has several output directories under one root (several runs)."""


class CsvFile(NamedTuple):
    """One CSV file of a rank directory, with the step window from its name."""

    path: str
    prefix: str
    start: int
    end: int
    part: int


@dataclass
class Table:
    """The rows of one data type and header on one rank.

    Attributes:
        ops: statistic columns in header order.
        names: distinct names; ``codes`` index it.
        codes: int32 (n,) name index of each row.
        vpp: int32 (n,) vpp stage of each row.
        micro: int64 (n,) micro-step of each row, or None without a micro_step column.
        steps: int64 (n,).
        values: float64 (n, len(ops)); NaN/Inf as written.
    """

    ops: tuple[str, ...]
    names: list[str]
    codes: np.ndarray
    vpp: np.ndarray
    micro: np.ndarray | None
    steps: np.ndarray
    values: np.ndarray

    def rows(self, chosen: slice | np.ndarray) -> Table:
        """The rows ``chosen`` (a slice, a mask or indices), with the same names and ops."""
        micro = None if self.micro is None else self.micro[chosen]
        return Table(
            self.ops,
            self.names,
            self.codes[chosen],
            self.vpp[chosen],
            micro,
            self.steps[chosen],
            self.values[chosen],
        )


def find_rank_dirs(
    root: str, ranks: frozenset[int] | None = None, within: tuple[Any, Any] = (None, None)
) -> dict[int, str]:
    """rank -> its directory under root, in rank order (only ``ranks`` unless None, and only
    those whose time tag lies in ``within``, from ``monitor.files.time_bounds``).

    Raises:
        DuplicateRankError: a rank has more than one directory (the root holds several runs).
    """
    found: dict[int, list[str]] = {}
    with os.scandir(root) as entries:
        for entry in entries:
            match = RANK_DIR_PATTERN.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                rank = int(match.group(2))
                if within != (None, None):
                    stamp = parse_time_tag(match.group(1))
                    if stamp is None or not in_time_range(stamp, within):
                        continue
                if ranks is None or rank in ranks:
                    found.setdefault(rank, []).append(entry.path)
    for rank, paths in sorted(found.items()):
        if len(paths) > 1:
            names = ", ".join(sorted(os.path.basename(p) for p in paths))
            raise DuplicateRankError(f"rank {rank} has {len(paths)} output directories ({names})")
    return {rank: paths[0] for rank, paths in sorted(found.items())}


def newer_run_than(root: str, rank_dirs: dict[int, str]) -> str | None:
    """A directory under ``root`` of one of ``rank_dirs``' ranks with a later time tag than that
    rank's (a later run than the one chosen by time), or None. Ranks are compared each with its
    own: their clocks name their directories, seconds apart within one run."""

    def stamp(name: str) -> tuple[int, Any] | None:
        match = RANK_DIR_PATTERN.match(name)
        return (int(match.group(2)), parse_time_tag(match.group(1))) if match else None

    chosen = dict(filter(None, (stamp(os.path.basename(p)) for p in rank_dirs.values())))
    with os.scandir(root) as entries:
        stamps = [(e.path, stamp(e.name)) for e in entries]
    later = [path for path, s in stamps if s and s[1] and chosen.get(s[0]) and s[1] > chosen[s[0]]]
    return min(later) if later else None


def list_csv_files(
    rank_dir: str | os.PathLike, types: tuple[str, ...] | None = None
) -> dict[str, list[CsvFile]]:
    """prefix -> its CSV files in step-window order, for the prefixes in ``types`` (None: all).

    Regular files only.
    """
    found: dict[str, list[CsvFile]] = {}
    with os.scandir(rank_dir) as entries:
        for entry in entries:
            match = CSV_NAME.match(entry.name)
            if (
                match
                and (types is None or match.group("prefix") in types)
                and entry.is_file(follow_symlinks=False)
            ):
                prefix, part = match.group("prefix"), int(match.group("part") or 0)
                found.setdefault(prefix, []).append(
                    CsvFile(entry.path, prefix, int(match.group("start")), int(match.group("end")), part)
                )
    for files in found.values():
        files.sort(key=lambda f: (f.start, f.part, f.end))
    return found


def has_csv_files(rank_dir: str | os.PathLike) -> bool:
    """Whether the directory holds a monitor CSV file (stops at the first one)."""
    with os.scandir(rank_dir) as entries:
        return any(CSV_NAME.match(e.name) and e.is_file(follow_symlinks=False) for e in entries)


def list_type_files(rank_dir: str, types: tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """prefix -> the paths of its CSV files, as list_csv_files orders them."""
    return {prefix: [f.path for f in files] for prefix, files in list_csv_files(rank_dir, types).items()}


def header_columns(header: str) -> tuple[bool, tuple[str, ...]]:
    """Whether a monitor CSV header has a micro_step column, and its statistic columns.

    Raises:
        ValueError: not a monitor CSV header.
    """
    fields = header_fields(header)
    if fields[:3] != list(LABELS[:3]):
        raise ValueError(f"not a monitor CSV header: {header.strip()[:200]!r}")
    has_micro = len(fields) > 3 and fields[3] == LABELS[3]
    ops = tuple(f for f in fields[4 if has_micro else 3 :] if f not in IGNORED_COLUMNS)
    return has_micro, ops


def op_values(arrow: Any, ops: tuple[str, ...]) -> np.ndarray:
    """float64 (rows, ops) of an Arrow table's op columns."""
    if not ops:
        return np.zeros((arrow.num_rows, 0))
    return np.column_stack([arrow[op].to_numpy() for op in ops])


def as_table(arrow: Any, has_micro: bool, ops: tuple[str, ...]) -> Table:
    """An Arrow table of label and op columns (as ``monitor.query.csv_files.read`` gives) as a Table."""
    codes, names = parquet_values.encoded(arrow["name"])
    return Table(
        ops,
        names,
        codes.astype(np.int32),
        arrow["vpp_stage"].to_numpy().astype(np.int32),
        arrow["micro_step"].to_numpy() if has_micro else None,
        arrow["step"].to_numpy(),
        op_values(arrow, ops),
    )


class Part(NamedTuple):
    """One file of a data type on a rank, with the steps its name says it holds."""

    path: str
    start: int
    end: int
    parquet: bool


def list_parts(rank_dir: str, types: tuple[str, ...] | None = None) -> dict[str, list[Part]]:
    """prefix -> its files on a rank: its CSV files, or where it has none its live Parquet files.

    Raises:
        OSError: the directory cannot be listed.
    """
    found = {
        prefix: [Part(f.path, f.start, f.end, False) for f in files]
        for prefix, files in list_csv_files(rank_dir, types).items()
    }
    for prefix, paths in parquet_files.live_prefixes(rank_dir, types).items():
        if prefix not in found:
            found[prefix] = [Part(path, *parquet_files.part_steps(path), True) for path in paths]  # type: ignore[misc]
    return found


def read_parts(
    rank_dir: str, prefix: str, parts: list[Part], window: tuple[int, int], warnings: list[str]
) -> list[Table]:
    """The rows of steps ``window`` (first, last) in these files of one data type on a rank, as
    Tables (one per CSV header or set of Parquet ops); what cannot be read is skipped and told in
    ``warnings``."""
    csv_parts = [part for part in parts if not part.parquet]
    if csv_parts:
        return _csv_tables(rank_dir, prefix, csv_parts, window, warnings)
    try:
        return _parquet_tables(rank_dir, prefix, [part.path for part in parts], window, warnings)
    except (ImportError, OSError, ValueError) as exc:
        warnings.append(f"skipping the {prefix} Parquet files in {rank_dir}: {exc}")
        return []


def _csv_tables(
    rank_dir: str, prefix: str, parts: list[Part], window: tuple[int, int], warnings: list[str]
) -> list[Table]:
    """The rows of ``window`` in these CSV files, one Table per header, each file's rows only
    within the steps its name gives (so that what is compared does not depend on how the steps
    are cut into windows)."""
    groups: dict[str, list[Part]] = {}
    for part in parts:
        try:
            header = csv_files.read_header(part.path)
        except OSError as exc:
            warnings.append(f"skipping {part.path}: {exc.strerror or exc}")
            continue
        if header is not None:
            groups.setdefault(header, []).append(part)
    tables = []
    for header, members in groups.items():
        try:
            has_micro, ops = header_columns(header)
        except ValueError:
            warnings.append(f"skipping {prefix} files in {rank_dir}: not a monitor CSV header")
            continue
        columns = [*LABELS[: 4 if has_micro else 3], *ops]
        try:
            rows = csv_files.read([p.path for p in members], header_fields(header), columns)
        except OSError as exc:
            warnings.append(f"skipping {prefix} files in {rank_dir}: {exc}")
            continue
        dropped = sum(rows.dropped.values())
        if dropped:
            warnings.append(f"{rank_dir}: dropped {dropped} malformed {prefix} row(s)")
        table = as_table(rows.table, has_micro, ops)
        file = rows.file
        named = (table.steps >= np.array([p.start for p in members])[file]) & (
            table.steps <= np.array([p.end for p in members])[file]
        )
        if not named.all():
            warnings.append(
                f"{rank_dir}: {prefix} rows whose step lies outside the steps their file's name "
                "gives are left out"
            )
        keep = named & (table.steps >= window[0]) & (table.steps <= window[1])
        if keep.any():
            tables.append(table if keep.all() else table.rows(keep))
    return tables


def _parquet_tables(
    rank_dir: str, prefix: str, paths: list[str], window: tuple[int, int], warnings: list[str]
) -> list[Table]:
    """One data type's live Parquet files as Tables: one per set of ops the entries have (a
    config that changed its ops mid-run), as CSV files with other headers are. A file merged away
    since it was listed makes the files be listed once more; a file cut short or of other
    columns is skipped, and said."""
    try:
        wide = parquet_values.read_wide(paths, window)
    except (FileNotFoundError, ValueError):  # merged away since listed, or cut short
        listed = parquet_files.live_prefixes(rank_dir, (prefix,)).get(prefix, [])
        relisted = [p for p in listed if parquet_files.overlaps(p, window)]
        problems = {path: parquet_files.layout_problem(path) for path in relisted}
        bad = {path: problem for path, problem in problems.items() if problem is not None}
        if bad:
            said = "; ".join(f"{path} ({problem})" for path, problem in bad.items())
            warnings.append(f"skipping Parquet files the monitor cannot read: {said}")
        wide = parquet_values.read_wide([path for path in relisted if path not in bad], window)
    if not len(wide.steps):
        return []
    names, name_codes = parquet_values.distinct_names(tuple(wide.names))
    if wide.present is None:  # every op of every entry: one Table
        pattern_of, codes = None, [(1 << len(wide.ops)) - 1]
    else:  # the set of ops an entry has, as one integer (a bit per op)
        pattern_of = wide.present.astype(np.int64) @ (1 << np.arange(len(wide.ops), dtype=np.int64))
        codes = np.unique(pattern_of).tolist()
    tables = []
    for code in codes:
        pattern = np.array([bool(code >> i & 1) for i in range(len(wide.ops))])
        if not pattern.any():
            continue
        chosen = slice(None) if len(codes) == 1 else pattern_of == code  # slices: no copies
        row_of = wide.row_of[chosen]
        tables.append(
            Table(
                tuple(op for op, there in zip(wide.ops, pattern) if there),
                names,
                name_codes[row_of],
                wide.vpp.astype(np.int32)[row_of],
                None if wide.micro is None else wide.micro[row_of],
                wide.steps[chosen],
                wide.values[chosen] if pattern.all() else wide.values[chosen][:, pattern],
            )
        )
    return tables
