"""Checks of single config values: each returns the value in its canonical type or raises
ConfigError naming the key path, the bad value and what was expected.

monitor.config.schema uses them for every key; they know nothing about which keys exist.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

from monitor.files import parse_time_tag

logger = logging.getLogger("trainmon")


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or out of range."""


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` naming the known name closest to ``value``, or ``""`` when none
    is close (what every error about a misspelt name ends with)."""
    if not isinstance(value, str):
        return ""
    by_case = {name.lower(): name for name in known}  # "NORM" is close to "norm"
    close = difflib.get_close_matches(value.lower(), list(by_case), n=1)
    return f"; did you mean {by_case[close[0]]!r}?" if close else ""


def warn(message: str, *args: Any) -> None:
    """A warning about a config being read (none inside ``config_warnings_said``)."""
    if not _warnings_said:
        logger.warning("trainmon config: " + message, *args)


def warn_unknown(key: str, known: tuple[str, ...], path: str) -> None:
    """One warning for an unknown key, naming the closest known one."""
    warn("unknown key %r ignored%s", f"{path}{key}", did_you_mean(key, known))


_warnings_said = False


@contextlib.contextmanager
def config_warnings_said() -> Iterator[None]:
    """Reading a config again whose warnings were said at its first read."""
    global _warnings_said
    before, _warnings_said = _warnings_said, True
    try:
        yield
    finally:
        _warnings_said = before


def unknown_key(
    path: str, key: str, known: tuple[str, ...] | list[str], what: str = "unknown key"
) -> ConfigError:
    """The error for a key a section does not have, naming the keys it has and the closest one."""
    hint = did_you_mean(str(key), known)
    return ConfigError(f"{path}: {what}; expected one of {', '.join(known)}{hint}")


def not_one_of(path: str, value: Any, choices: tuple[str, ...] | list[str]) -> ConfigError:
    """The error for a value outside ``choices``, naming the closest choice when there is one."""
    hint = did_you_mean(value, choices)
    return ConfigError(f"{path}: expected one of {', '.join(choices)}, got {describe(value)}{hint}")


def kind_of(spec: Any, path: str, key: str, kinds: tuple[str, ...], expected: str) -> str:
    """The ``key`` of an object that names its kind there (a rule's ``rule_name``, a sink's
    ``type``), one of ``kinds``; ``expected`` says what the object should look like."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected {expected}, got {describe(spec)}")
    kind = spec.get(key)
    if kind not in kinds:
        raise not_one_of(f"{path}.{key}", kind, kinds)
    return kind


def describe(value: Any) -> str:
    """The value as an error message shows it: its repr, cut to 80 characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond Python's digit limit for str(), or a container holding one
        if isinstance(value, int):
            return f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
        return f"a {type(value).__name__} holding an integer too long to print"
    return text if len(text) <= 80 else text[:77] + "..."


def as_bool(value: Any, path: str) -> bool:
    """true or false, nothing else (1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {describe(value)}")
    return value


def as_int(value: Any, path: str, low: int | None = None, high: int | None = None) -> int:
    """An integer (a whole float such as 2.0 is accepted) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise ConfigError(f"{path}: expected an integer{range_text(low, high)}, got {describe(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{path}: expected an integer{range_text(low, high)}, got {describe(value)}")
    return value


def range_text(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    return ""


def as_number(value: Any, path: str, positive: bool = False, at_most: float | None = None) -> float:
    """A finite number >= 0 (> 0 with ``positive``), at most ``at_most`` where given."""
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ConfigError(f"{path}: expected a finite number, got {describe(value)}")
    if positive and value <= 0:
        raise ConfigError(f"{path}: expected a number > 0, got {value}")
    if value < 0:
        raise ConfigError(f"{path}: expected a number >= 0, got {value}")
    if at_most is not None and value > at_most:
        raise ConfigError(f"{path}: expected a number <= {at_most:g}, got {value}")
    return float(value)


def as_str_list(value: Any, path: str) -> tuple[str, ...]:
    """A list of strings, as a tuple."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: expected a list of strings, got {describe(value)}")
    return tuple(value)


def as_rank_list(value: Any, path: str) -> tuple[int, ...]:
    """A list of ranks (integers >= 0; digit strings too, as MindSpore's 1.2.2 configs write
    them), sorted without repeats."""
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of integer ranks, got {describe(value)}")
    ranks = []
    for i, rank in enumerate(value):
        if isinstance(rank, str) and rank.strip().isascii() and rank.strip().isdigit():
            rank = int(rank)
        ranks.append(as_int(rank, f"{path}[{i}]", 0))
    return tuple(sorted(set(ranks)))


def as_time_range(value: Any, path: str) -> tuple[str, ...]:
    """``[]`` or two time tags like ``Dec03_21-34-40``, the start not after the end."""
    times = as_str_list(value, path)
    if len(times) not in (0, 2):
        expected = "[] or two time strings like 'Dec03_21-34-40'"
        raise ConfigError(f"{path}: expected {expected}, got {describe(value)}")
    for i, text in enumerate(times):
        if parse_time_tag(text) is None:
            raise ConfigError(f"{path}[{i}]: expected a time like 'Dec03_21-34-40', got {text!r}")
    if times and parse_time_tag(times[0]) > parse_time_tag(times[1]):
        raise ConfigError(f"{path}: expected the start before the end, got {list(times)!r}")
    return times
