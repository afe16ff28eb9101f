"""A run's incidents for the dashboard: every rank's incidents.json, merged, earliest first.

The monitor writes ``anomaly_detected/rank{R}/incidents.json`` while training; the incidents of
all ranks are merged exactly as ``trainmon anomaly-analyse`` merges them
(:func:`monitor.anomaly.incident_files.merge`), so the tab and the CLI name the same incidents,
roots and evidence. Here the files are found without following links, read with a size limit and
cached until they change; incidents and records of the wrong shape are dropped and counted, so one
bad file or record never hides the others. Each record is mapped to its heatmap cell like the
anomaly list's (:class:`~dashboards.plugin.anomalies.AnomalyItem`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from dashboards.plugin.anomalies import AnomalyItem, RootClasses, anomaly_files, load_json
from dashboards.plugin.cache import FileVersions
from monitor.anomaly.incident_files import INCIDENTS_NAME, MergedIncident, merge
from monitor.anomaly.ordering import parse_record, sort_key

STATES = ("open", "closed")


@dataclass
class RankIncidents:
    """The well-formed incidents of one file and how many incidents and records were dropped."""

    incidents: list[dict[str, Any]]
    skipped_incidents: int = 0
    skipped_records: int = 0


@dataclass
class Incident:
    """One merged incident: ``number`` is its place in the run's list (1 = earliest), ``items``
    its records in analysis order, ``root`` its root record (None when unreadable) and
    ``root_index`` the root's place in ``items`` (None when it is not among them)."""

    number: int
    merged: MergedIncident
    items: list[AnomalyItem]
    root: AnomalyItem | None
    root_index: int | None

    def matches(self, rank: int, step_min: int | None, step_max: int | None) -> bool:
        """Abnormal at a step of [step_min, step_max] (None: open end; begun there or still
        abnormal there, as ``anomaly-analyse -s`` selects) and, for rank >= 0, that rank involved."""
        return (rank < 0 or rank in self.merged.ranks) and self.merged.abnormal_within(step_min, step_max)

    def to_json(self, items: list[AnomalyItem], roots: RootClasses | None = None) -> dict[str, Any]:
        """The incident as ``merge`` describes it, its root's cell, and ``items`` (chosen records);
        ``roots`` names the root modules' rows (``record_json``). The ids of every step's
        micro-batches (``step_batch_ids``, up to 1,000 steps a rank) stay in the files, which the
        page does not show: they would make every answer as large as all of them."""
        body = self.merged.to_json(self.number)
        del body["step_batch_ids"]
        body["root"] = self.root.to_json(roots) if self.root is not None else None
        body["root_index"] = self.root_index
        body["items"] = [item.to_json(roots) for item in items]
        return body


@dataclass
class IncidentList:
    """The merged incidents of a run, the number of incident files, and what could not be read."""

    incidents: list[Incident] = field(default_factory=list)
    files: int = 0
    skipped_files: int = 0
    skipped_incidents: int = 0
    skipped_records: int = 0


def _well_formed(incident: Any) -> tuple[dict[str, Any] | None, int]:
    """The incident with only its readable records (and how many were dropped), or None when a
    field the merge relies on has the wrong type."""
    if not isinstance(incident, dict) or not isinstance(incident.get("records"), list):
        return None, 0
    checks = (
        all(type(incident.get(key)) is int for key in ("id", "rank", "onset_step")),
        incident.get("state") in STATES,
        type(incident.get("tensors", 0)) is int,
        type(incident.get("last_abnormal_step", 0)) is int,
        isinstance(incident.get("root", {}), dict),
        isinstance(incident.get("evidence", []), list),
    )
    if not all(checks):
        return None, 0
    records = [r for r in incident["records"] if _readable(r)]
    evidence = [str(line) for line in incident.get("evidence", [])]
    return {**incident, "records": records, "evidence": evidence}, len(incident["records"]) - len(records)


def _readable(record: Any) -> bool:
    """A record the list can show and the root choice can order (micro-step, call id: integers)."""
    return parse_record(record) is not None and all(
        type(record.get(key, 0)) is int for key in ("micro_step", "call_id")
    )


def _read(path: str) -> RankIncidents:
    """One rank's incidents file; raises OSError/ValueError when it is unreadable as a whole."""
    document = load_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("incidents"), list):
        raise ValueError(f"{path}: no 'incidents' list")
    result = RankIncidents([])
    for value in document["incidents"]:
        incident, dropped = _well_formed(value)
        if incident is None:
            result.skipped_incidents += 1
        else:
            result.incidents.append(incident)
            result.skipped_records += dropped
    return result


def _incident(number: int, merged: MergedIncident) -> Incident:
    """A merged incident with its records parsed, ordered and mapped to cells."""
    raw = sorted(
        ((parse_record(r), r) for m in merged.members for r in m["records"]), key=lambda p: sort_key(p[0])
    )
    items = [AnomalyItem.of(index, record) for index, (record, _) in enumerate(raw)]
    root_index = next((i for i, (_, r) in enumerate(raw) if r is merged.root), None)
    if root_index is not None:
        return Incident(number, merged, items, items[root_index], root_index)
    record = parse_record(merged.root) if merged.root else None
    return Incident(number, merged, items, AnomalyItem.of(-1, record) if record else None, None)


class IncidentReader:
    """Merged incidents per anomaly directory, re-read only when a file changes."""

    def __init__(self) -> None:
        self._files: FileVersions[RankIncidents] = FileVersions()
        self._lists: dict[str, tuple[tuple, IncidentList]] = {}
        self._lock = threading.Lock()

    def read(self, anomaly_dir: str | None) -> IncidentList:
        """The incidents of ``anomaly_dir``, earliest first (empty, with ``files == 0``, for None
        or a directory without incidents files: a run of msprobe's own monitor)."""
        if anomaly_dir is None:
            return IncidentList()
        with self._lock:
            paths = anomaly_files(anomaly_dir, INCIDENTS_NAME)
            signature, parts, skipped_files = self._files.read(paths, _read)
            known = self._lists.get(anomaly_dir)
            if known is not None and known[0] == signature:
                return known[1]
            merged = merge([incident for part in parts for incident in part.incidents])
            result = IncidentList(
                [_incident(number, item) for number, item in enumerate(merged, 1)],
                files=len(paths),
                skipped_files=skipped_files,
                skipped_incidents=sum(part.skipped_incidents for part in parts),
                skipped_records=sum(part.skipped_records for part in parts),
            )
            self._lists[anomaly_dir] = (signature, result)
            return result


def select(
    incidents: list[Incident],
    rank: int = -1,
    prefix: str = "",
    rule: str = "",
    step_min: int | None = None,
    step_max: int | None = None,
) -> list[tuple[Incident, list[AnomalyItem]]]:
    """The incidents the list's filters keep, each with its records that match them.

    An incident is kept when it was abnormal in the step range, it involves ``rank`` (-1: any) and,
    with a data type or rule chosen, one of its records on that rank has them; its records are
    those of that rank, data type and rule.
    """
    chosen = []
    for incident in incidents:
        if not incident.matches(rank, step_min, step_max):
            continue
        items = [item for item in incident.items if item.matches(rank, prefix, rule)]
        if items or not (prefix or rule):
            chosen.append((incident, items))
    return chosen
