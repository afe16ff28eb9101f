"""Reading one run's per-rank CSV outputs: the one place that knows their layout.

A run's output root holds ``{time}-rank{R}-{id}/`` directories with ``{prefix}_{a}-{b}.csv`` files
(``.{n}.csv`` when an appended run had other columns), header ``vpp_stage,name,step[,micro_step],
<ops>`` (msprobe's layout; its ``shape``/``dtype`` columns are ignored). The listing, header,
complete-line and parsing helpers here also serve the dashboards' reader (dashboards.csvfiles);
the arrays are for the cross-rank analysis (monitor.anomaly.windows), which also reads a data type
written with ``format: parquet`` (monitor.writers.parquet_files) into the same arrays, a window of
steps at a time. The files of one data type and header on a rank are parsed in one call, by
pyarrow's CSV reader where it is installed, else by pandas'. A file being written is read up to
its last complete line; a row with a wrong field count or a cell that is not a number is dropped
and counted, never guessed. Symlinked files and directories are not followed.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import monitor.writers.parquet_files as parquet_files
from monitor.files import RANK_DIR_PATTERN, in_time_range, parse_time_tag
from monitor.writers.eventfile import open_regular

#: ``{prefix}_{a}-{b}.csv``; ``.{n}.csv`` when an appended run had other columns (monitor.writers.csv).
CSV_NAME = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+?)_(?P<start>\d+)-(?P<end>\d+)(?:\.(?P<part>\d+))?\.csv$")
#: header columns that are labels, not statistics.
LABELS = ("vpp_stage", "name", "step", "micro_step")
#: msprobe columns that hold no number.
IGNORED_COLUMNS = ("shape", "dtype")
#: how a NaN value is written.
NAN_TEXT = ("nan", "-nan", "+nan", "NaN")


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
    fields = next(csv.reader([header]))
    if fields[:3] != list(LABELS[:3]):
        raise ValueError(f"not a monitor CSV header: {header.strip()[:200]!r}")
    has_micro = len(fields) > 3 and fields[3] == LABELS[3]
    ops = tuple(f for f in fields[4 if has_micro else 3 :] if f not in IGNORED_COLUMNS)
    return has_micro, ops


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


def parse_arrow(data: bytes, has_micro: bool, ops: tuple[str, ...]) -> Any | None:
    """Monitor CSV text (header first) as an Arrow table of its label and op columns, by pyarrow's
    CSV reader: four times pandas' speed here, with every float correctly rounded as Python
    rounds it. None where pyarrow is missing or a row does not parse (the callers' lenient paths
    then skip and count such rows); a tensor called ``nan`` stays a name."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pa_csv
    except ImportError:
        return None
    labels = list(LABELS[: 4 if has_micro else 3])
    types = {
        **dict.fromkeys(labels, pa.int64()),
        "name": pa.dictionary(pa.int32(), pa.string()),
        **dict.fromkeys(ops, pa.float64()),
    }
    options = pa_csv.ConvertOptions(
        column_types=types,
        include_columns=labels + list(ops),
        null_values=[],
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    try:
        return pa_csv.read_csv(io.BytesIO(data), convert_options=options)
    except (pa.ArrowInvalid, pa.ArrowKeyError):  # a malformed row, or a column the header lacks
        return None


def op_values(arrow: Any, ops: tuple[str, ...]) -> np.ndarray:
    """float64 (rows, ops) of an Arrow table's op columns."""
    if not ops:
        return np.zeros((arrow.num_rows, 0))
    return np.column_stack([arrow[op].to_numpy() for op in ops])


def parse_rows(header: bytes, body: bytes | memoryview) -> tuple[Table | None, int]:
    """Rows under one header as a Table (None: not a monitor header) and the count dropped as
    malformed."""
    try:
        has_micro, ops = header_columns(header.decode("utf-8", "replace"))
    except ValueError:
        return None, 0
    labels = list(LABELS[: 4 if has_micro else 3])
    data = header + b"\n" + body
    arrow = parse_arrow(data, has_micro, ops)
    if arrow is not None:
        codes, names = parquet_files.encoded(arrow["name"])
        return Table(
            ops,
            names,
            codes.astype(np.int32),
            arrow["vpp_stage"].to_numpy().astype(np.int32),
            arrow["micro_step"].to_numpy() if has_micro else None,
            arrow["step"].to_numpy(),
            op_values(arrow, ops),
        ), 0
    from monitor.anomaly.csv_pandas import read_frame  # without pyarrow only: pandas is slow to import

    frame, dropped = read_frame(data, labels, ops)
    names = frame["name"].astype("category").cat
    table = Table(
        ops,
        [str(name) for name in names.categories],
        names.codes.to_numpy(np.int32),
        frame["vpp_stage"].to_numpy(np.int32),
        frame["micro_step"].to_numpy(np.int64) if "micro_step" in labels else None,
        frame["step"].to_numpy(np.int64),
        frame[list(ops)].to_numpy(np.float64).reshape(len(frame), len(ops)),
    )
    return table, dropped


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
    """The rows of ``window`` in these CSV files, each file's rows only within the steps its name
    gives (so that what is compared does not depend on how the steps are cut into windows)."""
    groups: dict[bytes, list[tuple[Part, bytes]]] = {}
    for part in parts:
        try:
            data = read_complete_lines(part.path)
        except OSError as exc:
            warnings.append(f"skipping {part.path}: {exc.strerror or exc}")
            continue
        if data:
            end = data.index(b"\n")
            groups.setdefault(data[:end].rstrip(b"\r"), []).append((part, data[end + 1 :]))
    tables = []
    for header, members in groups.items():
        table, dropped = parse_rows(header, b"".join(body for _, body in members))
        if table is None:
            warnings.append(f"skipping {prefix} files in {rank_dir}: not a monitor CSV header")
            continue
        if dropped:
            warnings.append(f"{rank_dir}: dropped {dropped} malformed {prefix} row(s)")
        keep = (table.steps >= window[0]) & (table.steps <= window[1])
        counts = [body.count(b"\n") for _, body in members]
        if sum(counts) == len(table.steps):  # every row parsed: each file's rows are known
            named = (table.steps >= np.repeat([p.start for p, _ in members], counts)) & (
                table.steps <= np.repeat([p.end for p, _ in members], counts)
            )
            if not named.all():
                warnings.append(
                    f"{rank_dir}: {prefix} rows whose step lies outside the steps their file's name "
                    "gives are left out"
                )
            keep &= named
        if keep.any():
            tables.append(_subset(table, keep))
    return tables


def _subset(table: Table, keep: np.ndarray) -> Table:
    if keep.all():
        return table
    micro = None if table.micro is None else table.micro[keep]
    return Table(
        table.ops,
        table.names,
        table.codes[keep],
        table.vpp[keep],
        micro,
        table.steps[keep],
        table.values[keep],
    )


def _parquet_tables(
    rank_dir: str, prefix: str, paths: list[str], window: tuple[int, int], warnings: list[str]
) -> list[Table]:
    """One data type's live Parquet files as Tables: one per set of ops the entries have (a
    config that changed its ops mid-run), as CSV files with other headers are. A file merged away
    since it was listed makes the files be listed once more; a file cut short or of other
    columns is skipped, and said."""
    try:
        wide = parquet_files.read_wide(paths, window)
    except (FileNotFoundError, ValueError):  # merged away since listed, or cut short
        listed = parquet_files.live_prefixes(rank_dir, (prefix,)).get(prefix, [])
        relisted = [p for p in listed if parquet_files.overlaps(p, window)]
        problems = {path: parquet_files.layout_problem(path) for path in relisted}
        bad = {path: problem for path, problem in problems.items() if problem is not None}
        if bad:
            said = "; ".join(f"{path} ({problem})" for path, problem in bad.items())
            warnings.append(f"skipping Parquet files the monitor cannot read: {said}")
        wide = parquet_files.read_wide([path for path in relisted if path not in bad], window)
    if not len(wide.steps):
        return []
    names, name_codes = parquet_files.distinct_names(tuple(wide.names))
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
