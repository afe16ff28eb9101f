"""Fixtures of the reliability suite: one torch thread, the trainmon log, a clean process afterwards."""

from __future__ import annotations

import logging

import pytest
import torch


class LogRecords(logging.Handler):
    """Keeps every record emitted on the "trainmon" logger (which may not propagate to the root)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= logging.ERROR]

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: fast and deterministic on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def trainmon_log():
    """Every record of the "trainmon" logger during the test, captured by our own handler."""
    logger = logging.getLogger("trainmon")
    handler = LogRecords()
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory) -> list[dict]:
    """The shared two-rank gloo job of tests.reliability.ranks (run once per session)."""
    from tests.adapters.torch.distributed import run_ranks
    from tests.reliability.ranks import worker

    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("two_ranks")))
