"""``trainmon compact``: the monitor's outputs as one columnar dataset (Parquet) for SQL engines.

Per-rank CSV files (or TensorBoard event files) are what msprobe's tools read, and they stay the
monitor's output. For runs too large to parse them again and again, ``compact`` writes the same
values once in a standard long layout that DuckDB, Spark, pandas or any Parquet reader can query,
reading only the data types, ranks and step ranges it needs::

    OUT/values/data_type={data type}/rank={R}/steps-{first}-{last}.parquet
                            step, micro_step, vpp_stage, name, op, value
    OUT/runs.parquet        per rank directory: rank, versions, world size, pipeline stage and
                            mates, model chunks, the config (JSON)
    OUT/anomalies.parquet   the records of every anomaly_detected/rank{R}/anomaly.json
    OUT/incidents.parquet   the incidents of every anomaly_detected/rank{R}/incidents.json
    OUT/compact.json        the value type; per file of each part its source files (size, mtime)

A data type with CSV files is read from them; one written live as Parquet (``format: parquet``)
from those files; one only in event files (``format: tensorboard``) from every event file of the
rank, as TensorBoard has the values (32-bit floats).

A part (one data type of one rank) is a file per STEPS_PER_FILE steps, named by the range it
holds (``steps-0-999``, ``steps-1000-1999``, ...): a query of a step range opens only the files
whose names overlap it, and engines that prune by Parquet statistics (DuckDB, Spark) skip the
other files' data on their own. A run that goes on replaces its last file under the same name.

Read with partition discovery (``hive_partitioning``), every value is one row
``rank, step, micro_step, vpp_stage, data_type, name, op, value``; ``micro_step`` is NULL for data
types without one. A value written twice for one row and step (a restarted run appending) keeps
the later file's, as csv2tb does.

Size: rows sorted by tensor, op and step, so that a column changes little from row to row;
Parquet's version 2 encodings (byte-stream split for values, deltas for integers) and zstd at a
high level. ``value`` is a 32-bit float when every value of the run is one exactly (counts below
2**24) or has at most six significant digits (the CSV writer's default ``ndigits``), which 32-bit
floats hold: rounding a stored value to six digits gives back the CSV's text. Otherwise (a
larger ``ndigits``, huge counts, values beyond a 32-bit float's range) it is a 64-bit double, for
the whole dataset, so that every engine sees one schema; ``compact.json`` records which. The
dataset outlives its sources: values compacted from files deleted since (a rank directory, the
CSV files of early steps) are kept.

Idempotent, incremental and resumable: a file whose source files are unchanged (size and
modification time in ``compact.json``) is not written again. The step windows in the sources'
names (CSV files, live Parquet files) say which files of a part each reaches, so a run that went
on since the last compaction rewrites only the files its new steps reach; a part made from
TensorBoard event files, whose names carry no steps, is written whole when one changed. Each
file is written under a temporary name that no ``*.parquet`` pattern matches and renamed, so an
interrupted run leaves whole files that read as a dataset, and ``compact.json`` is saved as
parts are written, so that the next run goes on from there; the sources are never touched.
DuckDB does the reading and writing (out of core, on every core).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from dashboards.convert.compact_manifest import DOUBLE, FLOAT, open_dataset
from dashboards.convert.compact_sources import say_rejected, table_values, unreadable_parquet
from dashboards.convert.compact_tables import (
    TEMPORARY_PREFIX,
    TEMPORARY_SUFFIX,
    copy_to_parquet,
    write_tables,
)
from dashboards.convert.event_values import EventDirs
from dashboards.convert.runs import ConvertError, select_rank_dirs
from dashboards.csvfiles import list_csv_files
from dashboards.plugin.eventsource import EventSource
from monitor.memory_limit import COMPACT_DEFAULT, parse_size
from monitor.query import engine
from monitor.query.engine import quoted_path
from monitor.writers.parquet_files import live_prefixes, not_a_run_hint, part_steps

logger = logging.getLogger("trainmon")

#: zstd level of the values: 19 makes them about a tenth smaller than zstd's default level 3 for
#: about 1.7x the compaction time (benchmarks/dataset.py)
ZSTD_LEVEL = 19
#: per data type, row (chunk, tensor, micro-step), op and step, the rank farthest from the
#: ranks' median: one SQL text that DuckDB and Spark SQL both run, over a view ``v`` of
#: ``values/`` read with its partitions; micro_step is NULL for data types without one
FARTHEST_RANK_SQL = """
    WITH m AS (SELECT data_type, vpp_stage, name, micro_step, op, step, median(value) AS mid
        FROM v GROUP BY ALL)
    SELECT v.data_type, v.vpp_stage, v.name, v.micro_step, v.op, v.step,
        max_by(v.rank, abs(v.value - m.mid)) AS farthest
    FROM v JOIN m ON v.data_type = m.data_type AND v.vpp_stage = m.vpp_stage AND v.name = m.name
        AND v.micro_step IS NOT DISTINCT FROM m.micro_step AND v.op = m.op AND v.step = m.step
    GROUP BY ALL
"""
#: steps of a part in one file: a step range is read without the rest of the run
STEPS_PER_FILE = 1000
#: the unit of a part read whole, when its sources' steps are not known from their names
WHOLE = "whole"
#: a part's files, by the first and last step each holds (the live writer's merged files alike)
_PART_FILE = re.compile(r"steps-\d+-\d+\.parquet")
#: times a compaction starts again when a file it listed went away (a live Parquet merge)
RETRIES = 3


def compact(
    monitor_path: str, output: str | None = None, memory_limit: int = parse_size(COMPACT_DEFAULT)
) -> dict[str, int]:
    """Write or bring up to date the dataset of ``monitor_path`` in ``output`` (default
    ``monitor_path/dataset``); returns counts of parts written and kept. A run written with
    ``format: parquet`` merges its files while it trains: when a file listed here is gone before
    it is read, the compaction starts again (at most RETRIES times; the parts it wrote are kept).

    Raises:
        ConvertError: ``monitor_path`` holds no rank directory, or ``output`` is inside a rank directory.
    """
    import duckdb

    attempts = 0
    while True:
        try:
            return _compact_once(monitor_path, output, memory_limit)
        except (FileNotFoundError, duckdb.IOException) as exc:
            attempts += 1
            if attempts > RETRIES:
                raise
            logger.info("trainmon compact: a file changed while it was read (%s); starting again", exc)


def _compact_once(monitor_path: str, output: str | None, memory_limit: int) -> dict[str, int]:

    ranks = select_rank_dirs(monitor_path)
    if not ranks:
        raise ConvertError(
            f"monitor_path: no {{time}}-rank{{R}}-{{id}} directory under {monitor_path!r}"
            f"{not_a_run_hint(monitor_path)}"
        )
    output = os.path.abspath(output or os.path.join(monitor_path, "dataset"))
    manifest = open_dataset(output, monitor_path, [d for dirs in ranks.values() for d in dirs])
    con = engine.connect(memory_limit)
    events = EventDirs()
    try:
        #: (part, unit) -> its block of steps (None: every block) and the files it is made from
        sources: dict[tuple[str, str], tuple[int | None, list[str]]] = {}
        prefixes: dict[str, str] = {}  # part -> its data type
        for rank, dirs in ranks.items():
            for prefix, files in _files_by_type(dirs, events).items():
                part = os.path.join("values", f"data_type={prefix}", f"rank={rank}")
                prefixes[part] = prefix
                for unit, (block, paths) in _units(files).items():
                    signatures = [_signature(path, monitor_path) for path in paths]
                    manifest.expect(part, unit, signatures)
                    sources[part, unit] = block, paths
        manifest.keep_orphans()
        value_type = manifest.dataset_type()
        written, twice = set(), {}
        for rewrite in (False, True):  # the second pass: units in another type than the dataset's
            for part, unit in manifest.to_write(value_type, rewrite):
                block, paths = sources.get((part, unit), (None, []))  # none: kept, sources gone
                rows_of = functools.partial(
                    _part_rows,
                    con,
                    prefixes.get(part, ""),
                    events=events,
                    earlier=manifest.carried(part, unit),
                )
                value_type, files, repeated = _write_unit(
                    con, rows_of, paths, os.path.join(output, part), value_type, block
                )
                manifest.written(part, unit, value_type, files)
                written.add(part)
                twice[part, unit] = repeated  # a unit written again as doubles: counted once
        _say_written_twice(twice)
        _remove_other_parts(output, manifest.current)
        counts = {"written": len(written), "kept": len(manifest.current) - len(written)}
        write_tables(con, monitor_path, ranks, output)
    finally:
        con.close()
    manifest.save(value_type, force=True)
    return counts


def _write_unit(
    con: Any,
    rows_of: Callable[[Sequence[str]], str | None],
    paths: Sequence[str],
    directory: str,
    value_type: str,
    block: int | None,
) -> tuple[str, list[str], int]:
    """One unit of a part from its source ``paths`` (``rows_of``: their rows' query), as
    ``_write_part`` writes it. A live Parquet file whose data cannot be decoded (its footer read
    fine) is said and left out, and the unit is read again without it; a file gone meanwhile
    raises for the caller's retry."""
    import duckdb

    try:
        return _write_part(con, rows_of(paths), directory, value_type, block)
    except duckdb.IOException:
        raise
    except duckdb.Error as exc:
        damaged = unreadable_parquet(con, paths)
        if not damaged:
            raise
        for path in damaged:
            logger.warning("trainmon compact: skipping %s: its data cannot be read (%s)", path, exc)
        kept = [path for path in paths if path not in damaged]
        return _write_part(con, rows_of(kept), directory, value_type, block)


def _say_written_twice(counts: dict[tuple[str, str], int]) -> None:
    """Said once per compaction, as csv2db says it: values that several source files hold for the
    same row and step (a second run into the same output root, windows that overlap), counted
    per (part, unit)."""
    if any(counts.values()):
        parts = sorted({part for (part, _), count in counts.items() if count})
        logger.warning(
            "trainmon compact: %d value(s) written more than once, in %s%s (several runs in one "
            "output root, or files whose steps overlap); kept the later file's: compact each run "
            "from a root of its own to keep them apart",
            sum(counts.values()),
            ", ".join(parts[:3]),
            " ..." if len(parts) > 3 else "",
        )


def _units(
    files: Sequence[tuple[str, tuple[int, int] | None]],
) -> dict[str, tuple[int | None, list[str]]]:
    """A part's files to write, by name, each with its block of steps and the source files it is
    made from: per file of STEPS_PER_FILE steps, the sources whose steps (from their names) reach
    into it, so that a run that goes on rewrites only its last files; the whole part from every
    source (WHOLE, block None) when a source's steps are not known from its name (TensorBoard
    event files)."""
    if any(steps is None for _, steps in files):
        return {WHOLE: (None, [path for path, _ in files])}
    found: dict[int, list[str]] = {}
    for path, (first, last) in files:
        for block in range(first // STEPS_PER_FILE, last // STEPS_PER_FILE + 1):
            found.setdefault(block, []).append(path)
    return {_block_file(block): (block, paths) for block, paths in sorted(found.items())}


def _block_file(block: int) -> str:
    return f"steps-{block * STEPS_PER_FILE}-{(block + 1) * STEPS_PER_FILE - 1}.parquet"


def _files_by_type(
    dirs: Sequence[str], events: EventDirs
) -> dict[str, list[tuple[str, tuple[int, int] | None]]]:
    """data type -> the files its part is made from, each with its first and last step (None:
    not known from its name): its CSV files or live Parquet files in the rank's directories
    (oldest directory first), or, for a data type only in TensorBoard event files, every event
    file of the rank (one file holds every data type)."""
    found: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    event_files: list[str] = []
    for directory in dirs:
        for prefix, items in list_csv_files(directory).items():
            found.setdefault(prefix, []).extend((item.path, (item.start, item.end)) for item in items)
        for prefix, paths in live_prefixes(directory).items():
            found.setdefault(prefix, []).extend((path, part_steps(path)) for path in paths)
        event_files += EventSource.event_files(directory)
    for prefix in events.prefixes(event_files):
        found.setdefault(prefix, [(path, None) for path in event_files])
    return found


def _signature(path: str, monitor_path: str) -> list:
    """A source file as ``compact.json`` keeps it: its path within the run (so that the run may
    be named by another path), size and modification time."""
    stat = os.stat(path)
    return [os.path.relpath(path, monitor_path), stat.st_size, stat.st_mtime_ns]


def _remove_other_parts(output: str, units: dict[str, dict[str, dict[str, list]]]) -> None:
    """Delete the files of data types, ranks and step ranges the run no longer has (a rank
    directory removed, say), and a temporary file an interrupted run left, so that every file
    under ``values/`` is current and of one value type."""
    root = os.path.join(output, "values")
    current = {
        os.path.join(part, name)
        for part, of_part in units.items()
        for unit in of_part.values()
        for name in unit["files"]
    }
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            ours = (
                _PART_FILE.fullmatch(name)
                or name == "part.parquet"  # a whole part in one file, as earlier trainmon wrote it
                or _left_by_an_interrupted_write(name)
            )
            if ours and os.path.relpath(path, output) not in current:
                os.unlink(path)
        if directory != root and not os.listdir(directory):
            os.rmdir(directory)


def _left_by_an_interrupted_write(name: str) -> bool:
    """A temporary file of ``copy_to_parquet`` (or of earlier trainmon, which named it
    ``.tmp-*.parquet`` and let DuckDB write ``tmp_.tmp-*.parquet`` beside it)."""
    for prefix in (TEMPORARY_PREFIX, "tmp_" + TEMPORARY_PREFIX):
        if name.startswith(prefix) and name.endswith((TEMPORARY_SUFFIX, ".parquet")):
            return True
    return False


def _part_rows(
    con: Any, prefix: str, paths: Sequence[str], events: EventDirs, earlier: Sequence[str] = ()
) -> str | None:
    """The query of one part's rows (step, micro_step, vpp_stage, name, op, value), from its CSV
    and live Parquet files or its event files, a value written twice keeping the later file's (None where the
    files hold no statistic); ``earlier``: the part's own files, read as if before every source."""
    if paths and "tfevents" in os.path.basename(paths[0]):
        frame = events.frame(prefix, paths)
        con.register("events", frame)
        source = None if frame.empty else "SELECT * FROM events"
    else:
        source = table_values(con, paths)
    if earlier:
        kept = (
            "SELECT step, micro_step, vpp_stage, name, -1 AS _file, op, CAST(value AS DOUBLE) AS value "
            f"FROM read_parquet([{', '.join(quoted_path(p) for p in earlier)}])"
        )
        source = (
            kept
            if source is None
            else f"SELECT step, micro_step, vpp_stage, name, _file, op, value FROM ({source}) "
            f"UNION ALL {kept}"
        )
    if source is None:
        return None
    key = "PARTITION BY vpp_stage, name, micro_step, step, op"
    return f"""
        SELECT step, micro_step, vpp_stage, name, op, value,
            count(*) FILTER (WHERE _file >= 0) OVER ({key}) AS _copies
        FROM ({source})
        QUALIFY row_number() OVER ({key} ORDER BY _file DESC) = 1
    """


def _write_part(
    con: Any, query: str | None, directory: str, value_type: str, block: int | None = None
) -> tuple[str, list[str], int]:
    """A part's files in ``directory``, a file per STEPS_PER_FILE steps (only the ``block``-th
    when given), its values in ``value_type``, or as doubles where one would not survive a
    32-bit float (rounded back to six significant digits it is not the value read from the CSV);
    returns the type written, the files' names and how many values the sources held more than
    once. The rows of ``query`` are read once, into a temporary table; a row without a step (an
    empty field in the CSV) has no place in a step range and is left out."""
    if query is None:  # the files hold no statistic: no file
        return value_type, [], 0
    number = f"step // {STEPS_PER_FILE}"
    only = "" if block is None else f" AND {number} = {block}"
    con.execute(f"CREATE OR REPLACE TEMP TABLE part AS SELECT * FROM ({query}) WHERE step IS NOT NULL{only}")
    say_rejected(con)
    (twice,) = con.execute("SELECT count(*) FROM part WHERE _copies > 1").fetchone()
    if value_type == FLOAT:  # a 32-bit float holds it exactly (counts), or to the CSV's six digits
        (fits,) = con.execute(
            """SELECT coalesce(bool_and(NOT isfinite(value)
                   OR coalesce(CAST(TRY_CAST(value AS FLOAT) AS DOUBLE) = value, false)
                   OR coalesce(TRY_CAST(printf('%.6g', TRY_CAST(value AS FLOAT)) AS DOUBLE) = value, false)),
                   true)
               FROM part"""
        ).fetchone()
        value_type = FLOAT if fits else DOUBLE
    names = []
    for (found,) in con.execute(f"SELECT DISTINCT {number} AS b FROM part ORDER BY b").fetchall():
        names.append(_block_file(found))
        copy_to_parquet(
            con,
            f"SELECT step, micro_step, vpp_stage, name, op, CAST(value AS {value_type}) AS value FROM part "
            f"WHERE {number} = {found} ORDER BY vpp_stage, name, op, micro_step, step",
            os.path.join(directory, names[-1]),
            ZSTD_LEVEL,
        )
    con.execute("DROP TABLE part")
    return value_type, names, twice
