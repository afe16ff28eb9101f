"""A run's anomalies for the dashboard, in the order of ``trainmon anomaly-analyse`` (first first).

Reads ``anomaly_detected/<sub-directory>/anomaly.json`` like the analysis CLI, parses each record
with :func:`monitor.anomaly.ordering.parse_record` and sorts with its ``sort_key`` (spec §9.5 with
the W22 fixes), then maps each record to its heatmap cell: data type (from the tag's task), row
and op. Malformed records and unreadable files are counted, never fatal.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

from monitor.anomaly.ordering import STAGE_NAMES, AnomalyRecord, parse_record, sort_key, stage_of
from monitor.datatypes import RowKey, parse_tag
from monitor.writers.eventfile import open_regular

INPUT_NAME = "anomaly.json"
#: anomaly files larger than this are not read (they would stall the server).
MAX_FILE_BYTES = 512 << 20


@dataclass
class AnomalyItem:
    """One anomaly with its heatmap cell; ``index`` is its place in the ordered list."""

    index: int
    record: AnomalyRecord
    prefix: str
    row: RowKey

    def to_json(self) -> dict:
        """The record as JSON-ready values (non-finite floats are left to the JSON encoder)."""
        r = self.record
        return {
            "index": self.index,
            "rank": r.rank,
            "step": r.step,
            "micro_step": r.micro_step,
            "stage": STAGE_NAMES[stage_of(r)],
            "prefix": self.prefix,
            "op": r.op,
            "tag": r.tag_name,
            "row": [self.row.vpp_stage, self.row.name, self.row.micro_step],
            "value": r.value,
            "baseline": r.baseline,
            "rule": r.rule,
            "message": r.message,
        }


@dataclass
class AnomalyList:
    """The ordered anomalies of a run and what could not be read."""

    items: list[AnomalyItem]
    skipped_records: int = 0
    skipped_files: int = 0


def anomaly_files(anomaly_dir: str) -> list[str]:
    """``anomaly_dir/<sub-directory>/anomaly.json`` (no symlinks at either level), sorted."""
    found = []
    try:
        entries = list(os.scandir(anomaly_dir))
    except OSError:
        return []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            path = os.path.join(entry.path, INPUT_NAME)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(path)
    return sorted(found)


def _read(path: str) -> tuple[list[AnomalyRecord], int]:
    """The valid records of one file and the number of invalid ones; raises OSError/ValueError."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            document = json.loads(handle.read().decode("utf-8"))
    finally:
        os.close(fd)
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
        self._files: dict[str, tuple[tuple, list[AnomalyRecord], int]] = {}
        self._lists: dict[str, tuple[tuple, AnomalyList]] = {}
        self._lock = threading.Lock()

    def read(self, anomaly_dir: str | None) -> AnomalyList:
        """The ordered anomalies of ``anomaly_dir`` (an empty list for None)."""
        if anomaly_dir is None:
            return AnomalyList([])
        with self._lock:
            signature, parts, skipped_files = [], [], 0
            for path in anomaly_files(anomaly_dir):
                try:
                    st = os.stat(path, follow_symlinks=False)
                    key = (st.st_size, st.st_mtime_ns, st.st_ino)
                    cached = self._files.get(path)
                    if cached is None or cached[0] != key:
                        records, bad = _read(path)
                        cached = self._files[path] = (key, records, bad)
                except (OSError, ValueError):
                    skipped_files += 1
                    continue
                signature.append((path, cached[0]))
                parts.append(cached)
            signature_key = tuple(signature)
            known = self._lists.get(anomaly_dir)
            if known is not None and known[0] == signature_key:
                return known[1]
            records = sorted((r for _, recs, _ in parts for r in recs), key=sort_key)
            items = []
            for record in records:
                parsed = parse_tag(record.tag_name)
                prefix, row = (parsed.prefix, parsed.row) if parsed else ("", RowKey(0, record.tag_name, -1))
                items.append(AnomalyItem(len(items), record, prefix, row))
            result = AnomalyList(items, sum(bad for _, _, bad in parts), skipped_files)
            self._lists[anomaly_dir] = (signature_key, result)
            return result
