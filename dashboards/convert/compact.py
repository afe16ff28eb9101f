"""``trainmon compact``: the monitor's outputs as one columnar dataset (Parquet) for SQL engines.

Per-rank CSV files are what msprobe's tools read, and they stay the monitor's output. For runs
too large to parse CSV again and again, ``compact`` writes the same values once in a standard
long layout that DuckDB, Spark, pandas or any Parquet reader can query, reading only the data
types and ranks it needs::

    OUT/values/data_type={data type}/rank={R}/part.parquet
                            step, micro_step, vpp_stage, name, op, value
    OUT/runs.parquet        per rank directory: rank, directory, versions, world size
    OUT/anomalies.parquet   the records of every anomaly_detected/rank{R}/anomaly.json
    OUT/compact.json        the source files of each part (size, modification time)

Read with partition discovery (``hive_partitioning``), every value is one row
``rank, step, micro_step, vpp_stage, data_type, name, op, value``; ``micro_step`` is NULL for data
types without one. zstd compression. A value written twice for one row and step (a restarted
run appending) keeps the later file's, as csv2tb does.

Idempotent and resumable: a part whose source files are unchanged (size and modification time
in ``compact.json``) is not written again; each file is written under a temporary name and
renamed, so an interrupted run leaves whole files; the sources are never touched. DuckDB does
the reading and writing (out of core, on every core).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from dashboards.convert.runs import ConvertError, select_rank_dirs
from dashboards.csvfiles import header_ops, list_csv_files
from monitor.anomaly.ordering import parse_record
from monitor.files import atomic_write_text, make_private_dir
from monitor.session.run_info import RUN_INFO_FILE

logger = logging.getLogger("trainmon")

MANIFEST = "compact.json"
#: what DuckDB may use for one compaction (it spills to disk beyond it).
MEMORY_LIMIT = os.environ.get("TRAINMON_DUCKDB_MEMORY", "2GB")
_LABELS = {"vpp_stage": "BIGINT", "name": "VARCHAR", "step": "BIGINT", "micro_step": "BIGINT"}


def compact(monitor_path: str, output: str | None = None) -> dict[str, int]:
    """Write or bring up to date the dataset of ``monitor_path`` in ``output`` (default
    ``monitor_path/dataset``); returns counts of parts written and kept.

    Raises:
        ConvertError: ``monitor_path`` holds no rank directory, or ``output`` is inside a rank directory.
    """
    import duckdb

    ranks = select_rank_dirs(monitor_path)
    if not ranks:
        raise ConvertError(f"monitor_path: no {{time}}-rank{{R}}-{{id}} directory under {monitor_path!r}")
    output = os.path.abspath(output or os.path.join(monitor_path, "dataset"))
    make_private_dir(output)
    manifest_path = os.path.join(output, MANIFEST)
    old = _read_json_object(manifest_path)
    new: dict[str, list] = {}
    counts = {"written": 0, "kept": 0}
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")
    try:
        for rank, dirs in ranks.items():
            for prefix, paths in _files_by_type(dirs).items():
                part = os.path.join("values", f"data_type={prefix}", f"rank={rank}", "part.parquet")
                sources = [_signature(p) for p in paths]
                new[part] = sources
                if old.get(part) == sources and os.path.isfile(os.path.join(output, part)):
                    counts["kept"] += 1
                    continue
                _write_part(con, paths, os.path.join(output, part))
                counts["written"] += 1
        _write_runs(con, ranks, os.path.join(output, "runs.parquet"))
        _write_anomalies(con, monitor_path, os.path.join(output, "anomalies.parquet"))
    finally:
        con.close()
    atomic_write_text(manifest_path, json.dumps(new, indent=1))
    return counts


def _files_by_type(dirs: Sequence[str]) -> dict[str, list[str]]:
    """data type -> its CSV files in the rank's directories, oldest directory first."""
    found: dict[str, list[str]] = {}
    for directory in dirs:
        for prefix, items in list_csv_files(directory).items():
            found.setdefault(prefix, []).extend(item.path for item in items)
    return found


def _signature(path: str) -> list:
    stat = os.stat(path)
    return [path, stat.st_size, stat.st_mtime_ns]


def _read_json_object(path: str) -> dict[str, Any]:
    """A JSON file holding an object ({} when it is missing, unreadable or something else)."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        return document if isinstance(document, dict) else {}
    except (OSError, ValueError):
        return {}


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _write_part(con: Any, paths: Sequence[str], target: str) -> None:
    """One data type of one rank: every file's rows, unpivoted to one row per value."""
    selects, ops = [], []
    for index, path in enumerate(paths):
        file_ops = list(header_ops(path))
        ops += [op for op in file_ops if op not in ops]
        with open(path, encoding="utf-8", errors="replace") as handle:
            header = handle.readline().strip().split(",")
        types = {**{c: t for c, t in _LABELS.items() if c in header}, **dict.fromkeys(file_ops, "DOUBLE")}
        columns = ", ".join(f"{_quoted(c)}: {_quoted(t)}" for c, t in types.items())
        selects.append(
            f"SELECT *, {index} AS _file FROM read_csv({_quoted(path)}, header = true, "
            f"columns = {{{columns}}}, auto_detect = false, null_padding = true, ignore_errors = true)"
        )
    if not ops:
        return
    union = " UNION ALL BY NAME ".join(selects)
    has_micro = any("'micro_step'" in select for select in selects)
    micro = "micro_step" if has_micro else "CAST(NULL AS BIGINT) AS micro_step"
    op_columns = ", ".join(f'"{op}"' for op in ops)
    query = f"""
        SELECT step, micro_step, vpp_stage, name, op, value FROM (
            UNPIVOT (SELECT step, {micro}, vpp_stage, name, _file, {op_columns} FROM ({union}))
            ON {op_columns} INTO NAME op VALUE value
        )
        QUALIFY row_number() OVER (PARTITION BY vpp_stage, name, micro_step, step, op ORDER BY _file DESC) = 1
        ORDER BY step, vpp_stage, name, micro_step, op
    """
    _copy(con, query, target)


def _copy(con: Any, query: str, target: str) -> None:
    """``query`` into the Parquet file ``target``, through a temporary name in its directory."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet", dir=directory)
    os.close(fd)
    try:
        con.execute(f"COPY ({query}) TO {_quoted(temporary)} (FORMAT parquet, COMPRESSION zstd)")
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _write_runs(con: Any, ranks: dict[int, list[str]], target: str) -> None:
    rows = []
    for rank, dirs in ranks.items():
        for directory in dirs:
            info = _read_json_object(os.path.join(directory, RUN_INFO_FILE))
            rows.append(
                (
                    rank,
                    os.path.basename(directory),
                    info.get("trainmon_version"),
                    info.get("framework"),
                    info.get("framework_version"),
                    info.get("world_size"),
                    json.dumps(info.get("root_modules", [])),
                )
            )
    con.execute(
        "CREATE OR REPLACE TEMP TABLE runs(rank BIGINT, directory VARCHAR, trainmon_version VARCHAR, "
        "framework VARCHAR, framework_version VARCHAR, world_size BIGINT, root_modules VARCHAR)"
    )
    con.executemany("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    _copy(con, "SELECT * FROM runs ORDER BY rank, directory", target)


def _write_anomalies(con: Any, monitor_path: str, target: str) -> None:
    rows = []
    anomaly_root = os.path.join(monitor_path, "anomaly_detected")
    for entry in (
        sorted(os.scandir(anomaly_root), key=lambda e: e.name) if os.path.isdir(anomaly_root) else []
    ):
        document = _read_json_object(os.path.join(entry.path, "anomaly.json"))
        for key, obj in document.items():
            record = parse_record(obj)
            if record is not None:
                rows.append(
                    (
                        record.rank,
                        record.step,
                        record.micro_step,
                        record.tag_name,
                        record.op,
                        record.value,
                        record.baseline,
                        record.rule,
                        record.message,
                        key,
                    )
                )
    con.execute(
        "CREATE OR REPLACE TEMP TABLE anomalies(rank BIGINT, step BIGINT, micro_step BIGINT, "
        "tag_name VARCHAR, op VARCHAR, value DOUBLE, baseline DOUBLE, rule VARCHAR, message VARCHAR, "
        "key VARCHAR)"
    )
    if rows:
        con.executemany("INSERT INTO anomalies VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    _copy(con, "SELECT * FROM anomalies ORDER BY step, rank", target)
