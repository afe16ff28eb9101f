"""Shared fixtures for the core (framework-free) tests: record factories."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import monitor.alerts.dispatch as dispatch
from monitor.record import RowSet, StepRecord


def build_record(
    prefix: str,
    step: int,
    names: Sequence[str],
    values: Sequence[Sequence[float]] | np.ndarray,
    ops: Sequence[str],
    *,
    rank: int | None = 0,
    task: str | None = None,
    vpp_stages: Sequence[int] | None = None,
    micro_steps: Sequence[int] | None = None,
    call_ids: Sequence[int] | None = None,
    rows: RowSet | None = None,
) -> StepRecord:
    """A StepRecord with rows built by RowSet.build (or the given RowSet) and float64 values."""
    if rows is None:
        rows = RowSet.build(
            list(vpp_stages) if vpp_stages is not None else [0] * len(names),
            list(names),
            rank,
            task or prefix,
            micro_steps=micro_steps,
        )
    array = np.asarray(values, dtype=np.float64).reshape(len(rows), len(ops))
    return StepRecord(
        prefix=prefix,
        step=step,
        ops=tuple(ops),
        rows=rows,
        values=array,
        call_ids=None if call_ids is None else np.asarray(call_ids, dtype=np.int64),
    )


@pytest.fixture
def make_record() -> Callable[..., StepRecord]:
    """``make_record(prefix, step, names, values, ops, **labels)`` -> StepRecord."""
    return build_record


@pytest.fixture
def quick(monkeypatch):
    """No long waits: claims decided after 0.2 s, close waits 2 s. Afterwards every sink's thread
    must have ended (a hanging endpoint's once the test's server let go)."""
    monkeypatch.setattr(dispatch, "CLAIM_WAIT_S", 0.2)
    monkeypatch.setattr(dispatch, "CLOSE_WAIT_S", 2.0)
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("trainmon-alert"):
            thread.join(15)
            assert not thread.is_alive(), f"{thread.name} still runs after close"
