"""Shared test set-up: every test writes its outputs under its own temporary directory."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _output_dir(tmp_path, monkeypatch):
    """MONITOR_OUTPUT_DIR points into the test's tmp_path, so no test writes into the checkout."""
    out = tmp_path / "monitor_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return out
