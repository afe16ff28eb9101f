"""The ``api`` format: no files; the latest collected step of every data type stays in memory."""

from __future__ import annotations

import threading

from monitor.record import StepRecord


class ApiWriter:
    """Keeps the latest StepRecord per data type, for TrainerMon's generate_*_metrics accessors.

    Used for every format (reading them costs nothing); with ``format: api`` it is the only writer.
    """

    def __init__(self) -> None:
        self._latest: dict[str, StepRecord] = {}
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        with self._lock:
            self._latest[record.prefix] = record

    def latest(self, prefix: str) -> dict[str, dict[str, float]]:
        """``{tag: {op: float}}`` of the last collected step of ``prefix`` (empty if none)."""
        with self._lock:
            record = self._latest.get(prefix)
        return record.as_dict() if record is not None else {}

    def close(self) -> None:
        """Nothing to release; the values stay readable after stop()."""
