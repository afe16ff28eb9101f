"""The files of ``format: parquet`` (written by monitor.writers.parquet), for every reader.

In a rank directory, per data type::

    values/data_type={prefix}/step-{step:010d}[.{n}].parquet         one ended step
    values/data_type={prefix}/steps-{first:010d}-{last:010d}.parquet  a merged window of steps
    values/data_type={prefix}/late-{step:010d}-{n}.parquet           records of a step that came
                                                                     after its window was merged

with one row per value: ``rank, step, micro_step, vpp_stage, name, op, value``. A step file that a
merged file covers is left from a kill between merging and deleting: readers skip it. Late files
(of a step whose window was merged or queued for merging) are never merged nor covered.
``read_wide`` turns the long rows back into one row per tensor and step with a column per op, the
shape the CSV files have, for the dashboard and the cross-rank analysis.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitor.files import RANK_DIR_PATTERN

#: the subdirectory of a rank's directory that holds the values
VALUES_DIR = "values"
#: the file that marks a dataset ``trainmon compact`` wrote (its sources and value type)
DATASET_MANIFEST = "compact.json"


def not_a_run_hint(path: str) -> str:
    """For an error about a directory with no run in it: a word when it is a compacted dataset,
    which the commands that read a run do not take, or one rank's directory, where the run's
    output directory (its parent) was meant (empty otherwise)."""
    if RANK_DIR_PATTERN.match(os.path.basename(os.path.normpath(path))):
        parent = os.path.dirname(os.path.normpath(path))
        return (
            f"; {path!r} is one rank's directory: give the run's output directory that holds it, {parent!r}"
        )
    if not os.path.isfile(os.path.join(path, DATASET_MANIFEST)):
        return ""
    return (
        f"; {path!r} is a dataset written by trainmon compact: give the run's output directory, or "
        "query the dataset with SQL (docs/dashboards.md)"
    )


_STEP_FILE = re.compile(r"step-(\d+)(?:\.\d+)?\.parquet")
_MERGED_FILE = re.compile(r"steps-(\d+)-(\d+)\.parquet")
_LATE_FILE = re.compile(r"late-(\d+)-\d+\.parquet")
#: the columns a reader needs (``rank`` is the directory's)
COLUMNS = ["step", "micro_step", "vpp_stage", "name", "op", "value"]


def step_file_name(step: int, copy: int = 0) -> str:
    """The name of a step's file; ``copy`` > 0 for records of the step that came after it."""
    return f"step-{step:010d}.parquet" if copy == 0 else f"step-{step:010d}.{copy}.parquet"


def merged_file_name(first: int, last: int) -> str:
    return f"steps-{first:010d}-{last:010d}.parquet"


def late_file_name(step: int, copy: int) -> str:
    return f"late-{step:010d}-{copy}.parquet"


def schema() -> Any:
    """The columns of every file (names and ops dictionary-encoded: a few distinct strings)."""
    import pyarrow as pa

    text = pa.dictionary(pa.int32(), pa.string())
    return pa.schema(
        [
            ("rank", pa.int64()),
            ("step", pa.int64()),
            ("micro_step", pa.int64()),
            ("vpp_stage", pa.int64()),
            ("name", text),
            ("op", text),
            ("value", pa.float64()),
        ]
    )


def file_options(level: int) -> dict[str, Any]:
    """How every file is encoded (pyarrow's writer options): zstd at ``level``; the labels as
    dictionaries (a few distinct values, long runs), the values never (nearly all distinct: a
    dictionary of them is larger and slower to decode than their bytes split by significance,
    7.9 against 9.4 bytes a value compressed and 12 against 26 ns a value to decode)."""
    return {
        "compression": "zstd",
        "compression_level": level,
        "use_dictionary": [column for column in ("rank", *COLUMNS) if column != "value"],
        "use_byte_stream_split": ["value"],
        "data_page_version": "2.0",
    }


def _parsed(name: str) -> tuple[str, int, int] | None:
    """``("merged" | "step" | "late", first step, last step)`` of a file name, None: not ours."""
    if match := _MERGED_FILE.fullmatch(name):
        return "merged", int(match[1]), int(match[2])
    for kind, pattern in (("step", _STEP_FILE), ("late", _LATE_FILE)):
        if match := pattern.fullmatch(name):
            return kind, int(match[1]), int(match[1])
    return None


def scan(directory: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """The merged files (first, last, path), the step files (step, path) and the late files
    (step, path) of one data type; regular files only, never through a symbolic link."""
    merged, steps, late = [], [], []
    try:
        entries = sorted(
            (entry.name, entry.path)
            for entry in os.scandir(directory)
            if entry.is_file(follow_symlinks=False)
        )
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for name, path in entries:
        parsed = _parsed(name)
        if parsed is None:
            continue
        kind, first, last = parsed
        if kind == "merged":
            merged.append((first, last, path))
        else:
            (steps if kind == "step" else late).append((first, path))
    return merged, steps, late


def covered(step: int, merged: list[tuple[int, int, str]]) -> bool:
    """Whether a merged file holds ``step``."""
    return any(first <= step <= last for first, last, _ in merged)


def part_steps(path: str) -> tuple[int, int] | None:
    """The first and last step of a live Parquet file, from its name (None: not one of ours)."""
    parsed = _parsed(os.path.basename(path))
    return None if parsed is None else parsed[1:]


def live_parts(directory: str) -> list[str]:
    """The files of one data type's directory (``values/data_type={prefix}``) that hold its
    values once each: merged files, step files that no merged file covers, and late files."""
    merged, steps, late = scan(directory)
    uncovered = [path for step, path in steps if not covered(step, merged)]
    return [path for *_, path in merged] + uncovered + [path for _, path in late]


def existing_prefixes(rank_dir: str) -> list[str]:
    """The data types that have a directory under ``values/`` (with files or not)."""
    root = os.path.join(rank_dir, VALUES_DIR)
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [name.removeprefix("data_type=") for name in names if name.startswith("data_type=")]


def live_prefixes(rank_dir: str, types: Sequence[str] | None = None) -> dict[str, list[str]]:
    """data type -> its live Parquet files in a rank directory (only ``types`` unless None)."""
    found = {}
    for prefix in existing_prefixes(rank_dir):
        wanted = types is None or prefix in types
        if wanted and (parts := live_parts(os.path.join(rank_dir, VALUES_DIR, f"data_type={prefix}"))):
            found[prefix] = parts
    return found


def _constant_columns(paths: Sequence[str]) -> dict[str, Any]:
    """The label columns that hold one value in every row group of these files (None: only
    nulls, as ``micro_step`` without micro-steps), from the files' footers: a column known to be
    constant need not be decoded, which saves a third of a read.

    Raises:
        pyarrow.ArrowException: a file is not a whole Parquet file.
        ValueError: a file has not the layout's columns.
        OSError: a file cannot be read.
    """
    import pyarrow.parquet as pq

    seen: dict[str, set] = {"micro_step": set(), "vpp_stage": set(), "op": set()}
    for path in paths:
        meta = pq.read_metadata(path)
        names = [meta.schema.column(i).name for i in range(meta.num_columns)]
        if any(column not in names for column in COLUMNS):
            raise ValueError(f"{path}: {layout_problem(path)}")
        for group in range(meta.num_row_groups):
            for column, values in list(seen.items()):
                chunk = meta.row_group(group).column(names.index(column)) if column in names else None
                stats = chunk.statistics if chunk is not None else None
                if stats is None:
                    del seen[column]
                elif stats.null_count == chunk.num_values:
                    values.add(None)
                elif stats.null_count == 0 and stats.has_min_max and stats.min == stats.max:
                    values.add(stats.min)
                else:
                    del seen[column]
    return {column: values.pop() for column, values in seen.items() if len(values) == 1}


def _within(path: str, window: tuple[int, int]) -> bool:
    steps = part_steps(path)
    return steps is not None and window[0] <= steps[0] and steps[1] <= window[1]


def overlaps(path: str, window: tuple[int, int]) -> bool:
    """Whether a live file's name says it holds some of the steps ``window`` (first, last)."""
    steps = part_steps(path)
    return steps is not None and steps[0] <= window[1] and steps[1] >= window[0]


def layout_problem(path: str) -> str | None:
    """Why a file is not a whole Parquet file of the layout (cut short by a disk fault, not
    Parquet, other columns), from its footer; None where it is one."""
    import pyarrow.parquet as pq

    try:
        names = set(pq.read_schema(path).names)
    except Exception:  # cut short, empty, not Parquet
        return "not a whole Parquet file"
    missing = [column for column in COLUMNS if column not in names]
    if len(missing) == len(COLUMNS):
        return f"none of the layout's columns ({', '.join(COLUMNS)})"
    return f"no column {', '.join(missing)} of the layout" if missing else None


def row_count(path: str) -> int | None:
    """The rows of a Parquet file, from its footer; None where it is not a whole Parquet file (a
    disk fault can leave one cut short, which readers skip rather than fail on)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # cut short, empty, not Parquet
        return None


def file_ops(path: str) -> tuple[str, ...]:
    """The ops a file holds, in the order first seen.

    Raises:
        ValueError, OSError: the file cannot be read.
    """
    import pyarrow.parquet as pq

    return tuple(encoded(pq.read_table(path, columns=["op"])["op"])[1])


@dataclass
class WideRows:
    """Long rows as one entry per tensor row and step, one column per op.

    Attributes:
        ops: the statistics, in the order first seen.
        vpp, names, micro: the distinct row labels (``micro`` None where no row has a micro-step).
        row_of: int64 (n,) the label of each entry.
        steps: int64 (n,) the step of each entry.
        values: float64 (n, ops); ``present`` (n, ops) marks the values the files have (None: all).
    """

    ops: tuple[str, ...]
    vpp: np.ndarray
    names: list[str]
    micro: np.ndarray | None
    row_of: np.ndarray
    steps: np.ndarray
    values: np.ndarray
    present: np.ndarray | None


def encoded(column: Any) -> tuple[np.ndarray, list[str]]:
    """Codes and distinct values of an Arrow string column (plain or dictionary-encoded, as the
    writer stores it and the CSV reader reads names)."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        encoded = column.unify_dictionaries().combine_chunks()
    else:
        encoded = column.combine_chunks().dictionary_encode()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), encoded.dictionary.to_pylist()


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` of non-negative integers, without sorting where
    their range is small (the usual case: tensors x steps, most of them present)."""
    span = int(keys.max()) + 1
    if span > 4 * len(keys):
        return np.unique(keys, return_inverse=True)
    used = np.zeros(span, dtype=bool)
    used[keys] = True
    distinct = np.flatnonzero(used)
    position = np.empty(span, dtype=np.int64)
    position[distinct] = np.arange(len(distinct))
    return distinct, position[keys]


@functools.lru_cache(maxsize=8)
def distinct_names(names: tuple[str, ...]) -> tuple[list[str], np.ndarray]:
    """The sorted distinct names and each name's index among them (int32). Cached: the files of
    a run nearly always share one list of names, so it is sorted once (callers do not change
    the list they get)."""
    distinct, codes = np.unique(np.array(names, dtype=object), return_inverse=True)
    return distinct.tolist(), codes.astype(np.int32)


def read_wide(paths: Sequence[str], window: tuple[int, int] | None = None) -> WideRows:
    """The values of these files (of one data type) as WideRows, only of the steps ``window``
    (first, last) unless None. Each value is one row of the files (the writer never writes a
    tensor's value of a step twice), so with one op every row is an entry of its own.

    Raises:
        ValueError: a file is not a whole Parquet file of the layout.
        OSError: a file cannot be read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        steps = None
        if window is not None and not all(_within(path, window) for path in paths):  # a filter costs a third
            steps = [("step", ">=", window[0]), ("step", "<=", window[1])]
        constant = _constant_columns(paths)
        columns = [column for column in COLUMNS if column not in constant]
        table = pq.read_table(list(paths), columns=columns, filters=steps) if paths else None
    except pa.ArrowException as exc:  # cut short, or other columns
        raise ValueError(str(exc)) from exc
    if table is None or table.num_rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return WideRows((), empty, [], None, empty, empty, np.zeros((0, 0)), None)
    rows = table.num_rows
    names, name_list = encoded(table["name"])
    if "op" in constant:
        op_codes, ops = 0, [constant["op"]]  # one op: column 0 of every row
    else:
        op_codes, ops = encoded(table["op"])
    steps = table["step"].to_numpy()
    # a constant column as one element (broadcast below)
    vpp = np.full(1, constant["vpp_stage"]) if "vpp_stage" in constant else table["vpp_stage"].to_numpy()
    if "micro_step" in constant:
        has_micro = constant["micro_step"] is not None
        micro = np.full(1, -1 if constant["micro_step"] is None else constant["micro_step"])
    else:
        has_micro = table["micro_step"].null_count < rows
        micro = table["micro_step"].fill_null(-1).to_numpy()
    if len(ops) == 1 and not has_micro and vpp.min() == vpp.max():  # the common case, without sorting
        return WideRows(
            tuple(ops),
            np.full(len(name_list), vpp[0]),
            name_list,
            None,
            names,
            steps,
            table["value"].to_numpy().reshape(-1, 1),
            None,
        )
    # one integer per row label, then one per label and step
    vpp_low, micro_span, count = int(vpp.min()), int(micro.max()) + 2, len(name_list)
    labels, label_of = _distinct(((vpp - vpp_low) * micro_span + (micro + 1)) * count + names)
    first = int(steps.min())
    entries, entry_of = _distinct((steps - first) * len(labels) + label_of)
    values = np.full((len(entries), len(ops)), np.nan)
    present = np.zeros(values.shape, dtype=bool)
    values[entry_of, op_codes] = table["value"].to_numpy()
    present[entry_of, op_codes] = True
    rest = labels // count
    return WideRows(
        tuple(ops),
        rest // micro_span + vpp_low,
        [name_list[i] for i in labels % count],
        rest % micro_span - 1 if has_micro else None,
        entries % len(labels),
        entries // len(labels) + first,
        values,
        None if present.all() else present,
    )
