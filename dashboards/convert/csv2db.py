"""``trainmon csv2db``: the monitor's CSV outputs (or live Parquet files) in one SQLite file.

Schema (``SCHEMA_VERSION`` 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)
        schema_version, created (ISO 8601 with offset), source (monitor_path), trainmon version
    rank_dirs(rank INTEGER, dir TEXT, PRIMARY KEY (rank, dir))
        the per-rank directories that were read, by name
    data_types(data_type_id INTEGER PRIMARY KEY, name TEXT UNIQUE)   -- grad_reduced, exp_avg, ...
    ops(op_id INTEGER PRIMARY KEY, name TEXT UNIQUE)                 -- norm, ...; bit op_id of nan_mask
    targets(target_id INTEGER PRIMARY KEY, vpp_stage INTEGER, name TEXT, micro_step INTEGER,
            UNIQUE (vpp_stage, name, micro_step))                    -- micro_step -1: none
    stats(data_type_id, rank, target_id, step INTEGER, <one REAL column per op>,
          nan_mask INTEGER, PRIMARY KEY (data_type_id, target_id, rank, step)) WITHOUT ROWID
    target_order(data_type_id, rank, position, target_id, PRIMARY KEY (data_type_id, rank, position))
        the rows' order in the files (model order for most data types)

SQLite stores NaN as NULL, so a NULL op column means NaN when bit ``op_id`` of ``nan_mask`` is set,
and "not recorded" otherwise; +-Inf are stored as is. The primary key serves "one target over steps"
and "all targets of a step" (``WHERE data_type_id=? AND rank=? AND step=?`` scans one data type).
Directory selection, duplicate handling and worker processes are those of csv2tb (dashboards.convert.runs).
The database is written to a temporary file next to the output and renamed when complete.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sqlite3
import tempfile

import numpy as np

from dashboards.convert.progress import run_jobs
from dashboards.convert.runs import ConvertError, Series, job_label, read_series, select_jobs
from dashboards.csvfiles import header_ops
from monitor import __version__
from monitor.anomaly import rank_csv
from monitor.datatypes.tasks import OP_ORDER, order_key
from monitor.files import FILE_MODE, TIME_FORMAT
from monitor.query.parquet_values import file_ops

logger = logging.getLogger("trainmon")

SCHEMA_VERSION = 1
OUTPUT_NAME = "monitor_metrics.db"
OUTPUT_SUFFIX = "-csv2db"
_IDENTIFIER = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"

_SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE rank_dirs(rank INTEGER NOT NULL, dir TEXT NOT NULL, PRIMARY KEY (rank, dir));
CREATE TABLE data_types(data_type_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE ops(op_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE targets(target_id INTEGER PRIMARY KEY, vpp_stage INTEGER NOT NULL, name TEXT NOT NULL,
    micro_step INTEGER NOT NULL, UNIQUE (vpp_stage, name, micro_step));
CREATE TABLE target_order(data_type_id INTEGER NOT NULL, rank INTEGER NOT NULL, position INTEGER NOT NULL,
    target_id INTEGER NOT NULL, PRIMARY KEY (data_type_id, rank, position)) WITHOUT ROWID;
"""


def _ops(jobs) -> list[str]:
    """Every op in the jobs' files (CSV headers, else the Parquet files' op column), in OP_ORDER
    (the stats table's columns)."""
    found: dict[str, None] = {}
    for _, dirs, prefix in jobs:
        for path in dirs:
            for part in rank_csv.list_parts(path, (prefix,)).get(prefix, []):
                if not part.parquet:
                    found.update(dict.fromkeys(header_ops(part.path)))
                    continue
                try:
                    found.update(dict.fromkeys(file_ops(part.path)))
                except (ValueError, OSError, ImportError):  # reading the values skips it and says why
                    continue
    return sorted(found, key=lambda op: order_key(op, OP_ORDER))


def _read(job: tuple[int, list[str], str]) -> Series | None:
    _, dirs, prefix = job
    return read_series(dirs, prefix)


def _column(op: str) -> str:
    if not op or any(c not in _IDENTIFIER for c in op) or op[0].isdigit():
        raise ConvertError(f"op column {op!r}: only letters, digits and '_' can be stored")
    return f'"{op}"'


class _Database:
    """The open temporary database and its dimension tables."""

    def __init__(self, path: str, ops: list[str]) -> None:
        self.db = sqlite3.connect(path)
        self.db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + _SCHEMA)
        self.ops = ops
        columns = ", ".join(f"{_column(op)} REAL" for op in ops)
        self.db.execute(
            "CREATE TABLE stats(data_type_id INTEGER NOT NULL, rank INTEGER NOT NULL, "
            f"target_id INTEGER NOT NULL, step INTEGER NOT NULL, {columns}, "
            "nan_mask INTEGER NOT NULL DEFAULT 0, "
            "PRIMARY KEY (data_type_id, target_id, rank, step)) WITHOUT ROWID"
        )
        self.db.executemany("INSERT INTO ops(op_id, name) VALUES (?, ?)", list(enumerate(ops)))
        names = ", ".join(_column(op) for op in ops)
        self._insert = (
            f"INSERT INTO stats(data_type_id, rank, target_id, step, {names}, nan_mask) "
            f"VALUES ({', '.join('?' * (len(ops) + 5))})"
        )
        self.types: dict[str, int] = {}
        self.targets: dict[tuple, int] = {}

    def type_id(self, name: str) -> int:
        if name not in self.types:
            self.types[name] = len(self.types)
            self.db.execute("INSERT INTO data_types VALUES (?, ?)", (self.types[name], name))
        return self.types[name]

    def add(self, rank: int, prefix: str, series: Series) -> None:
        type_id = self.type_id(prefix)
        target_ids = []
        for key in series.rows:
            if key not in self.targets:
                self.targets[key] = len(self.targets)
                self.db.execute("INSERT INTO targets VALUES (?, ?, ?, ?)", (self.targets[key], *key))
            target_ids.append(self.targets[key])
        self.db.executemany(
            "INSERT INTO target_order VALUES (?, ?, ?, ?)",
            [(type_id, rank, position, target) for position, target in enumerate(target_ids)],
        )
        columns = [self.ops.index(op) for op in series.ops]
        values = np.full((len(series.steps), len(self.ops)), np.nan)
        values[:, columns] = np.where(series.present, series.values, np.nan)
        nan = np.zeros(values.shape, dtype=bool)
        nan[:, columns] = series.present & np.isnan(series.values)
        mask = (nan * (1 << np.arange(len(self.ops), dtype=np.int64))).sum(axis=1)
        cells = values.astype(object)
        cells[np.isnan(values)] = None
        targets = np.asarray(target_ids, dtype=np.int64)[series.ids]
        rows = zip(
            [type_id] * len(series.steps),
            [rank] * len(series.steps),
            targets.tolist(),
            series.steps.tolist(),
            *cells.T.tolist(),
            mask.tolist(),
            strict=True,
        )
        self.db.executemany(self._insert, rows)


def csv2db(
    monitor_path: str,
    time_start: str | None = None,
    time_end: str | None = None,
    process_num: int = 1,
    data_type_list: list[str] | None = None,
    output_path: str | None = None,
    *,
    progress: bool = True,
) -> str:
    """Write the CSV (or live Parquet) outputs under ``monitor_path`` into one SQLite file; returns its path.

    ``output_path`` defaults to ``{monitor_path}/{time}-csv2db/monitor_metrics.db``; an existing file
    there is replaced (with a warning) once the new one is complete. Other arguments as csv2tb's.

    Raises:
        ConvertError: a bad argument, or no rank directory in the time range.
    """
    selection = select_jobs(monitor_path, time_start, time_end, process_num, data_type_list)
    if output_path is None:
        stamp = _dt.datetime.now().astimezone().strftime(TIME_FORMAT)
        output_path = os.path.join(monitor_path, stamp + OUTPUT_SUFFIX, OUTPUT_NAME)
    directory = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(directory, mode=0o750, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".csv2db-", suffix=".db", dir=directory)
    os.close(fd)
    database = None
    try:
        database = _Database(temporary, _ops(selection.jobs))
        for (rank, _, prefix), series in run_jobs(
            _read, selection.jobs, selection.processes, "csv2db", job_label, progress
        ):
            if series is None:
                continue
            database.add(rank, prefix, series)
            if series.skipped:
                logger.warning(
                    "trainmon csv2db: rank%d/%s: skipped %d rows that did not parse",
                    rank,
                    prefix,
                    series.skipped,
                )
            if series.duplicates:
                logger.warning(
                    "trainmon csv2db: rank%d/%s: %d rows written twice for a step; kept the later ones "
                    "(a restarted run, or several runs in one directory: --start/--end choose one)",
                    rank,
                    prefix,
                    series.duplicates,
                )
        database.db.executemany(
            "INSERT INTO rank_dirs VALUES (?, ?)",
            [(rank, os.path.basename(d)) for rank, dirs in selection.ranks.items() for d in dirs],
        )
        meta = {
            "schema_version": str(SCHEMA_VERSION),
            "created": _dt.datetime.now().astimezone().isoformat(),
            "source": os.path.abspath(monitor_path),
            "trainmon": __version__,
        }
        database.db.executemany("INSERT INTO meta VALUES (?, ?)", sorted(meta.items()))
        database.db.commit()
        database.db.close()
        database = None
        os.chmod(temporary, FILE_MODE)
        if os.path.exists(output_path):
            logger.warning("trainmon csv2db: replacing %s", output_path)
        os.replace(temporary, output_path)
    finally:
        if database is not None:
            database.db.close()
        if os.path.exists(temporary):
            os.unlink(temporary)
    return output_path
