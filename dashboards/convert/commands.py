"""``trainmon csv2tb``, ``csv2db`` and ``compact``: their options and entry points.

This module is light on purpose (argparse only): the converters themselves import pandas and
TensorBoard, which ``trainmon --help`` and ``trainmon demo`` should not pay for, so they are
imported when a command runs. ``COMMANDS`` maps each sub-command to (description,
add_arguments(parser), run(args) -> exit status); exit status 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable

from monitor import memory_limit
from monitor.config.values import did_you_mean
from monitor.datatypes.tasks import PREFIX_TASKS
from monitor.files import TIME_FORMAT

#: data types the converters accept (msprobe 1.2.2 also wrote ``param``).
DATA_TYPES = (*PREFIX_TASKS, "param")
#: worker processes a converter may use.
MAX_PROCESSES = 128


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PROCESSES:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_PROCESSES}], got {text!r}")
    return value


def _types(text: str) -> list[str]:
    types = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if t not in DATA_TYPES]
    if not types or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(DATA_TYPES)}; got {text!r}"
            f"{did_you_mean(unknown[0] if unknown else text, DATA_TYPES)}"
        )
    return types


def _add_monitor_path(parser: argparse.ArgumentParser) -> None:
    """``DIR`` or ``-d/--monitor-path DIR``: where the commands read from."""
    parser.add_argument(
        "directory", nargs="?", default=None, metavar="DIR", help="the same as -d DIR (one of the two)"
    )
    parser.add_argument(
        "-d",
        "--monitor-path",
        dest="monitor_path",
        default=None,
        help="the monitor's output directory (what MONITOR_OUTPUT_DIR named in training) holding "
        "{time}-rank{R}-{id} directories",
    )


def _monitor_path(args: argparse.Namespace, command: str) -> str | None:
    """The directory given as ``DIR`` or ``-d DIR``; None (said on stderr) for none or two."""
    given = {os.path.realpath(path): path for path in (args.directory, args.monitor_path) if path}
    if len(given) == 1:
        return given.popitem()[1]
    what = "two different directories" if given else "no directory"
    print(
        f"trainmon {command}: DIR or -d DIR: expected the monitor's output directory, got {what}",
        file=sys.stderr,
    )
    return None


def _add_selection(parser: argparse.ArgumentParser) -> None:
    """The converters' common options: -d, --start, --end, --types, -j, --no-progress."""
    _add_monitor_path(parser)
    example = TIME_FORMAT.replace("%", "%%")  # argparse %-formats help texts
    parser.add_argument(
        "--start", default=None, help=f"first time tag to include, e.g. Dec03_21-34-40 ({example})"
    )
    parser.add_argument("--end", default=None, help="last time tag to include (inclusive)")
    parser.add_argument(
        "--types",
        type=_types,
        default=None,
        help="comma-separated data types (default: every one found), e.g. grad_reduced,exp_avg",
    )
    parser.add_argument("-j", "--jobs", type=_jobs, default=1, help="worker processes (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_options(parser: argparse.ArgumentParser, output_help: str) -> None:
    """The common options and ``-o/--output`` (what it names differs per converter)."""
    _add_selection(parser)
    parser.add_argument("-o", "--output", default=None, help=output_help)


#: the converters' Python parameters (msprobe's names) as the command line names them
CLI_NAMES = {
    "monitor_path": "DIR",
    "time_start": "--start",
    "time_end": "--end",
    "process_num": "-j",
    "data_type_list": "--types",
    "output": "-o",
}


def _cli_message(message: str) -> str:
    """A converter's error as the command line says it: ``--start: ...`` for ``time_start: ...``."""
    name, colon, rest = message.partition(":")
    return f"{CLI_NAMES[name]}:{rest}" if colon and name in CLI_NAMES else message


def _unusable_output(command: str, output: str | None, directory: bool) -> bool:
    """Whether ``-o`` names what cannot be written (said on stderr): a file where a directory is
    to be written, or a directory where a file is; checked before any work is done."""
    if output is None or not os.path.exists(output) or os.path.isdir(output) == directory:
        return False
    kind, expected = ("a file", "a directory") if directory else ("a directory", "a file")
    print(f"trainmon {command}: -o {output!r} is {kind}: expected {expected} to write", file=sys.stderr)
    return True


def _convert(command: str, convert: Callable[..., str], args: argparse.Namespace, *hints: str) -> int:
    """Run a converter on parsed options; print what it wrote and ``hints`` (``{out}``: that path)."""
    from dashboards.convert.runs import ConvertError

    monitor_path = _monitor_path(args, command)
    if monitor_path is None or _unusable_output(command, args.output, directory=command != "csv2db"):
        return 2
    try:
        out = convert(
            monitor_path,
            args.start,
            args.end,
            args.jobs,
            args.types,
            args.output,
            progress=not args.no_progress,
        )
    except ConvertError as exc:
        print(f"trainmon {command}: {_cli_message(str(exc))}", file=sys.stderr)
        return 2
    print(f"Written:     {out}")
    for hint in hints:
        print(hint.format(out=out, monitor=monitor_path))
    _say_earlier_conversions(out, monitor_path)
    return 0


def _say_earlier_conversions(out: str, monitor_path: str) -> None:
    """Name the conversions an earlier command left beside this one: TensorBoard pointed at the
    monitor directory shows each of them as runs of their own."""
    suffix = out.rstrip(os.sep).rpartition("-")[2]
    if os.path.dirname(os.path.abspath(out)) != os.path.abspath(monitor_path):
        return
    try:
        earlier = sorted(
            name
            for name in os.listdir(monitor_path)
            if name.endswith(f"-{suffix}") and os.path.join(monitor_path, name) != out.rstrip(os.sep)
        )
    except OSError:
        return
    if earlier:
        print(
            f"Note:        {len(earlier)} earlier conversion(s) in {monitor_path} ({', '.join(earlier)}): "
            "TensorBoard shows them as runs too; remove what you no longer need"
        )


def add_csv2tb_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``trainmon csv2tb``."""
    _add_options(parser, "output directory (default MONITOR_PATH/{time}-csv2tensorboard_by_step)")


def run_csv2tb(args: argparse.Namespace) -> int:
    """``trainmon csv2tb``."""
    from dashboards.convert.csv2tb import csv2tensorboard_by_step

    return _convert(
        "csv2tb",
        csv2tensorboard_by_step,
        args,
        "Look at it:  tensorboard --logdir {out}",
        "         or  tensorboard --logdir {monitor}   (the trainmon tab as well)",
    )


def add_csv2db_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``trainmon csv2db``."""
    _add_options(parser, "database file (default MONITOR_PATH/{time}-csv2db/monitor_metrics.db)")


def run_csv2db(args: argparse.Namespace) -> int:
    """``trainmon csv2db``."""
    from dashboards.convert.csv2db import csv2db

    return _convert("csv2db", csv2db, args)


def add_compact_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``trainmon compact``: the monitor's output directory as ``DIR`` or ``-d DIR``."""
    _add_monitor_path(parser)
    parser.add_argument(
        "-o", "--output", default=None, help="dataset directory (default MONITOR_PATH/dataset)"
    )
    memory_limit.add_argument(parser, memory_limit.COMPACT_DEFAULT)


def run_compact(args: argparse.Namespace) -> int:
    """``trainmon compact``."""
    import duckdb

    from dashboards.convert.compact import compact
    from dashboards.convert.runs import ConvertError

    monitor_path = _monitor_path(args, "compact")
    if monitor_path is None or _unusable_output("compact", args.output, directory=True):
        return 2
    try:
        limit = memory_limit.memory_limit(args.memory_limit, memory_limit.COMPACT_DEFAULT)
    except ValueError as exc:
        print(f"trainmon compact: {exc}", file=sys.stderr)
        return 2
    out = args.output or os.path.join(monitor_path, "dataset")
    existed = os.path.exists(out)
    try:
        counts = compact(monitor_path, args.output, limit)
    except (ConvertError, duckdb.Error) as exc:
        if not existed:  # nothing half-written left behind: all of it was this compaction's
            shutil.rmtree(out, ignore_errors=True)
        hint = " (a larger --memory-limit may help)" if isinstance(exc, duckdb.OutOfMemoryException) else ""
        print(f"trainmon compact: {_cli_message(str(exc).splitlines()[0])}{hint}", file=sys.stderr)
        return 2
    print(f"Written:     {out} ({counts['written']} part(s) written, {counts['kept']} up to date)")
    values = f"read_parquet('{out}/values/**/*.parquet', hive_partitioning = true)"
    print(f'Query it:    python -c "import duckdb; duckdb.sql(\\"SELECT * FROM {values}\\").show()"')
    return 0


COMMANDS = {
    "csv2tb": (
        "convert the monitor's CSV (or Parquet) outputs into TensorBoard event files "
        "(one run per rank and data type)",
        add_csv2tb_arguments,
        run_csv2tb,
    ),
    "csv2db": (
        "write the monitor's CSV (or Parquet) outputs into one SQLite file "
        "(schema: dashboards/convert/csv2db.py)",
        add_csv2db_arguments,
        run_csv2db,
    ),
    "compact": (
        "write the monitor's outputs once as a Parquet dataset for SQL engines (DuckDB, Spark)",
        add_compact_arguments,
        run_compact,
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``csv2tb``, ``csv2db`` and ``compact`` to the ``trainmon`` command (``trainmon.commands``
    entry point)."""
    for name, (text, add_arguments, run) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        add_arguments(command)
        command.set_defaults(run=run)
