"""Live Parquet output (``format: parquet``): the long rows of the dataset, written as training runs.

In the rank's directory, per data type (the layout, and its reading, in monitor.writers.parquet_files)::

    values/data_type={prefix}/step-{step}.parquet          one collected step
    values/data_type={prefix}/steps-{first}-{last}.parquet  the steps of a finished window, merged

Every file has the columns ``rank, step, micro_step, vpp_stage, name, op, value`` (``micro_step``
NULL for data types without one, ``value`` a 64-bit float, exact), so a whole run is one table
for DuckDB, Spark or pandas with the data type from the directory name (hive partitioning)::

    SELECT * FROM read_parquet('OUT/*/values/*/*.parquet', hive_partitioning = true)

Crash safety: a step's file is written under a temporary name (which no ``*.parquet`` pattern
matches) and renamed into place when the step ends, before the training thread goes on, so every
ended step is a whole, closed file after a SIGKILL. Small files would pile up over a long run, so
once a window of ``merge_steps`` steps has passed, its files are merged into one by the writer
thread while nothing is queued (``idle``), a step file's reading or a row group's writing (of at
most MERGE_ROWS rows) at a time: a record waits for one such piece at most, and memory holds two
row groups. The merged file is synced to disk
and renamed into place before the step files are deleted; a kill between the two leaves step
files that the merged file covers: readers leave them out, and the next writer on the directory
deletes them (if the merged file is whole). Records of a step whose window is merged or queued
for merging go to a late file that no merge covers. A resumed run (``append_output``) does not
write a step again that the directory already has, as with CSV. A merge that fails (an unreadable
step file) leaves its files as they are.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import numpy as np

from monitor.files import FILE_MODE, fsync_directory, make_private_dir
from monitor.record import RowSet, StepRecord
from monitor.writers.base import RepeatedSteps
from monitor.writers.parquet_files import (
    VALUES_DIR,
    covered,
    existing_prefixes,
    file_options,
    late_file_name,
    merged_file_name,
    row_count,
    scan,
    schema,
    step_file_name,
)

logger = logging.getLogger("trainmon")

#: steps whose files are merged into one once the window has passed
MERGE_STEPS = 100
#: rows of step files merged into one row group, at most (plus one step's); a merge holds two
MERGE_ROWS = 500_000
#: zstd levels: a step's file is written before training goes on; a merge runs beside training
STEP_ZSTD_LEVEL, MERGED_ZSTD_LEVEL = 3, 9


class ParquetWriter:
    """Writes StepRecords as the dataset's long rows, one closed Parquet file per data type and
    ended step, merged per window of ``merge_steps`` steps."""

    #: steps per merged file (a class attribute, so that a test can make windows short)
    merge_steps = MERGE_STEPS

    def __init__(self, out_dir: str | os.PathLike, rank: int, merge_steps: int | None = None) -> None:
        import pyarrow as pa

        self._pa = pa
        self.out_dir = os.fspath(out_dir)
        self.rank = rank
        if merge_steps is not None:
            self.merge_steps = merge_steps
        self._schema = schema()
        #: per RowSet and ops, the label columns (micro_step, vpp_stage, name, op) of a record
        self._labels: weakref.WeakKeyDictionary[RowSet, dict[tuple[str, ...], list]] = (
            weakref.WeakKeyDictionary()
        )
        #: per data type, the tables of records not yet in a file, by step
        self._pending: dict[str, dict[int, list]] = {}
        #: per data type, its step files not yet merged (step, path)
        self._unmerged: dict[str, list[tuple[int, str]]] = {}
        #: per data type, the last step of its windows merged or queued for merging: a record of
        #: such a step that comes now is late, and gets a file that no merge covers
        self._merged_until: dict[str, int] = {}
        #: per data type, the last step the directory already had when this writer first saw it
        self._resumed_last: dict[str, int] = {}
        self._repeated = RepeatedSteps()
        #: merges under way or due, advanced by one row group per ``idle`` call
        self._merges: list[Generator[None, None, None]] = []
        self._merge_failed = False
        for prefix in existing_prefixes(self.out_dir):  # what a killed writer left, cleaned now
            self._open(prefix)

    def directory(self, prefix: str) -> str:
        return os.path.join(self.out_dir, VALUES_DIR, f"data_type={prefix}")

    def _open(self, prefix: str) -> None:
        """A data type's directory, at the writer's start or its first record: note what a
        resumed directory already has; delete temporary files and the step files that a whole
        merged file covers (both left by a kill)."""
        directory = make_private_dir(self.directory(prefix))
        for entry in os.scandir(directory):
            if entry.name.startswith(".tmp-") and entry.name.endswith(".parquet.tmp"):
                os.unlink(entry.path)
        merged, steps, late = scan(directory)
        for first, last, merged_path in merged:
            inside = [path for step, path in steps if first <= step <= last]
            held = row_count(merged_path)  # a step file that cannot be read adds no rows
            if inside and held is not None and held >= sum(row_count(path) or 0 for path in inside):
                for path in inside:
                    os.unlink(path)
                steps = [(step, path) for step, path in steps if path not in inside]
        self._unmerged[prefix] = [(step, path) for step, path in steps if not covered(step, merged)]
        self._merged_until[prefix] = max((last for _, last, _ in merged), default=-1)
        every = [last for _, last, _ in merged] + [step for step, _ in steps + late]
        self._resumed_last[prefix] = max(every, default=-1)

    def _label_columns(self, rows: RowSet, ops: tuple[str, ...]) -> list:
        """micro_step, vpp_stage, name and op of every value of a record (op by op, row by row),
        built once per RowSet and ops."""
        pa = self._pa
        by_ops = self._labels.get(rows)
        if by_ops is None:
            by_ops = self._labels[rows] = {}
        columns = by_ops.get(ops)
        if columns is None:
            count = len(ops)
            micro = (
                pa.nulls(len(rows) * count, pa.int64())
                if rows.micro_steps is None
                else pa.array(np.tile(np.asarray(rows.micro_steps, dtype=np.int64), count))
            )
            row = np.arange(len(rows), dtype=np.int32)
            columns = by_ops[ops] = [
                micro,
                pa.array(np.tile(np.asarray(rows.vpp_stages, dtype=np.int64), count)),
                pa.DictionaryArray.from_arrays(np.tile(row, count), pa.array(rows.names, pa.string())),
                pa.DictionaryArray.from_arrays(
                    np.repeat(np.arange(count, dtype=np.int32), len(rows)), pa.array(ops, pa.string())
                ),
            ]
        return columns

    def write(self, record: StepRecord) -> None:
        if len(record.rows) == 0:
            return
        prefix = record.prefix
        if prefix not in self._resumed_last:
            self._open(prefix)
        if record.step <= self._resumed_last[prefix]:  # a resumed run repeats steps
            self._repeated.leave_out(prefix, record.step, self.directory(prefix))
            return
        pa = self._pa
        values = np.ascontiguousarray(record.resolve().T, dtype=np.float64).ravel()
        count = len(values)
        table = pa.Table.from_arrays(
            [
                pa.repeat(pa.scalar(self.rank, pa.int64()), count),
                pa.repeat(pa.scalar(record.step, pa.int64()), count),
                *self._label_columns(record.rows, record.ops),
                pa.array(values),
            ],
            schema=self._schema,
        )
        self._pending.setdefault(prefix, {}).setdefault(record.step, []).append(table)

    def end_step(self, step: int) -> None:
        """Every record so far into closed files, one per data type and step (each taken off the
        pending ones before it is written, so a failed write never writes another twice); the
        merges of the windows before this step's are queued."""
        while self._pending:
            prefix, by_step = next(iter(self._pending.items()))
            record_step = min(by_step)
            tables = by_step.pop(record_step)
            if not by_step:
                del self._pending[prefix]
            late = record_step <= self._merged_until[prefix]  # its window is merged already
            path = self._free_name(prefix, record_step, late)
            self._write([self._pa.concat_tables(tables)], path, STEP_ZSTD_LEVEL)
            if not late:
                self._unmerged[prefix].append((record_step, path))
        self._queue_merges(lambda window: window < step // self.merge_steps)

    def _free_name(self, prefix: str, step: int, late: bool = False) -> str:
        """A file name for records of ``step`` that no file has: ``step-{step}.parquet``, then
        copies for records of the step that come after its file was written; ``late-{step}-{n}``
        for records of a step whose window was merged before they came."""
        copy = 0
        name = late_file_name if late else step_file_name
        while os.path.exists(path := os.path.join(self.directory(prefix), name(step, copy))):
            copy += 1
        return path

    def _write(self, row_groups: Iterable[Any], path: str, level: int) -> None:
        """Tables, one row group each, into the file ``path``, through a temporary name."""
        for _ in self._writing(row_groups, path, level):
            pass

    def _writing(
        self, row_groups: Iterable[Any], path: str, level: int, durable: bool = False
    ) -> Generator[None, None, None]:
        """``_write`` a row group at a time: yields after each but the last, with which the file
        is closed and renamed into place, and for each None among ``row_groups`` (a piece of the
        work that made them); the temporary file is removed if it never is. ``durable``:
        the file and the rename reach the disk before it returns (a merged file, whose step files
        are deleted next: a power loss must not leave an empty merged file in their place)."""
        import pyarrow.parquet as pq

        fd, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet.tmp", dir=os.path.dirname(path))
        try:
            with (
                os.fdopen(fd, "wb") as handle,
                pq.ParquetWriter(handle, self._schema, **file_options(level)) as out,
            ):
                ready = None
                for table in row_groups:
                    if table is None:
                        yield
                        continue
                    if ready is not None:
                        out.write_table(ready, row_group_size=ready.num_rows)
                        yield
                    ready = table
                if ready is not None:  # the last one: written, closed and renamed in one go
                    out.write_table(ready, row_group_size=ready.num_rows)
                if durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.chmod(temporary, FILE_MODE)
            os.replace(temporary, path)
            if durable:
                fsync_directory(os.path.dirname(path))
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise

    def _queue_merges(self, due: Callable[[int], bool]) -> None:
        """Queue the merge of every window ``due`` says is; a window of one step file stays as
        it is (merging would only rewrite it)."""
        for prefix, files in self._unmerged.items():
            windows: dict[int, list[tuple[int, str]]] = {}
            for step, path in files:
                if due(step // self.merge_steps):
                    windows.setdefault(step // self.merge_steps, []).append((step, path))
            for window_files in windows.values():
                done = {path for _, path in window_files}
                files[:] = [(s, p) for s, p in files if p not in done]
                last = max(step for step, _ in window_files)
                self._merged_until[prefix] = max(self._merged_until[prefix], last)  # later: late
                if len(window_files) > 1:
                    self._merges.append(self._merging(prefix, window_files))

    def _merging(self, prefix: str, window_files: list[tuple[int, str]]) -> Generator[None, None, None]:
        """One window's step files into one merged file, a row group per resumption; then the
        step files are deleted."""
        steps = [step for step, _ in window_files]
        paths = [path for _, path in window_files]
        target = os.path.join(self.directory(prefix), merged_file_name(min(steps), max(steps)))
        if os.path.exists(target):  # never replace a merged file: keep the step files
            return
        yield from self._writing(self._row_groups(paths), target, MERGED_ZSTD_LEVEL, durable=True)
        self._remove_merged(paths)

    def idle(self) -> bool:
        """One piece of the oldest merge, a step file's reading or a row group's writing (the
        writer thread calls this while nothing is queued, so a record waits for one piece at
        most); whether merges remain."""
        self._advance_merge()
        return bool(self._merges)

    def _advance_merge(self, everything: bool = False) -> None:
        """One piece of the oldest merge (every merge with ``everything``). A merge that
        fails leaves the files it has not deleted as they are, said once."""
        while self._merges:
            try:
                next(self._merges[0])
            except StopIteration:
                self._merges.pop(0)
            except Exception as exc:  # an unreadable step file (a disk fault): keep it, go on
                self._merges.pop(0)
                if not self._merge_failed:
                    self._merge_failed = True
                    logger.warning(
                        "trainmon: could not merge Parquet step files in %s (%r); the files stay",
                        self.out_dir,
                        exc,
                    )
            if not everything:
                return

    def _row_groups(self, paths: list[str]) -> Iterator[Any]:
        """The rows of these step files, in row groups of about MERGE_ROWS rows, with a None after
        each file read: a merge holds two row groups in memory, not the window, and the writer
        thread does a file's reading or a row group's writing between records, so that the end
        of a step never waits for a whole window (a hundred reads of small files took 0.3 s).
        (Putting each value's series of steps together instead made the files only about 3%
        smaller: exact doubles compress little either way.)"""
        import pyarrow.parquet as pq

        group: list = []
        rows = 0
        for index, path in enumerate(paths):
            group.append(pq.read_table(path, schema=self._schema))
            rows += group[-1].num_rows
            if rows >= MERGE_ROWS or index == len(paths) - 1:
                yield self._pa.concat_tables(group).unify_dictionaries()
                group, rows = [], 0
            else:
                yield None

    @staticmethod
    def _remove_merged(paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)

    def close(self) -> None:
        """Write what is pending, then merge every window (the last one too)."""
        self._repeated.close()
        if self._pending:
            self.end_step(max(step for by_step in self._pending.values() for step in by_step))
        self._queue_merges(lambda window: True)
        self._advance_merge(everything=True)
