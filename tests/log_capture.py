"""Capturing what the "trainmon" logger emits during a test (it may not propagate to the root)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class LogRecords(logging.Handler):
    """Keeps every record emitted on the logger it is attached to."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        """Messages of the records emitted at exactly ``level``."""
        return [r.getMessage() for r in self.records if r.levelno == level]

    def errors(self) -> list[logging.LogRecord]:
        """The records at ERROR or above."""
        return [r for r in self.records if r.levelno >= logging.ERROR]

    def warnings(self) -> list[str]:
        """Messages of the records emitted at WARNING."""
        return self.at(logging.WARNING)


@contextmanager
def trainmon_records() -> Iterator[LogRecords]:
    """A LogRecords attached to the "trainmon" logger at DEBUG; the logger is restored afterwards."""
    logger = logging.getLogger("trainmon")
    handler = LogRecords()
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
