"""The anomaly files of a rank: anomaly.json (msprobe's record format) and incidents.json.

Both live in ``anomaly_detected/rank{R}/`` and are replaced atomically. anomaly.json holds one
record per (tag, op, step) with exactly msprobe's fields, so msprobe's own analyser reads it;
incidents.json holds the incidents, each with its root, evidence and the full details of its
records (op, value, baseline, rule, ratios), which msprobe's format has no room for:

    {"version": 1, "rank": R, "incidents": [{"id", "rank", "ranks", "onset_step",
     "onset_micro_step", "state", "last_abnormal_step", "closed_step", "abnormal_steps",
     "tensors", "data_types", "root", "evidence", "records", "batch_ids", "step_batch_ids"}, ...]}

When the training loop names its micro-batches (``TrainerMon.set_batch_ids``), ``skip_batches.json``
lists, for data-pipeline tooling, the micro-batches where each incident began:

    {"version": 1, "rank": R, "batches": [{"incident", "step", "micro_step", "ids"}, ...]}
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from typing import Any

from monitor.anomaly.detector import Anomaly
from monitor.anomaly.incident_files import INCIDENTS_NAME
from monitor.files import EARLIER_RUN, atomic_write_text, make_private_dir

logger = logging.getLogger("trainmon")

#: up to this many records the file is rewritten at every step with news (a crash loses nothing
#: of an ended step); a rewrite then costs ~0.1 s at most
THROTTLE_ABOVE_RECORDS = 10_000
#: beyond it, the next rewrite waits this many times the last one's duration (<= ~5% of the
#: writer's time; msprobe 1.2.2 spends over a second a step at 100,000 records)
REWRITE_PAUSE_FACTOR = 20.0
INCIDENTS_VERSION = 1
SKIP_BATCHES_NAME = "skip_batches.json"


class AnomalyDump:
    """Keeps every anomaly of the run and rewrites anomaly.json at the end of a step with news.

    The file is written to a temporary name, fsynced and renamed, so a reader or a crash only
    ever sees a complete JSON document, and up to THROTTLE_ABOVE_RECORDS records it is rewritten
    at every step with news. Beyond that (a run flooded with anomalies) the next rewrite waits
    REWRITE_PAUSE_FACTOR times the last one's duration, so the file may lag a few steps behind
    until ``close``, which always writes the rest.
    """

    def __init__(self, root: str | os.PathLike, rank: int, keep: bool = False, owner: str = "") -> None:
        """``owner``: what this run is to the process (its rank directory); a collection of the
        same run started again keeps the run's anomaly directory."""
        self.rank = rank
        self.directory = _directory_of(owner or str(id(self)), os.fspath(root), rank, self)
        self.path = os.path.join(self.directory, "anomaly.json")
        self.incidents_path = os.path.join(self.directory, INCIDENTS_NAME)
        self.skip_path = os.path.join(self.directory, SKIP_BATCHES_NAME)
        self._records: dict[str, dict] = {}
        self._earlier_incidents: list[dict] = []
        self._incidents: list[dict] = []
        self._dirty = False
        self._next_rewrite = 0.0  # time.monotonic() before which a step's news wait
        make_private_dir(self.directory, under=root)
        if keep and os.path.isfile(self.path) and not os.path.islink(self.path):
            self._records = _read_existing(self.path, dict)
            self._earlier_incidents = _read_existing(self.incidents_path, dict).get("incidents", [])
            return
        for path in (self.path, self.incidents_path, self.skip_path):
            _keep_earlier(path)
        atomic_write_text(self.path, "{}")
        self._write_incidents()

    @property
    def next_incident_id(self) -> int:
        """Incidents of a restarted run continue the numbering of those written before."""
        ids = [i.get("id") for i in self._earlier_incidents if isinstance(i, dict)]
        return max((i for i in ids if isinstance(i, int)), default=0) + 1

    def set_incidents(self, incidents: list[Any]) -> None:
        """This session's incidents (objects with ``to_json``); written with the next rewrite."""
        self._incidents = [incident.to_json() for incident in incidents]
        self._dirty = True

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
        for owner, (_, dump) in list(_LIVE.items()):
            if dump() is self:
                del _LIVE[owner]

    def _rewrite(self) -> None:
        started = time.monotonic()
        atomic_write_text(self.path, json.dumps(self._records, indent=1))
        self._write_incidents()
        self._dirty = False
        took = time.monotonic() - started
        large = len(self._records) > THROTTLE_ABOVE_RECORDS
        self._next_rewrite = started + took * (1 + REWRITE_PAUSE_FACTOR) if large else 0.0

    def _write_incidents(self) -> None:
        document = {
            "version": INCIDENTS_VERSION,
            "rank": self.rank,
            "incidents": self._earlier_incidents + self._incidents,
        }
        atomic_write_text(self.incidents_path, json.dumps(document, indent=1))
        batches = [
            {"incident": incident.get("id"), "step": incident.get("onset_step"), **entry}
            for incident in document["incidents"]
            for entry in incident.get("batch_ids", [])
        ]
        if batches or os.path.exists(self.skip_path):
            skip = {"version": INCIDENTS_VERSION, "rank": self.rank, "batches": batches}
            atomic_write_text(self.skip_path, json.dumps(skip, indent=1))


#: owner -> (the anomaly directory a live run of this process writes, its AnomalyDump)
_LIVE: dict[str, tuple[str, weakref.ref]] = {}


def _directory_of(owner: str, root: str, rank: int, dump: AnomalyDump) -> str:
    """``anomaly_detected/rank{R}``, or ``rank{R}-{n}`` where another monitor of this process
    writes there now (two monitors attached at once, say two trainer callbacks with different
    configs): each renamed the other's fresh files as an earlier run's and then overwrote them.
    anomaly-analyse reads both directories and ranks their records together."""
    for key, (_, kept) in list(_LIVE.items()):
        if kept() is None:  # dropped without close(): its directory is free
            del _LIVE[key]
    if owner in _LIVE:
        directory = _LIVE[owner][0]
        _LIVE[owner] = (directory, weakref.ref(dump))
        return directory
    base = os.path.join(root, "anomaly_detected", f"rank{rank}")
    taken = {directory for directory, _ in _LIVE.values()}
    directory, number = base, 1
    while directory in taken:
        number += 1
        directory = f"{base}-{number}"
    if directory != base:
        logger.warning(
            "trainmon: another monitor of this process writes the anomaly files of %s; this one's go to %s "
            "(anomaly-analyse reads both)",
            base,
            directory,
        )
    _LIVE[owner] = (directory, weakref.ref(dump))
    return directory


def _keep_earlier(path: str) -> None:
    """An anomaly file of an earlier run in the same output directory is kept beside the new one
    as ``<name>.earlier-<its time>`` (msprobe deletes it), with a warning; the readers, which
    look for the plain names, read the new run's."""
    if os.path.islink(path) or not os.path.isfile(path):  # a link is refused when written
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.lstat(path).st_mtime))
    kept, number = f"{path}{EARLIER_RUN}{stamp}", 1
    while os.path.lexists(kept):
        number += 1
        kept = f"{path}{EARLIER_RUN}{stamp}-{number}"
    os.replace(path, kept)
    logger.warning("trainmon: the anomaly file of an earlier run at %s is kept as %s", path, kept)


def _read_existing(path: str, kind: type) -> Any:
    """A JSON document of this run written before a restart, or an empty ``kind()``; a damaged
    file is kept aside as ``.unreadable``, not lost."""
    if not os.path.isfile(path):
        return kind()
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        if isinstance(document, kind):
            return document
    except (OSError, ValueError):
        pass
    os.replace(path, path + ".unreadable")
    logger.warning("trainmon: %s was unreadable; kept as %s.unreadable", path, path)
    return kind()
