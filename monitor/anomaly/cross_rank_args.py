"""The arguments of ``anomaly-analyse --cross-rank`` checked at the door: names of data types
and statistics, the memory limit, and which rank directories of which run ``--ranks`` and
``--start``/``--end`` choose, each refusal naming the option at fault."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

from monitor import memory_limit
from monitor.anomaly import analyse, rank_csv
from monitor.anomaly.analyse import UsageError
from monitor.config.values import did_you_mean
from monitor.files import RANK_DIR_PATTERN, time_bounds
from monitor.writers.parquet_files import live_prefixes, not_a_run_hint

_TYPE = re.compile(r"^[A-Za-z0-9_]+$")


def _parse_names(
    text: str, flag: str, example: str, allowed: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in str(text).split(",")))
    wrong = [n for n in names if not (_TYPE.match(n) and (allowed is None or n in allowed))]
    if wrong:
        choice = f" drawn from {', '.join(allowed)}" if allowed else ""
        hint = did_you_mean(wrong[0], allowed or ())
        raise UsageError(
            f"{flag}: expected comma-separated names{choice} such as '{example}', got {text!r}{hint}"
        )
    return names


@dataclass
class Settings:
    """Checked arguments of a cross-rank run."""

    data_dir: str
    out_dir: str
    k: int
    steps: frozenset[int] | None
    types: tuple[str, ...]
    ops: tuple[str, ...]
    rank_dirs: dict[int, str]
    memory: int


def check_arguments(args: argparse.Namespace) -> Settings:
    """The arguments of ``--cross-rank``, checked, and the rank directories they choose.

    Raises:
        UsageError: what is wrong, naming the option.
    """
    from monitor.config.schema import KNOWN_OPS

    data_dir, k, steps = analyse.check_common(args)
    try:
        memory = memory_limit.memory_limit(args.memory_limit, memory_limit.CROSS_RANK_DEFAULT)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not (isinstance(args.k_mad, (int, float)) and math.isfinite(args.k_mad) and args.k_mad > 0):
        raise UsageError(f"--k-mad must be a number > 0, got {args.k_mad!r}")
    types = _parse_names(args.types, "--types", "grad_unreduced,actv")
    ops = _parse_names(args.ops, "--ops", "norm,max", KNOWN_OPS)
    try:
        ranks = analyse.parse_step_list(args.ranks)
    except UsageError:
        raise UsageError(
            f"--ranks: expected a Python list of integers such as '[0, 2]', got {args.ranks!r}"
        ) from None
    try:
        within = time_bounds(args.start, args.end, ("--start", "--end"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        rank_dirs = rank_csv.find_rank_dirs(data_dir, ranks, within)
        if not rank_dirs and os.path.basename(os.path.normpath(data_dir)) == "anomaly_detected":
            data_dir = os.path.dirname(os.path.normpath(data_dir))  # the run's root holds the values
            rank_dirs = rank_csv.find_rank_dirs(data_dir, ranks, within)
        present = {
            prefix
            for path in rank_dirs.values()
            for prefix in (*rank_csv.list_type_files(path), *live_prefixes(path))
        }
    except rank_csv.DuplicateRankError as exc:
        raise UsageError(
            f"{exc}: choose one run with --start/--end (the time tags of its directory names), or point "
            "-d at a directory that holds the rank directories of one run"
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot list {exc.filename}: {exc.strerror or exc}") from None
    rank_dir = os.path.join(data_dir, "{time}-rank{R}-{id}")
    where = (
        f"{os.path.join(rank_dir, '{type}_{a}-{b}.csv')} (format csv) "
        f"or {os.path.join(rank_dir, 'values', 'data_type={type}')} (format parquet)"
    )
    if not rank_dirs and (ranks or any(within)):
        _say_none_chosen(data_dir, args, ranks)
    if not rank_dirs:
        raise UsageError(
            f"no per-rank output directories found: expected {where} (point -d at MONITOR_OUTPUT_DIR)"
            f"{not_a_run_hint(data_dir)}"
        )
    absent = sorted(set(ranks or ()) - set(rank_dirs))
    if absent:
        print(
            f"anomaly-analyse: --ranks: no output directory of rank(s) {absent} under {data_dir}",
            file=sys.stderr,
        )
    missing = [name for name in types if name not in present]
    if missing and len(missing) < len(types):
        print(
            f"anomaly-analyse: --types: no files of type {', '.join(missing)} in these rank directories"
            f"{did_you_mean(missing[0], present)}",
            file=sys.stderr,
        )
    if not present.intersection(types):
        raise UsageError(
            f"no CSV or Parquet files of type {', '.join(types)} in {len(rank_dirs)} rank directories "
            f"under {data_dir} "
            f"(types found: {', '.join(sorted(present)) or 'none'}; expected {where})"
            f"{did_you_mean(types[0], present)}"
        )
    return Settings(data_dir, analyse.make_out_dir(args, data_dir), k, steps, types, ops, rank_dirs, memory)


def _say_none_chosen(data_dir: str, args: argparse.Namespace, ranks: frozenset[int] | None) -> None:
    """Where ``--ranks`` or ``--start``/``--end`` chose none of the rank directories there are,
    the refusal names them and what there is (not "none found", which sends the user elsewhere).

    Raises:
        UsageError: there are rank directories, and the options chose none.
    """
    try:
        names = [entry.name for entry in os.scandir(data_dir) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    found = [match for match in map(RANK_DIR_PATTERN.match, names) if match]
    if not found:
        return
    given = [f"--ranks {args.ranks}"] if ranks else []
    given += [f"--{name} {getattr(args, name)}" for name in ("start", "end") if getattr(args, name)]
    raise UsageError(
        f"{' and '.join(given)} chose none of the {len(found)} rank directories under {data_dir} "
        f"(ranks {sorted({int(m.group(2)) for m in found})}, time tags "
        f"{', '.join(sorted({m.group(1) for m in found}))})"
    )
