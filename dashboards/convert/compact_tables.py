"""The tables of a compacted dataset beside its values: what ran on each rank, the anomaly
records and the incidents (see ``dashboards.convert.compact``), and the Parquet writing they share.

Each table is rewritten whole at every compaction (they are small), through a temporary name;
``runs`` keeps its rows of rank directories deleted since, whose values stay in the dataset.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from monitor.anomaly.incident_files import INCIDENTS_NAME
from monitor.anomaly.ordering import parse_record
from monitor.files import FILE_MODE, make_private_dir
from monitor.query.engine import quoted, quoted_path
from monitor.run_info import RUN_INFO_FILE

logger = logging.getLogger("trainmon")

#: a file being written is named ``{TEMPORARY_PREFIX}*{TEMPORARY_SUFFIX}`` until it is renamed into place
TEMPORARY_PREFIX, TEMPORARY_SUFFIX = ".tmp-", ".parquet.tmp"

#: (column, SQL type) of the tables
RUNS = (
    ("rank", "BIGINT"),
    ("directory", "VARCHAR"),
    ("trainmon_version", "VARCHAR"),
    ("framework", "VARCHAR"),
    ("framework_version", "VARCHAR"),
    ("world_size", "BIGINT"),
    ("pp_stage", "BIGINT"),
    ("group_mates", "VARCHAR"),
    ("root_modules", "VARCHAR"),
    ("config", "VARCHAR"),
)
ANOMALIES = (
    ("rank", "BIGINT"),
    ("step", "BIGINT"),
    ("micro_step", "BIGINT"),
    ("tag_name", "VARCHAR"),
    ("op", "VARCHAR"),
    ("value", "DOUBLE"),
    ("baseline", "DOUBLE"),
    ("rule", "VARCHAR"),
    ("message", "VARCHAR"),
    ("key", "VARCHAR"),
    ("pp_stage", "BIGINT"),
    ("vpp_stage", "BIGINT"),
    ("call_id", "BIGINT"),
    ("group_mates", "VARCHAR"),
)
INCIDENTS = (
    ("rank", "BIGINT"),
    ("id", "BIGINT"),
    ("onset_step", "BIGINT"),
    ("onset_micro_step", "BIGINT"),
    ("state", "VARCHAR"),
    ("closed_step", "BIGINT"),
    ("abnormal_steps", "BIGINT"),
    ("tensors", "BIGINT"),
    ("root_tag", "VARCHAR"),
    ("root_op", "VARCHAR"),
    ("root_value", "DOUBLE"),
    ("root_rule", "VARCHAR"),
    ("evidence", "VARCHAR"),
    ("batch_ids", "VARCHAR"),
    ("step_batch_ids", "VARCHAR"),
    ("records", "BIGINT"),
)


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON file holding an object: {} when it is missing, and, said, when it cannot be read or
    holds something else (a file cut short by a kill: its records are left out)."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("trainmon compact: skipping %s: %s", path, exc)
        return {}
    if not isinstance(document, dict):
        logger.warning("trainmon compact: skipping %s: expected a JSON object", path)
        return {}
    return document


def copy_to_parquet(con: Any, query: str, target: str, level: int = 3) -> None:
    """``query`` into the Parquet file ``target`` (zstd at ``level``), through a temporary name in
    its directory that no ``*.parquet`` pattern matches, so that a compaction killed while it
    writes leaves the dataset readable (DuckDB is told to write that file itself, not another
    temporary one beside it). Files get the monitor's modes (0640, directories 0750), so that
    the group the outputs are shared with (a Spark account, say) reads the dataset too."""
    directory = os.path.dirname(target)
    make_private_dir(directory)
    fd, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX, dir=directory)
    os.close(fd)
    try:
        con.execute(
            f"COPY ({query}) TO {quoted(temporary)} (FORMAT parquet, COMPRESSION zstd, "
            f"COMPRESSION_LEVEL {level}, PARQUET_VERSION V2, USE_TMP_FILE false)"
        )
        os.chmod(temporary, FILE_MODE)
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_tables(con: Any, monitor_path: str, ranks: dict[int, list[str]], output: str) -> None:
    """``runs``, ``anomalies`` and ``incidents`` of the run under ``monitor_path`` into ``output``."""
    anomaly_dirs = _rank_anomaly_dirs(monitor_path)
    runs = _run_rows(ranks)
    _write(con, "runs", RUNS, runs + _runs_gone(con, output, runs), "rank, directory", output)
    _write(con, "anomalies", ANOMALIES, _anomaly_rows(anomaly_dirs), "step, rank", output)
    _write(con, "incidents", INCIDENTS, _incident_rows(anomaly_dirs), "onset_step, rank, id", output)


def _write(con: Any, name: str, columns: tuple, rows: list[tuple], order: str, output: str) -> None:
    con.execute(f"CREATE OR REPLACE TEMP TABLE {name}({', '.join(f'{c} {t}' for c, t in columns)})")
    if rows:
        con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(columns))})", rows)
    copy_to_parquet(con, f"SELECT * FROM {name} ORDER BY {order}", os.path.join(output, f"{name}.parquet"))


def _runs_gone(con: Any, output: str, runs: list[tuple]) -> list[tuple]:
    """The rows of the dataset's ``runs`` table for rank directories deleted since: their values
    stay in the dataset, and so does what describes them."""
    path = os.path.join(output, "runs.parquet")
    if not os.path.exists(path):
        return []
    present = {(row[0], row[1]) for row in runs}
    try:
        kept = con.execute(
            f"SELECT {', '.join(c for c, _ in RUNS)} FROM read_parquet({quoted_path(path)})"
        ).fetchall()
    except Exception as exc:  # duckdb.Error: the table is rewritten from the sources alone
        logger.warning(
            "trainmon compact: %s cannot be read (%s); it is written anew from the sources", path, exc
        )
        return []
    return [row for row in kept if (row[0], row[1]) not in present]


def _rank_anomaly_dirs(monitor_path: str) -> list[str]:
    """The ``anomaly_detected/rank{R}`` directories, in name order."""
    root = os.path.join(monitor_path, "anomaly_detected")
    if not os.path.isdir(root):
        return []
    return [entry.path for entry in sorted(os.scandir(root), key=lambda e: e.name) if entry.is_dir()]


def _run_rows(ranks: dict[int, list[str]]) -> list[tuple]:
    rows = []
    for rank, dirs in ranks.items():
        for directory in dirs:
            info = read_json_object(os.path.join(directory, RUN_INFO_FILE))
            config = info.get("config")
            rows.append(
                (
                    rank,
                    os.path.basename(directory),
                    info.get("trainmon_version"),
                    info.get("framework"),
                    info.get("framework_version"),
                    info.get("world_size"),
                    info.get("pp_stage"),
                    json.dumps(info["group_mates"]) if "group_mates" in info else None,
                    json.dumps(info.get("root_modules", [])),
                    json.dumps(config) if config is not None else None,
                )
            )
    return rows


def _anomaly_rows(anomaly_dirs: list[str]) -> list[tuple]:
    rows = []
    for directory in anomaly_dirs:
        for key, obj in read_json_object(os.path.join(directory, "anomaly.json")).items():
            r = parse_record(obj)
            if r is not None:
                rows.append(
                    (
                        r.rank,
                        r.step,
                        r.micro_step,
                        r.tag_name,
                        r.op,
                        r.value,
                        r.baseline,
                        r.rule,
                        r.message,
                        key,
                        r.pp_stage,
                        r.vpp_stage,
                        r.call_id,
                        json.dumps(list(r.group_mates)),
                    )
                )
    return rows


def _incident_rows(anomaly_dirs: list[str]) -> list[tuple]:
    """One row per incident of each rank's incidents file; an incident lacking its identity (id,
    rank, onset step) is left out."""
    rows = []
    for directory in anomaly_dirs:
        items = read_json_object(os.path.join(directory, INCIDENTS_NAME)).get("incidents")
        for i in items if isinstance(items, list) else []:
            if not (isinstance(i, dict) and all(type(i.get(k)) is int for k in ("id", "rank", "onset_step"))):
                continue
            root = i.get("root") if isinstance(i.get("root"), dict) else {}
            records = i.get("records") if isinstance(i.get("records"), list) else []
            rows.append(
                (
                    i["rank"],
                    i["id"],
                    i["onset_step"],
                    _int_or_none(i.get("onset_micro_step")),
                    str(i.get("state", "")),
                    _int_or_none(i.get("closed_step")),
                    _int_or_none(i.get("abnormal_steps")),
                    _int_or_none(i.get("tensors")),
                    root.get("tag_name"),
                    root.get("op"),
                    _float_or_none(root.get("value")),
                    root.get("rule"),
                    json.dumps(i.get("evidence", [])),
                    json.dumps(i.get("batch_ids", [])),
                    json.dumps(i.get("step_batch_ids", {})),
                    len(records) + (_int_or_none(i.get("more_records")) or 0),
                )
            )
    return rows


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _float_or_none(value: Any) -> float | None:
    """A number, or a non-finite value the incidents file wrote as text ("nan", "inf")."""
    if type(value) in (int, float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None
