"""Reading the per-rank anomaly files and keeping the k earliest records (for anomaly-analyse).

Reads ``DIR/<sub-directory>/anomaly.json`` files (normally ``DIR/rank{R}/anomaly.json``). Records
hold msprobe's fields, under trainmon's key (``{tag}_{op}_step_{step}_call_{call_id}``) or
msprobe's (``{tag}_step_{step}_call_{call_id}``); the op and rule, and in later versions the value
and history mean, are parsed from the message. Records that carry ``op``/``value``/``baseline``/
``rule`` fields themselves (anomaly-analyse's own output) are taken as they are. Required
fields: rank, step, tag_name, message; a record without them or with a mistyped field is skipped
and counted, a file that cannot be read as a UTF-8 JSON object is skipped with one
warning and counted. Records are ordered by :mod:`monitor.anomaly.ordering`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from monitor.anomaly.ordering import AnomalyRecord, TopK, select_records
from monitor.anomaly.workers import map_in_workers, max_workers, total_size
from monitor.files import EARLIER_RUN

INPUT_NAME = "anomaly.json"
PARALLEL_BYTES = 32 * 2**20
PARALLEL_MAX_K = 256


class FileSkipped(Exception):
    """An anomaly file that cannot be used at all."""


@dataclass
class Summary:
    """Counts reported in the summary line."""

    files_read: int = 0
    files_skipped: int = 0
    records_read: int = 0
    records_skipped: int = 0
    records_selected: int = 0

    def line(self) -> str:
        return (
            f"{_count(self.records_read, 'record')} from {_count(self.files_read, 'file')}; "
            f"skipped {_count(self.files_skipped, 'file')}, {_count(self.records_skipped, 'record')}"
        )


def load_anomaly_file(path: str) -> dict:
    """The decoded JSON object of one anomaly.json.

    Raises FileSkipped when the file is unreadable, not UTF-8, not JSON or not a JSON object.
    """
    try:
        with open(path, encoding="utf-8-sig") as handle:
            data = json.load(handle)
    except UnicodeDecodeError as exc:
        raise FileSkipped(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FileSkipped(f"not valid JSON (truncated?): {exc.msg} at line {exc.lineno}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise FileSkipped(f"cannot be read: {exc}") from None
    if type(data) is not dict:
        raise FileSkipped(f"not a JSON object but {type(data).__name__}")
    return data


def find_anomaly_files(data_dir: str) -> list[str]:
    """``DIR/*/anomaly.json`` files one level below data_dir, sorted by path."""
    found = []
    with os.scandir(data_dir) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            path = os.path.join(entry.path, INPUT_NAME)
            if is_dir and os.path.isfile(path):
                found.append(path)
    return sorted(found)


def earlier_runs_files(paths: list[str]) -> list[str]:
    """The anomaly files that earlier runs in the same output directories left beside ``paths``
    (``anomaly.json.earlier-<time>``, kept when a new run began there), sorted; they are not read."""
    found = []
    for path in paths:
        directory, name = os.path.split(path)
        with os.scandir(directory) as entries:
            found += [e.path for e in entries if e.name.startswith(f"{name}{EARLIER_RUN}") and e.is_file()]
    return sorted(found)


@dataclass
class FileResult:
    """What one anomaly file contributes: its k earliest selected records and its counts."""

    records: list[AnomalyRecord]
    read: int = 0
    bad: int = 0
    selected: int = 0
    warning: str | None = None
    skipped: bool = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Reading builds millions of acyclic objects that the cyclic GC would only rescan (2x slower)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def scan_file(path: str, k: int, steps: frozenset[int] | None = None) -> FileResult:
    """Read one anomaly file and keep its k earliest records in the selected steps (None: all)."""
    try:
        with _gc_paused():
            selection = select_records(load_anomaly_file(path), k, steps)
    except FileSkipped as exc:
        return FileResult([], warning=f"skipping {path}: {exc}", skipped=True)
    bad, warning = selection.bad_keys, None
    if bad:
        warning = (
            f"{path}: skipped {len(bad)} malformed record(s) (missing or mistyped rank/step/"
            f"tag_name/message or other field), first key {bad[0]!r}"
        )
    return FileResult(selection.records, selection.valid, len(bad), selection.selected, warning)


def scan_files(
    paths: list[str], k: int, steps: frozenset[int] | None, jobs: int | None = None
) -> list[FileResult]:
    """scan_file over paths, in path order; in worker processes when the input is large.

    jobs=None decides automatically: parallel for more than PARALLEL_BYTES of input and k <= PARALLEL_MAX_K
    (each worker ships back at most k records per file). A pool that cannot start falls back to serial.
    """
    if jobs is None:
        big = k <= PARALLEL_MAX_K and len(paths) > 1 and total_size(paths) > PARALLEL_BYTES
        jobs = max_workers() if big else 1
    chunk = max(1, len(paths) // (max(jobs, 1) * 8))
    return map_in_workers(scan_file, paths, jobs, k, steps, chunksize=chunk)


def collect(
    paths: list[str],
    k: int,
    steps: frozenset[int] | None = None,
    warn: Callable[[str], None] | None = None,
    jobs: int | None = None,
) -> tuple[list[AnomalyRecord], Summary]:
    """The k earliest records of the given files (restricted to steps unless None) and the counts."""
    warn = warn or _warn
    selected, summary = TopK(k), Summary()
    with _gc_paused():
        for result in scan_files(paths, k, steps, jobs):
            if result.warning:
                warn(result.warning)
            if result.skipped:
                summary.files_skipped += 1
                continue
            summary.files_read += 1
            summary.records_read += result.read
            summary.records_skipped += result.bad
            summary.records_selected += result.selected
            selected.extend(result.records)
        return selected.result(), summary


def _warn(text: str) -> None:
    print(f"anomaly-analyse: warning: {text}", file=sys.stderr)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
