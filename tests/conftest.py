"""Shared test set-up: every test writes its outputs under its own temporary directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.log_capture import LogRecords, trainmon_records


@pytest.fixture(autouse=True)
def _output_dir(tmp_path, monkeypatch):
    """MONITOR_OUTPUT_DIR points into the test's tmp_path, so no test writes into the checkout."""
    out = tmp_path / "monitor_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return out


@pytest.fixture
def trainmon_log() -> Iterator[LogRecords]:
    """Every record of the "trainmon" logger during the test, captured by our own handler."""
    with trainmon_records() as handler:
        yield handler
