"""A run's anomalies for the dashboard, in the order of ``trainmon anomaly-analyse`` (earliest first).

Reads ``anomaly_detected/<sub-directory>/anomaly.json`` like the analysis CLI, parses each record
with :func:`monitor.anomaly.ordering.parse_record` and sorts with its ``sort_key`` (the order that
module documents), then maps each record to its heatmap cell: data type (from the tag's task), row
and op. Malformed records and unreadable files are counted, never fatal."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from dashboards.plugin.cache import FileVersions
from monitor.anomaly.ordering import STAGE_NAMES, AnomalyRecord, parse_record, sort_key, stage_of
from monitor.datatypes.tasks import RowKey, parse_tag
from monitor.writers.eventfile import open_regular

INPUT_NAME = "anomaly.json"
#: anomaly files larger than this are not read (they would stall the server).
MAX_FILE_BYTES = 512 << 20


#: (rank, chunk) -> class name of the chunk's root module, where the run-info file names it
RootClasses = Mapping[tuple[int, int], str]


def record_json(record: AnomalyRecord, prefix: str, row: RowKey, roots: RootClasses | None = None) -> dict:
    """A record and its heatmap cell as JSON-ready values (non-finite floats are left to the JSON
    encoder); the one shape of a record in /anomalies and /incidents. ``label`` names the row as
    the heatmap does: a root module's activation rows (``.input``) with its class in front."""
    r = record
    root_class = (roots or {}).get((r.rank, row.vpp_stage), "")
    return {
        "rank": r.rank,
        "step": r.step,
        "micro_step": r.micro_step,
        "stage": STAGE_NAMES[stage_of(r)],
        "prefix": prefix,
        "op": r.op,
        "tag": r.tag_name,
        "row": [row.vpp_stage, row.name, row.micro_step],
        "label": row.label(row.vpp_stage != 0, root_class),
        "value": r.value,
        "baseline": r.baseline,
        "rule": r.rule,
        "message": r.message,
    }


@dataclass
class AnomalyItem:
    """One anomaly with its heatmap cell; ``index`` is its place in the ordered list."""

    index: int
    record: AnomalyRecord
    prefix: str
    row: RowKey

    @classmethod
    def of(cls, index: int, record: AnomalyRecord) -> AnomalyItem:
        """The item of a record, its cell taken from the tag (data type from the task, row)."""
        parsed = parse_tag(record.tag_name)
        if parsed is None:
            return cls(index, record, "", RowKey(0, record.tag_name, -1))
        return cls(index, record, parsed.prefix, parsed.row)

    def matches(self, rank: int, prefix: str, rule: str) -> bool:
        """The list filters: a rank (-1: any), a data type and a rule ("": any)."""
        r = self.record
        return (rank < 0 or r.rank == rank) and prefix in ("", self.prefix) and rule in ("", r.rule)

    def to_json(self, roots: RootClasses | None = None) -> dict:
        return {"index": self.index, **record_json(self.record, self.prefix, self.row, roots)}


def counts(items: list[AnomalyItem]) -> dict[str, list]:
    """``[value, records]`` per rank, data type and rule, sorted: the choices of the list filters."""
    found: dict[str, dict] = {"rank": {}, "prefix": {}, "rule": {}}
    for item in items:
        for name, value in (("rank", item.record.rank), ("prefix", item.prefix), ("rule", item.record.rule)):
            if value is not None:
                found[name][value] = found[name].get(value, 0) + 1
    return {name: sorted(table.items()) for name, table in found.items()}


@dataclass
class AnomalyList:
    """The ordered anomalies of a run and what could not be read."""

    items: list[AnomalyItem]
    skipped_records: int = 0
    skipped_files: int = 0


def anomaly_files(anomaly_dir: str, name: str = INPUT_NAME) -> list[str]:
    """``anomaly_dir/<sub-directory>/<name>`` (no symlinks at either level), sorted."""
    found = []
    try:
        entries = list(os.scandir(anomaly_dir))
    except OSError:
        return []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            path = os.path.join(entry.path, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(path)
    return sorted(found)


def load_json(path: str) -> object:
    """The JSON document of a regular file of at most MAX_FILE_BYTES; raises OSError/ValueError."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return json.loads(handle.read().decode("utf-8"))
    finally:
        os.close(fd)


def _read(path: str) -> tuple[list[AnomalyRecord], int]:
    """The valid records of one file and the number of invalid ones; raises OSError/ValueError."""
    document = load_json(path)
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not a JSON object")
    records, bad = [], 0
    for value in document.values():
        record = parse_record(value)
        if record is None:
            bad += 1
        else:
            records.append(record)
    return records, bad


class AnomalyReader:
    """Anomaly lists per anomaly directory, re-read only when a file changes (size or mtime)."""

    def __init__(self) -> None:
        self._files: FileVersions[tuple[list[AnomalyRecord], int]] = FileVersions()
        self._lists: dict[str, tuple[tuple, AnomalyList]] = {}
        self._lock = threading.Lock()

    def read(self, anomaly_dir: str | None) -> AnomalyList:
        """The ordered anomalies of ``anomaly_dir`` (an empty list for None)."""
        if anomaly_dir is None:
            return AnomalyList([])
        with self._lock:
            signature, parts, skipped_files = self._files.read(anomaly_files(anomaly_dir), _read)
            known = self._lists.get(anomaly_dir)
            if known is not None and known[0] == signature:
                return known[1]
            records = sorted((r for recs, _ in parts for r in recs), key=sort_key)
            items = [AnomalyItem.of(index, record) for index, record in enumerate(records)]
            result = AnomalyList(items, sum(bad for _, bad in parts), skipped_files)
            self._lists[anomaly_dir] = (signature, result)
            return result
