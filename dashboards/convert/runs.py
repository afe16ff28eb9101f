"""What the converters share: choosing rank directories, checking arguments, reading one data type.

A data type is read from a rank directory's CSV files, or where it has none from its live
Parquet files (``format: parquet``), so a run written either way converts alike.

Fixes of msprobe's converters: a directory whose name looks like a rank
directory but is not one (bad time tag, a file, a symlink) is skipped with a warning instead of
aborting everything; when several directories of one rank are in the time range (a restarted job),
all are read in time order instead of whichever the file system listed last; a (row, step) written
twice keeps the later value and is counted, instead of abandoning the remaining files or crashing.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dashboards.convert.commands import DATA_TYPES, MAX_PROCESSES
from dashboards.csvfiles import CsvTable, as_csv_table, read_csv_file, read_csv_files
from monitor.anomaly import rank_csv
from monitor.datatypes.tasks import RowKey
from monitor.files import RANK_DIR_PATTERN, in_time_range, parse_time_tag, time_bounds
from monitor.writers.parquet_files import not_a_run_hint

logger = logging.getLogger("trainmon")


class ConvertError(ValueError):
    """A bad argument of a converter (the message names it, its value and what was expected)."""


def check_processes(process_num: object) -> int:
    if type(process_num) is not int or not 1 <= process_num <= MAX_PROCESSES:
        raise ConvertError(f"process_num: expected an integer in [1, {MAX_PROCESSES}], got {process_num!r}")
    return process_num


def check_types(data_type_list: object) -> tuple[str, ...] | None:
    """None (every data type found) or the requested data types, checked."""
    if data_type_list is None:
        return None
    if isinstance(data_type_list, str) or not isinstance(data_type_list, (list, tuple)) or not data_type_list:
        raise ConvertError(f"data_type_list: expected a non-empty list of data types, got {data_type_list!r}")
    unknown = [t for t in data_type_list if t not in DATA_TYPES]
    if unknown:
        raise ConvertError(
            f"data_type_list: unknown data type(s) {unknown}; expected some of {list(DATA_TYPES)}"
        )
    return tuple(dict.fromkeys(data_type_list))


def select_rank_dirs(
    monitor_path: str, time_start: str | None = None, time_end: str | None = None
) -> dict[int, list[str]]:
    """rank -> its directories under ``monitor_path`` with a time tag in [start, end], oldest first."""
    if not isinstance(monitor_path, (str, os.PathLike)) or not os.path.isdir(monitor_path):
        raise ConvertError(f"monitor_path: expected an existing directory, got {monitor_path!r}")
    try:
        bounds = time_bounds(time_start, time_end, ("time_start", "time_end"))
    except ValueError as exc:
        raise ConvertError(str(exc)) from None
    found: dict[int, list[tuple[_dt.datetime, str]]] = {}
    for entry in sorted(os.scandir(monitor_path), key=lambda e: e.name):
        match = RANK_DIR_PATTERN.match(entry.name)
        if match is None:
            continue
        stamp = parse_time_tag(match.group(1))
        if stamp is None or not entry.is_dir(follow_symlinks=False):
            logger.warning("trainmon: skipping %s: not a rank directory with a valid time tag", entry.path)
            continue
        if in_time_range(stamp, bounds):
            found.setdefault(int(match.group(2)), []).append((stamp, entry.path))
    return {rank: [path for _, path in sorted(items)] for rank, items in sorted(found.items())}


def found_types(dirs: Sequence[str]) -> list[str]:
    """The data types with CSV or live Parquet files in any of ``dirs``."""
    types: dict[str, None] = {}
    for path in dirs:
        types.update(dict.fromkeys(rank_csv.list_parts(path)))
    return list(types)


@dataclass
class Selection:
    """What a converter was asked to convert: one job ``(rank, its directories, data type)`` each.

    Attributes:
        processes: worker processes to use.
        ranks: rank -> its directories in the time range, oldest first.
        jobs: one per rank and data type, in rank order.
    """

    processes: int
    ranks: dict[int, list[str]]
    jobs: list[tuple[int, list[str], str]]


def select_jobs(
    monitor_path: str,
    time_start: str | None,
    time_end: str | None,
    process_num: int,
    data_type_list: list[str] | None,
) -> Selection:
    """Check a converter's common arguments and list its jobs (data types: the requested, or every one found).

    Raises:
        ConvertError: a bad argument, no rank directory in the time range, or none of them holds
            a CSV or Parquet file (of the requested data types).
    """
    processes = check_processes(process_num)
    types = check_types(data_type_list)
    ranks = select_rank_dirs(monitor_path, time_start, time_end)
    if not ranks:
        every = select_rank_dirs(monitor_path) if time_start or time_end else {}
        tags = sorted(
            {RANK_DIR_PATTERN.match(os.path.basename(d)).group(1) for ds in every.values() for d in ds}
        )
        raise ConvertError(
            f"monitor_path: no {{time}}-rank{{R}}-{{id}} directory in range under {monitor_path!r}"
            + (f" (the time tags there: {', '.join(tags)})" if tags else not_a_run_hint(monitor_path))
        )
    found = {rank: found_types(dirs) for rank, dirs in ranks.items()}
    there = {prefix for prefixes in found.values() for prefix in prefixes}
    where = f"in the {len(ranks)} rank director{'y' if len(ranks) == 1 else 'ies'} under {monitor_path!r}"
    if not there:
        raise ConvertError(
            f"monitor_path: no CSV or Parquet files {where}; a run written with format tensorboard "
            "has none: TensorBoard reads it as it is, `trainmon compact` turns it into a Parquet dataset"
        )
    absent = [t for t in types or () if t not in there]
    if types and len(absent) == len(types):
        raise ConvertError(
            f"data_type_list: no CSV or Parquet files of {', '.join(types)} {where}; "
            f"they hold {', '.join(sorted(there))}"
        )
    if absent:
        logger.warning(
            "trainmon: no CSV or Parquet files of %s in the rank directories; converting the rest", absent
        )
    jobs = [(rank, dirs, prefix) for rank, dirs in ranks.items() for prefix in (types or found[rank])]
    return Selection(processes, ranks, jobs)


def job_label(job: tuple) -> str:
    """``rank{R}/{data type}`` of a job (for the progress bar)."""
    return f"rank{job[0]}/{job[2]}"


@dataclass
class Series:
    """One data type of one rank, deduplicated: entry i is row ``rows[ids[i]]`` at ``steps[i]``.

    Entries are sorted by (step, first appearance of the row); ``present[i, j]`` says whether op j
    was written for entry i (files of one data type normally all have the same ops).
    """

    ops: tuple[str, ...]
    rows: list[RowKey]
    has_micro: bool
    ids: np.ndarray
    steps: np.ndarray
    values: np.ndarray
    present: np.ndarray
    duplicates: int = 0
    skipped: int = 0


def _tables(rank_dir: str, prefix: str) -> list[CsvTable]:
    """A data type's rows in a rank directory: its CSV files, or where it has none its live
    Parquet files (``rank_csv.list_parts`` decides), one CsvTable per set of ops; Parquet files
    that cannot be read, and CSV files whose first line is not a monitor header, are skipped
    with a warning naming them."""
    parts = rank_csv.list_parts(rank_dir, (prefix,)).get(prefix, [])
    if not any(part.parquet for part in parts):
        try:
            return read_csv_files([part.path for part in parts])
        except ValueError:  # one of them is not a monitor CSV file: the others are read
            return [table for part in parts if (table := _csv_table_or_none(part.path)) is not None]
    warnings: list[str] = []
    every_step = (-(2**62), 2**62)
    tables = rank_csv.read_parts(rank_dir, prefix, parts, every_step, warnings)
    for warning in warnings:
        logger.warning("trainmon: %s", warning)
    return [as_csv_table(table) for table in tables]


def _csv_table_or_none(path: str) -> CsvTable | None:
    try:
        return read_csv_file(path)
    except ValueError as exc:
        logger.warning("trainmon: skipping %s: %s", path, exc)
        return None


def read_series(dirs: Sequence[str], prefix: str) -> Series | None:
    """All rows of ``prefix`` in ``dirs`` (in order; later files win on a repeated (row, step)): a
    directory's CSV files, or where it has none its live Parquet files."""
    tables = [table for path in dirs for table in _tables(path, prefix)]
    skipped = sum(t.skipped for t in tables)
    tables = [t for t in tables if len(t)]
    if not tables:
        return None
    ops = tuple(dict.fromkeys(op for t in tables for op in t.ops))
    steps, values, present = [], [], []
    # the distinct rows in the order first seen, numbered once each
    micro = [t.micro_steps if t.micro_steps is not None else np.full(len(t), -1) for t in tables]
    levels = [
        pd.factorize(column)
        for column in (
            np.concatenate([t.vpp_stages for t in tables]),
            np.array([n for t in tables for n in t.names], dtype=object),
            np.concatenate(micro),
        )
    ]
    (vpp, vpps), (name, names), (micro_code, micros) = levels
    all_ids, first = pd.factorize((vpp * len(names) + name) * len(micros) + micro_code)
    rest, m = np.divmod(first, len(micros))
    v, n = np.divmod(rest, len(names))
    number = {
        RowKey(int(a), b, int(c)): index for index, (a, b, c) in enumerate(zip(vpps[v], names[n], micros[m]))
    }
    all_ids = all_ids.astype(np.int64)
    for table in tables:
        steps.append(table.steps)
        block = np.full((len(table), len(ops)), np.nan)
        mask = np.zeros((len(table), len(ops)), dtype=bool)
        columns = [ops.index(op) for op in table.ops]
        block[:, columns] = table.values
        mask[:, columns] = True
        values.append(block)
        present.append(mask)
    all_steps = np.concatenate(steps)
    # the last occurrence of each (row, step) wins; then sort by step, rows in first-seen order
    order = np.lexsort((-np.arange(len(all_ids)), all_ids, all_steps))
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = (all_steps[order][1:] != all_steps[order][:-1]) | (all_ids[order][1:] != all_ids[order][:-1])
    chosen = order[keep]
    return Series(
        ops,
        list(number),
        any(t.micro_steps is not None for t in tables),
        all_ids[chosen],
        all_steps[chosen],
        np.concatenate(values)[chosen],
        np.concatenate(present)[chosen],
        duplicates=int(len(order) - len(chosen)),
        skipped=skipped,
    )
