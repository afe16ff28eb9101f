"""Fixtures of the reliability suite: one torch thread and the shared two-rank job.

The trainmon log fixture (``trainmon_log``) is tests/conftest.py's; LogRecords stays importable here.
"""

from __future__ import annotations

import pytest
import torch

from tests.log_capture import LogRecords as LogRecords  # re-exported for tests.reliability.test_bad_input


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: fast and deterministic on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory) -> list[dict]:
    """The shared two-rank gloo job of tests.reliability.ranks (run once per session)."""
    from tests.adapters.torch.distributed import run_ranks
    from tests.reliability.ranks import worker

    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("two_ranks")))
