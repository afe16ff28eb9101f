"""Fixtures for the MindSpore adapter tests: PyNative mode on CPU."""

from __future__ import annotations

import pytest

SKIP_REASON = "MindSpore is not installed here (pip install -e '.[mindspore]' installs it)"


@pytest.fixture(autouse=True)
def _pynative_cpu():
    """Every test runs on the CPU and starts in PyNative mode (graph-mode tests switch)."""
    ms = pytest.importorskip("mindspore", reason=SKIP_REASON)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
