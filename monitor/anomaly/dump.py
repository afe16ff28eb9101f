"""anomaly_detected/rank{R}/anomaly.json: the reference's record format, replaced atomically."""

from __future__ import annotations

import json
import logging
import os
import time

from monitor.anomaly.detector import Anomaly
from monitor.files import atomic_write_text, make_private_dir

logger = logging.getLogger("trainmon")

#: up to this many records the file is rewritten at every step with news (a crash loses nothing
#: of an ended step); a rewrite then costs ~0.1 s at most
THROTTLE_ABOVE_RECORDS = 10_000
#: beyond it, the next rewrite waits this many times the last one's duration (<= ~5% of the
#: writer's time; the reference spends over a second a step at 100,000 records)
REWRITE_PAUSE_FACTOR = 20.0


class AnomalyDump:
    """Keeps every anomaly of the run and rewrites anomaly.json at the end of a step with news.

    The file is written to a temporary name, fsynced and renamed, so a reader or a crash only
    ever sees a complete JSON document, and up to THROTTLE_ABOVE_RECORDS records it is rewritten
    at every step with news. Beyond that (a run flooded with anomalies) the next rewrite waits
    REWRITE_PAUSE_FACTOR times the last one's duration, so the file may lag a few steps behind
    until ``close``, which always writes the rest.
    """

    def __init__(self, root: str | os.PathLike, rank: int, keep: bool = False) -> None:
        self.directory = os.path.join(os.fspath(root), "anomaly_detected", f"rank{rank}")
        self.path = os.path.join(self.directory, "anomaly.json")
        self._records: dict[str, dict] = {}
        self._dirty = False
        self._next_rewrite = 0.0  # time.monotonic() before which a step's news wait
        make_private_dir(self.directory, under=root)
        if keep and os.path.isfile(self.path) and not os.path.islink(self.path):
            self._records = self._read_existing()
            return
        if os.path.lexists(self.path):
            logger.warning("trainmon: replacing the anomaly file of an earlier run at %s", self.path)
        atomic_write_text(self.path, "{}")

    def _read_existing(self) -> dict[str, dict]:
        """Records of this run written before a restart (a damaged file is kept aside, not lost)."""
        try:
            with open(self.path, encoding="utf-8") as handle:
                records = json.load(handle)
            if isinstance(records, dict):
                return records
        except (OSError, ValueError):
            pass
        os.replace(self.path, self.path + ".unreadable")
        logger.warning("trainmon: %s was unreadable; kept as %s.unreadable", self.path, self.path)
        return {}

    def add(self, anomalies: list[Anomaly]) -> None:
        for anomaly in anomalies:
            self._records[anomaly.key] = anomaly.to_json()
        self._dirty = self._dirty or bool(anomalies)

    def end_step(self, step: int) -> None:
        if self._dirty and time.monotonic() >= self._next_rewrite:
            self._rewrite()

    def close(self) -> None:
        if self._dirty:
            self._rewrite()

    def _rewrite(self) -> None:
        started = time.monotonic()
        atomic_write_text(self.path, json.dumps(self._records, indent=1))
        self._dirty = False
        took = time.monotonic() - started
        large = len(self._records) > THROTTLE_ABOVE_RECORDS
        self._next_rewrite = started + took * (1 + REWRITE_PAUSE_FACTOR) if large else 0.0
