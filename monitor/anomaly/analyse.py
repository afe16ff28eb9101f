"""Rank the anomalies of a run: which flagged value came first? (spec §9.6, drop-in CLI).

Reads every ``DIR/<sub-directory>/anomaly.json`` (normally ``DIR/rank{R}/anomaly.json``; point DIR at
the run's ``anomaly_detected`` directory), keeps the requested steps, selects the k earliest records
by the ordering of :mod:`monitor.anomaly.ordering`, writes them to ``OUT/anomaly_analyse.json``
atomically and prints them as a table.

Both record formats are read: trainmon's (key ``{tag}_{op}_step_{step}_call_{call_id}``, records with
``op``/``value``/``baseline``/``rule``) and msprobe's (key ``{tag}_step_{step}_call_{call_id}``, no
op/value; the op and rule, and in later versions value and history mean, are parsed from the
message). Required fields: rank, step, tag_name, message; a record without them or with a mistyped
field is skipped and counted, a file that cannot be read as a UTF-8 JSON object is skipped with one
warning and counted.

``call_id`` is the order in which the monitor computed the rows within one step **on one rank**;
it is only comparable within a rank (across ranks it is a heuristic, see the ordering module).

Exit status: 0 done, 1 the output could not be written, 2 bad input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import repeat

from monitor.anomaly.ordering import STAGE_NAMES, AnomalyRecord, TopK, select_records, stage_of

OUTPUT_NAME = "anomaly_analyse.json"
INPUT_NAME = "anomaly.json"
MESSAGE_WIDTH = 60
PARALLEL_BYTES = 32 * 2**20
PARALLEL_MAX_K = 256
MAX_JOBS = 8

DESCRIPTION = "Rank the anomalies recorded in DIR/rank*/anomaly.json by when they happened in the step."
EPILOG = """\
ordering: step, micro_step, stage (forward < backward < optimizer < unknown task), pipeline stage
(earlier first in forward, later first in backward/optimizer), call_id, rank, tag, op.
call_id is the collection order within one step on ONE rank; it is only comparable within a rank.
exit status: 0 done, 1 output not written, 2 bad input."""

_CONTROL = {c: "?" for c in range(32)} | {127: "?"}


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


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
            f"{self.records_read} records from {self.files_read} files; "
            f"skipped {self.files_skipped} files, {self.records_skipped} records"
        )


# ----------------------------------------------------------------------------------------- reading


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


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _total_size(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total


def scan_files(
    paths: list[str], k: int, steps: frozenset[int] | None, jobs: int | None = None
) -> list[FileResult]:
    """scan_file over paths, in path order; in worker processes when the input is large.

    jobs=None decides automatically: parallel for more than PARALLEL_BYTES of input and k <= PARALLEL_MAX_K
    (each worker ships back at most k records per file). A pool that cannot start falls back to serial.
    """
    if jobs is None:
        big = k <= PARALLEL_MAX_K and len(paths) > 1 and _total_size(paths) > PARALLEL_BYTES
        jobs = min(_cpu_count(), MAX_JOBS) if big else 1
    jobs = max(1, min(jobs, len(paths)))
    if jobs > 1:
        chunk = max(1, len(paths) // (jobs * 8))
        try:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                return list(pool.map(scan_file, paths, repeat(k), repeat(steps), chunksize=chunk))
        except (OSError, BrokenProcessPool):
            pass  # no usable process pool here (e.g. no /dev/shm): do it in this process
    return [scan_file(path, k, steps) for path in paths]


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


# ----------------------------------------------------------------------------------------- writing


def record_key(record: AnomalyRecord) -> str:
    """trainmon's anomaly.json key; without the op segment when the op is unknown."""
    op = f"_{record.op}" if record.op else ""
    return f"{record.tag_name}{op}_step_{record.step}_call_{record.call_id}"


def _json_number(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)


_JSON_FIELDS = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "op")


def record_to_json(record: AnomalyRecord) -> dict[str, object]:
    """The record as trainmon's writer lays it out (non-finite numbers as strings)."""
    document: dict[str, object] = {name: getattr(record, name) for name in _JSON_FIELDS}
    document["value"] = _json_number(record.value)
    document["baseline"] = _json_number(record.baseline)
    document["rule"] = record.rule
    document["message"] = record.message
    document["group_mates"] = list(record.group_mates)
    return document


def to_document(records: Iterable[AnomalyRecord]) -> dict[str, dict[str, object]]:
    """key -> record in ranking order; a key seen twice gets ``_rank{R}`` and then ``_{n}`` appended."""
    document: dict[str, dict[str, object]] = {}
    for record in records:
        key = record_key(record)
        if key in document:
            key = f"{key}_rank{record.rank}"
        base, n = key, 1
        while key in document:
            n += 1
            key = f"{base}_{n}"
        document[key] = record_to_json(record)
    return document


def write_atomic(path: str, text: str) -> None:
    """Write text to path via a fsynced temporary file in the same directory and os.replace."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the platform allows it
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _clean(text: str) -> str:
    return text.translate(_CONTROL)


def _value_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def format_table(records: list[AnomalyRecord], message_width: int = MESSAGE_WIDTH) -> str:
    """An aligned text table of ranked records."""
    header = ("#", "rank", "step", "micro_step", "stage", "tag", "op", "value", "message")
    rows = []
    for index, r in enumerate(records, 1):
        message = _clean(r.message)
        if len(message) > message_width:
            message = message[: message_width - 3] + "..."
        rows.append(
            (
                str(index),
                str(r.rank),
                str(r.step),
                str(r.micro_step),
                STAGE_NAMES[stage_of(r)],
                _clean(r.tag_name),
                _clean(r.op) or "-",
                _value_text(r.value),
                message,
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = {0, 1, 2, 3, 7}
    lines = []
    for row in [header, *rows]:
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- CLI


def _warn(text: str) -> None:
    print(f"anomaly-analyse: warning: {text}", file=sys.stderr)


def parse_step_list(text: str | list[int] | None) -> frozenset[int] | None:
    """Steps to keep from a Python list literal such as "[1, 2]"; None (all steps) for an empty list."""
    if text is None:
        return None
    value: object = text
    if isinstance(text, str):
        try:
            value = ast.literal_eval(text.strip() or "[]")
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text
    if type(value) is not list or not all(type(v) is int for v in value):
        raise UsageError(f"the step list must be a Python list of integers such as '[10, 20]', got {text!r}")
    return frozenset(value) or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the flags on a parser (standalone or a ``trainmon anomaly-analyse`` subparser)."""
    parser.add_argument(
        "-d", "--data_path", required=True, metavar="DIR", help="directory holding <sub-dir>/anomaly.json"
    )
    parser.add_argument(
        "-o", "--out_path", default=None, metavar="OUT", help="output directory (default: DIR; created)"
    )
    parser.add_argument(
        "-k", "--topk", type=int, default=8, metavar="K", help="number of earliest anomalies kept (default 8)"
    )
    parser.add_argument(
        "-s",
        "--step",
        "--step_list",
        dest="step_list",
        default="[]",
        metavar="LIST",
        help="Python list of steps to keep, e.g. '[10, 20]' (default '[]': all steps)",
    )
    from monitor.anomaly import cross_rank

    cross_rank.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the analysis for parsed arguments; returns the exit status."""
    if getattr(args, "cross_rank", False):
        from monitor.anomaly import cross_rank

        return cross_rank.run(args)
    try:
        out_dir, k, steps, paths = _check(args)
    except UsageError as exc:
        print(f"anomaly-analyse: error: {exc}", file=sys.stderr)
        return 2
    return report_anomalies(paths, k, steps, out_dir)


def report_anomalies(paths: list[str], k: int, steps: frozenset[int] | None, out_dir: str) -> int:
    """Rank the records of the anomaly files, write OUT/anomaly_analyse.json, print the table; exit status."""
    records, summary = collect(paths, k, steps)
    out_file = os.path.join(out_dir, OUTPUT_NAME)
    status = 0
    try:
        write_atomic(out_file, json.dumps(to_document(records), indent=1))
    except OSError as exc:
        print(f"anomaly-analyse: error: cannot write {out_file}: {exc}", file=sys.stderr)
        status = 1
    scope = "all steps" if steps is None else f"steps {sorted(steps)}"
    with stdout_guard():
        print(f"Top {len(records)} of {summary.records_selected} anomalies ({scope}):")
        if records:
            print(format_table(records))
        if status == 0:
            print(f"written to {out_file}")
        print(summary.line())
    return status


@contextlib.contextmanager
def stdout_guard() -> Iterator[None]:
    """Printing into a closed pipe (e.g. ``| head``) ends the report quietly; files are written already."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def check_common(args: argparse.Namespace) -> tuple[str, int, frozenset[int] | None]:
    """The data directory, k and steps of the arguments (UsageError when bad)."""
    data_dir = os.fspath(args.data_path)
    if not os.path.exists(data_dir):
        raise UsageError(f"data path does not exist: {data_dir}")
    if not os.path.isdir(data_dir):
        raise UsageError(f"data path is not a directory: {data_dir}")
    if args.topk < 1:
        raise UsageError(f"top k must be at least 1, got {args.topk}")
    return data_dir, args.topk, parse_step_list(args.step_list)


def make_out_dir(args: argparse.Namespace, data_dir: str) -> str:
    """OUT (default: the data directory), created if missing (UsageError when impossible)."""
    out_dir = os.fspath(args.out_path) if args.out_path else data_dir
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"output path is not a directory: {out_dir}")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create output directory {out_dir}: {exc.strerror or exc}") from None
    return out_dir


def _check(args: argparse.Namespace) -> tuple[str, int, frozenset[int] | None, list[str]]:
    data_dir, k, steps = check_common(args)
    try:
        paths = find_anomaly_files(data_dir)
    except OSError as exc:
        raise UsageError(f"cannot list {data_dir}: {exc.strerror or exc}") from None
    if not paths:
        raise UsageError(
            f"no anomaly files found: expected {os.path.join(data_dir, '<sub-dir>', INPUT_NAME)} "
            "(point -d at the anomaly_detected directory)"
        )
    return make_out_dir(args, data_dir), k, steps, paths


def main(argv: list[str] | None = None) -> int:
    """``python -m monitor.anomaly_analyse``; returns the exit status instead of raising SystemExit."""
    parser = argparse.ArgumentParser(
        prog="python -m monitor.anomaly_analyse",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the error
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)
