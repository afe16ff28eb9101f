"""Rank the anomalies of a run: which incident came first, its root, and the first records.

Reads every ``DIR/<sub-directory>/anomaly.json`` (normally ``DIR/rank{R}/anomaly.json``; point DIR at
the run's ``anomaly_detected`` directory, the output root above it, or one rank's directory for
that rank alone) and the ``incidents.json`` beside it. The incidents of all
ranks are merged (:mod:`monitor.anomaly.incident_files`) and written to
``OUT/incidents_analyse.json``; of the records, the requested steps are kept, the k earliest selected
by the ordering of :mod:`monitor.anomaly.ordering` and written to ``OUT/anomaly_analyse.json``
(msprobe's layout). Both files are replaced atomically and printed as tables, incidents first.
Reading (both record formats, what is skipped) is :mod:`monitor.anomaly.anomaly_files`; the
document and table are :mod:`monitor.anomaly.report`.
Their public names are importable from here too.

``call_id`` is the order in which the monitor computed the rows within one step **on one rank**;
it is only comparable within a rank (across ranks it is a heuristic, see the ordering module).

Exit status: 0 done, 1 the output could not be written, 2 bad input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
from collections.abc import Iterator

from monitor.anomaly import incident_files
from monitor.anomaly.anomaly_files import (
    INPUT_NAME,
    PARALLEL_BYTES,
    PARALLEL_MAX_K,
    FileResult,
    FileSkipped,
    Summary,
    _warn,
    collect,
    earlier_runs_files,
    find_anomaly_files,
    load_anomaly_file,
    scan_file,
    scan_files,
)
from monitor.anomaly.report import (
    MESSAGE_WIDTH,
    _clean,
    format_table,
    record_key,
    record_to_json,
    to_document,
    write_atomic,
)
from monitor.anomaly.workers import MAX_JOBS
from monitor.writers.parquet_files import not_a_run_hint

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "INPUT_NAME",
    "MAX_JOBS",
    "MESSAGE_WIDTH",
    "OUTPUT_NAME",
    "PARALLEL_BYTES",
    "PARALLEL_MAX_K",
    "FileResult",
    "FileSkipped",
    "Summary",
    "UsageError",
    "_clean",  # the cross-rank report shares the table's text cleaning and the warning line
    "_warn",
    "add_arguments",
    "check_common",
    "collect",
    "find_anomaly_files",
    "format_table",
    "load_anomaly_file",
    "main",
    "make_out_dir",
    "parse_step_list",
    "record_key",
    "record_to_json",
    "report_anomalies",
    "run",
    "scan_file",
    "scan_files",
    "stdout_guard",
    "to_document",
    "write_atomic",
]

OUTPUT_NAME = "anomaly_analyse.json"

DESCRIPTION = "Rank the anomalies recorded in DIR/rank*/anomaly.json by when they happened in the step."
EPILOG = """\
ordering: step; micro_step, with the parameters a step starts from (param_origin) before its
first micro-step and whole-step rows (local gradients summed over the step, reduced
gradients, optimizer) after its last; stage
(parameters < forward < backward < optimizer < unknown task); pipeline stage (earlier first in
forward, later first in backward/optimizer); call_id, rank, tag, op.
call_id is the collection order within one step on ONE rank; it is only comparable within a rank.
exit status: 0 done, 1 output not written, 2 bad input (also when no anomaly file can be read)."""


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


def parse_step_list(text: str | list[int] | None) -> frozenset[int] | None:
    """Steps to keep from a Python list literal such as "[1, 2]" (msprobe's form), or from "31" or
    "31, 32"; None (all steps) for an empty list."""
    if text is None:
        return None
    value: object = text
    if isinstance(text, str):
        try:
            value = ast.literal_eval(text.strip() or "[]")
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text
    value = [value] if type(value) is int else list(value) if type(value) is tuple else value
    if type(value) is not list or not all(type(v) is int for v in value):
        raise UsageError(f"the step list must be integers such as '[10, 20]', '10, 20' or '10', got {text!r}")
    return frozenset(value) or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the flags on a parser (standalone or a ``trainmon anomaly-analyse`` subparser)."""
    parser.add_argument(
        "directory", nargs="?", default=None, metavar="DIR", help="the same as -d DIR (one of the two)"
    )
    parser.add_argument(
        "-d",
        "--data_path",
        default=None,
        metavar="DIR",
        help="directory holding <sub-dir>/anomaly.json (or the output root above it, or one rank's "
        "directory holding anomaly.json: that rank alone)",
    )
    parser.add_argument(
        "-o",
        "--out_path",
        default=None,
        metavar="OUT",
        help="output directory (created; default: the directory of the anomaly files, and with "
        "--cross-rank the run's directory for its outliers)",
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
        help="steps to keep, e.g. '[10, 20]', '10,20' or '10' (default '[]': all steps)",
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
    """Merge the ranks' incidents and rank the records of the anomaly files; write
    OUT/incidents_analyse.json and OUT/anomaly_analyse.json, print both tables; exit status."""
    incidents, with_incidents = _merged_incidents(paths, steps)
    records, summary = collect(paths, k, steps)
    if summary.files_read == 0 and not with_incidents:  # "0 anomalies" would read as an all-clear
        print(
            f"anomaly-analyse: error: no anomaly file could be read ({summary.files_skipped} skipped, "
            "each named above); no ranking written",
            file=sys.stderr,
        )
        return 2
    out_file = os.path.join(out_dir, OUTPUT_NAME)
    incidents_file = os.path.join(out_dir, incident_files.OUTPUT_NAME)
    status = 0
    try:
        write_atomic(out_file, json.dumps(to_document(records), indent=1))
        if with_incidents:
            document = {"incidents": [item.to_json(number) for number, item in enumerate(incidents, 1)]}
            write_atomic(incidents_file, json.dumps(document, indent=1))
    except OSError as exc:
        print(f"anomaly-analyse: error: cannot write {exc.filename or out_dir}: {exc}", file=sys.stderr)
        status = 1
    scope = "all steps" if steps is None else f"steps {sorted(steps)}"
    with stdout_guard():
        if incidents:
            print(f"{len(incidents)} incident(s) ({scope}), earliest first:")
            print(incident_files.format_incidents(incidents))
            print()
        elif with_incidents:
            print(f"0 incidents ({scope})\n")
        if records:
            print(f"Top {len(records)} of {summary.records_selected} anomalies ({scope}):")
            print(format_table(records))
        elif steps is not None and summary.records_read:
            read = summary.records_read
            print(f"No anomalies at {scope} among the {read:,} read; without -s every step is ranked.")
        else:
            print(f"No anomalies ({scope}).")
        if status == 0:
            print(f"written to {out_file}" + (f" and {incidents_file}" if with_incidents else ""))
        print(summary.line())
        earlier = earlier_runs_files(paths)
        if earlier:
            print(
                f"not read: {len(earlier)} anomaly file(s) of earlier runs in these directories "
                f"({earlier[0]}{', ...' if len(earlier) > 1 else ''}); to analyse one, copy it as "
                f"<dir>/rank<R>/{INPUT_NAME} into a directory of its own and point -d there"
            )
    return status


def _merged_incidents(paths: list[str], steps: frozenset[int] | None) -> tuple[list, bool]:
    """The incidents next to the anomaly files, merged across ranks (those abnormal at one of
    ``steps``: begun there or still going), and whether there were incident files at all
    (msprobe's runs have none)."""
    found = [os.path.join(os.path.dirname(p), incident_files.INCIDENTS_NAME) for p in paths]
    found = [p for p in found if os.path.isfile(p)]
    merged = incident_files.merge(incident_files.load_incidents(found))
    if steps is not None:
        merged = [item for item in merged if item.abnormal_at(steps)]
    return merged, bool(found)


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
    given = {os.path.realpath(path): os.fspath(path) for path in (args.directory, args.data_path) if path}
    if len(given) != 1:
        what = "two different directories" if given else "no directory"
        raise UsageError(f"DIR or -d DIR: expected the directory to analyse, got {what}")
    (data_dir,) = given.values()
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
    from monitor.anomaly import cross_rank

    given = cross_rank.flags_given(args)
    if given:
        raise UsageError(f"{', '.join(given)}: only used with --cross-rank")
    data_dir, k, steps = check_common(args)
    try:
        paths = find_anomaly_files(data_dir)
        if not paths and os.path.isdir(os.path.join(data_dir, "anomaly_detected")):
            data_dir = os.path.join(data_dir, "anomaly_detected")  # the run's root: its anomaly files
            paths = find_anomaly_files(data_dir)
        if not paths and os.path.isfile(os.path.join(data_dir, INPUT_NAME)):
            paths = [os.path.join(data_dir, INPUT_NAME)]  # one rank's directory: that rank alone
    except OSError as exc:
        raise UsageError(f"cannot list {data_dir}: {exc.strerror or exc}") from None
    if not paths:
        raise UsageError(
            f"no anomaly files found: expected {os.path.join(data_dir, '<sub-dir>', INPUT_NAME)} "
            f"(point -d at the run's output directory or its anomaly_detected directory; a run "
            f"writes them only when its config sets alert.dump: true){not_a_run_hint(data_dir)}"
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
