"""The memory limit of the offline readers (cross-rank analysis, ``trainmon compact``).

One setting for all of them: a ``--memory-limit`` flag where the command has one, else the
TRAINMON_MEMORY_LIMIT environment variable, else the command's default. Sizes are written as
DuckDB writes them: a number with an optional unit, ``512MB``, ``4GB``, ``1.5GiB`` (decimal units
are powers of 1000, binary ones of 1024; a bare number is bytes).
"""

from __future__ import annotations

import argparse
import os
import re

ENV = "TRAINMON_MEMORY_LIMIT"
#: ``trainmon compact``'s default: DuckDB spills to disk beyond it.
COMPACT_DEFAULT = "2GB"
#: ``anomaly-analyse --cross-rank``'s default: it reads the run in windows of steps that fit.
CROSS_RANK_DEFAULT = "1GB"
#: a size written without a unit below this is a slip (``--memory-limit 10`` meaning 10GB), not bytes.
BARE_MINIMUM = 2**20
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, where: str = ENV) -> int:
    """Bytes of a size such as ``4GB``.

    Raises:
        ValueError: not a positive size; the message names ``where`` the text came from.
    """
    match = _SIZE.match(str(text))
    unit = match[2].upper() if match else ""
    if unit in ("K", "M", "G", "T"):
        unit += "B"
    if not match or unit not in _UNITS or float(match[1]) * _UNITS.get(unit, 0) < 1:
        raise ValueError(f"{where}: expected a size such as '512MB', '4GB' or '2GiB', got {text!r}")
    return int(float(match[1]) * _UNITS[unit])


def memory_limit(flag: str | None, default: str) -> int:
    """Bytes allowed: the flag's value, else TRAINMON_MEMORY_LIMIT, else ``default``.

    Raises:
        ValueError: the chosen setting is not a size, or is a number below BARE_MINIMUM without a unit.
    """
    where, text = ("--memory-limit", flag) if flag is not None else (ENV, os.environ.get(ENV) or None)
    if text is None:
        where, text = "default", default
    size = parse_size(text, where)
    if size < BARE_MINIMUM and not _SIZE.match(str(text))[2]:  # no unit
        raise ValueError(
            f"{where}: a bare number is bytes: expected a size with a unit such as '10GB', got {text!r}"
        )
    return size


def add_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """The ``--memory-limit`` flag of a command."""
    parser.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help=f"memory the command may use, e.g. 4GB (default: ${ENV}, else {default})",
    )
