"""The live Parquet files (``format: parquet``, layout in monitor.writers.parquet_files) read
through DuckDB for the cross-rank analysis and the dashboard.

``read_wide`` turns the long rows back into one row per tensor and step with a column per op, the
shape the CSV files have. A label column that the files' footers show constant (one op, one
stage, no micro-steps) is not read at all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitor.query import engine
from monitor.writers.parquet_files import COLUMNS, layout_problem, part_steps


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


def file_ops(path: str) -> tuple[str, ...]:
    """The ops a file holds, in the order first seen.

    Raises:
        ValueError: the file cannot be read as Parquet.
        OSError: the file cannot be found.
    """
    import duckdb

    con = engine.cursor()
    try:
        found = con.sql(
            f"SELECT op FROM read_parquet({engine.quoted_path(path)}, file_row_number = true) "
            "GROUP BY op ORDER BY min(file_row_number)"
        ).fetchall()
    except duckdb.IOException as exc:
        raise OSError(str(exc).splitlines()[0]) from exc
    except duckdb.Error as exc:
        raise ValueError(str(exc).splitlines()[0]) from exc
    finally:
        con.close()
    return tuple(op for (op,) in found)


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
    writer stores it and the query layer reads names): the values the rows use, in the order they
    first appear."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        encoded = column.unify_dictionaries().combine_chunks()
    else:
        encoded = column.combine_chunks().dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    size = len(encoded.dictionary)
    # the query layer's dictionary holds every name it read, in no set order: the rows' names
    # only, in the order the rows first name them (the model's), whatever the process read before
    order = np.flatnonzero(np.bincount(codes, minlength=size))
    first = np.full(size, len(codes))
    start, width = 0, 1 << 14
    while start < len(codes) and (first[order] == len(codes)).any():  # a step's rows name them all
        np.minimum.at(first, codes[start : start + width], np.arange(start, min(start + width, len(codes))))
        start, width = start + width, width * 2
    order = order[np.argsort(first[order], kind="stable")]
    place = np.zeros(size, dtype=np.int64)
    place[order] = np.arange(len(order))
    return place[codes], encoded.dictionary.take(order).to_pylist()


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
    import duckdb
    import pyarrow as pa

    try:
        constant = _constant_columns(paths)
    except pa.ArrowException as exc:  # cut short, or other columns
        raise ValueError(str(exc)) from exc
    table = None
    if paths:
        columns = [column for column in COLUMNS if column not in constant]
        source = f"read_parquet([{', '.join(engine.quoted_path(p) for p in paths)}])"
        where = ""
        if window is not None and not all(_within(path, window) for path in paths):  # a filter costs
            where = f"step BETWEEN {int(window[0])} AND {int(window[1])}"
        con = engine.cursor()
        try:
            table = engine.fetch_coded(con, columns, source, where)
        except duckdb.Error as exc:
            gone = [path for path in paths if not os.path.exists(path)]
            if gone:  # merged away since it was listed
                raise FileNotFoundError(gone[0]) from exc
            raise ValueError(str(exc).splitlines()[0]) from exc
        finally:
            con.close()
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
