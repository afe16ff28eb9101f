"""The files of ``format: parquet`` (written by monitor.writers.parquet), for every reader.

In a rank directory, per data type::

    values/data_type={prefix}/step-{step:010d}[.{n}].parquet         one ended step
    values/data_type={prefix}/steps-{first:010d}-{last:010d}.parquet  a merged window of steps
    values/data_type={prefix}/late-{step:010d}-{n}.parquet           records of a step that came
                                                                     after its window was merged

with one row per value: ``rank, step, micro_step, vpp_stage, name, op, value``. A step file that a
merged file covers is left from a kill between merging and deleting: readers skip it. Late files
(of a step whose window was merged or queued for merging) are never merged nor covered. The
query layer reads them (monitor.query.parquet_values).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

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
