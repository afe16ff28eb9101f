"""Incidents of all ranks, merged: what broke first, where, and on which rank (anomaly-analyse).

Reads ``DIR/<sub-directory>/incidents.json`` (one per rank, written while training) and merges
the incidents that start together on several ranks: a fault on one rank reaches every rank
through the gradient reduction within the same step, so per-rank incidents whose onsets are at
most ``MERGE_WINDOW`` steps apart (and on different ranks) are one incident. The merged root is
chosen again (:mod:`monitor.anomaly.root`) from the records of the merged onset step, of every
rank that was abnormal then (a rank abnormal only a step later is not where it began), which is
where the rank evidence comes from: the ranks that show the earliest phase while their peers do
not. A file that cannot be read is skipped with a warning, never fatal.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from monitor.anomaly.root import choose_root, describe_root, phase_of

INCIDENTS_NAME = "incidents.json"
OUTPUT_NAME = "incidents_analyse.json"
#: integer fields of an incident that older files may lack.
OPTIONAL_COUNTS = ("tensors", "last_abnormal_step", "more_records")
#: per-rank incidents whose onsets are this many steps apart or less are one incident.
MERGE_WINDOW = 1


@dataclass
class MergedIncident:
    """One incident over every rank that saw it."""

    onset_step: int
    members: list[dict[str, Any]] = field(default_factory=list)
    root: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({int(m["rank"]) for m in self.members})

    @property
    def state(self) -> str:
        return "open" if any(m.get("state") == "open" for m in self.members) else "closed"

    @property
    def records(self) -> int:
        return sum(len(m.get("records", [])) + int(m.get("more_records", 0)) for m in self.members)

    @property
    def tensors(self) -> int:
        return sum(int(m.get("tensors", 0)) for m in self.members)

    @property
    def last_abnormal_step(self) -> int:
        return max(int(m.get("last_abnormal_step", self.onset_step)) for m in self.members)

    @property
    def world_size(self) -> int | None:
        """The run's number of ranks as its members recorded it; None where none did (older files)."""
        sizes = [m["world_size"] for m in self.members if type(m.get("world_size")) is int]
        return max(sizes, default=None)

    def abnormal_at(self, steps: frozenset[int]) -> bool:
        """Whether it began at one of ``steps`` or was still abnormal there."""
        return any(self.abnormal_within(step, step) for step in steps)

    def abnormal_within(self, first: int | None, last: int | None) -> bool:
        """Whether it was abnormal at some step of ``[first, last]`` (None: an open end): begun
        there, or begun before and still abnormal there."""
        return (last is None or self.onset_step <= last) and (
            first is None or self.last_abnormal_step >= first
        )

    @property
    def onset_rank(self) -> int:
        """The rank where it began: the root's, else the lowest abnormal at the onset step."""
        rank = self.root.get("rank") if isinstance(self.root, dict) else None
        if type(rank) is int:
            return rank
        return min(int(m["rank"]) for m in self.members if m["onset_step"] == self.onset_step)

    @property
    def onset_micro_step(self) -> int:
        """The micro-step where it began: the earliest of the onset step's records in the root's
        phase, as for one rank's incident (each rank's own onset where no records are left)."""
        onset = [m for m in self.members if m["onset_step"] == self.onset_step]
        records = [r for m in onset for r in m["records"] if r.get("step") == self.onset_step]
        if records and isinstance(self.root, dict) and "tag_name" in self.root:
            phase = phase_of(self.root)
            return min((r.get("micro_step", 0) for r in records if phase_of(r) == phase), default=0)
        firsts = [m.get("onset_micro_step", 0) for m in onset]
        return min((m for m in firsts if type(m) is int), default=0)

    @property
    def data_types(self) -> dict[str, int]:
        """Records per data type (CSV prefix), over every rank."""
        totals: dict[str, int] = {}
        for member in self.members:
            counts = member.get("data_types")
            for task, count in counts.items() if isinstance(counts, dict) else ():
                if isinstance(task, str) and type(count) is int:
                    totals[task] = totals.get(task, 0) + count
        return dict(sorted(totals.items()))

    def to_json(self, number: int) -> dict[str, Any]:
        return {
            "id": number,
            "onset_step": self.onset_step,
            "onset_micro_step": self.onset_micro_step,
            "onset_rank": self.onset_rank,
            "ranks": self.ranks,
            "world_size": self.world_size,
            "state": self.state,
            "last_abnormal_step": self.last_abnormal_step,
            "tensors": self.tensors,
            "data_types": self.data_types,
            "records": self.records,
            "root": self.root,
            "evidence": self.evidence,
            "members": [{"rank": m["rank"], "id": m["id"]} for m in self.members],
            "batch_ids": self.batch_ids,
            "step_batch_ids": self.step_batch_ids,
        }

    @property
    def batch_ids(self) -> list[dict[str, Any]]:
        """The micro-batches where it began, on every rank: ``{"rank", "step", "micro_step", "ids"}``."""
        return [
            {"rank": m["rank"], "step": m["onset_step"], **entry}
            for m in self.members
            for entry in m.get("batch_ids", [])
            if isinstance(entry, dict)
        ]

    @property
    def step_batch_ids(self) -> list[dict[str, Any]]:
        """Every micro-batch of each step at which records joined, on every rank:
        ``{"rank", "step", "ids"}`` (``ids``: one entry per micro-batch), to look up any record's."""
        entries = []
        for m in self.members:
            by_step = m.get("step_batch_ids")
            if isinstance(by_step, dict):  # keys are step numbers as written by the monitor
                keys = [key for key in by_step if isinstance(key, str) and key.isascii() and key.isdigit()]
                for key in sorted(keys, key=int):
                    entries.append({"rank": m["rank"], "step": int(key), "ids": by_step[key]})
        return entries


def load_incidents(paths: list[str]) -> list[dict[str, Any]]:
    """Every well-formed per-rank incident of the files; unreadable files are skipped with a warning."""
    incidents = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                document = json.load(handle)
            items = document["incidents"]
            if not isinstance(items, list):
                raise TypeError("'incidents' is not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"anomaly-analyse: warning: skipping {path}: {exc}", file=sys.stderr)
            continue
        incidents += [i for i in items if _well_formed(i)]
    return incidents


def _well_formed(incident: Any) -> bool:
    """Whether an incident has every field the merge reads, of the type it reads."""
    return (
        isinstance(incident, dict)
        and all(type(incident.get(key)) is int for key in ("id", "rank", "onset_step"))
        and all(type(incident.get(key, 0)) is int for key in OPTIONAL_COUNTS)
        and isinstance(incident.get("records"), list)
        and all(_well_formed_record(r) for r in incident["records"])
    )


def _well_formed_record(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and type(record.get("tag_name")) is str
        and all(type(record.get(key)) is int for key in ("rank", "step"))
        and all(type(record.get(key, 0)) is int for key in ("micro_step", "call_id"))
    )


def merge(incidents: list[dict[str, Any]], window: int = MERGE_WINDOW) -> list[MergedIncident]:
    """Per-rank incidents merged across ranks, first first, each with its root chosen over all ranks."""
    merged: list[MergedIncident] = []
    for incident in sorted(incidents, key=lambda i: (i["onset_step"], i["rank"], i["id"])):
        current = merged[-1] if merged else None
        if (
            current is not None
            and incident["onset_step"] - current.onset_step <= window
            and incident["rank"] not in current.ranks
        ):
            current.members.append(incident)
        else:
            merged.append(MergedIncident(onset_step=incident["onset_step"], members=[incident]))
    for item in merged:
        first = [
            r
            for m in item.members
            if m["onset_step"] == item.onset_step
            for r in m["records"]
            if r.get("step") == item.onset_step
        ]
        if first:
            local = all(m.get("local_gradients_recorded", True) is not False for m in item.members)
            item.root, item.evidence = choose_root(first, item.world_size, local)
        else:  # records trimmed away: keep the first member's own verdict
            item.root, item.evidence = (
                item.members[0].get("root", {}),
                list(item.members[0].get("evidence", [])),
            )
    return merged


def format_incidents(incidents: list[MergedIncident]) -> str:
    """An aligned table of merged incidents with their evidence below each."""
    header = ("#", "onset", "micro-step", "ranks", "state", "series", "records", "root")
    rows = [
        (
            str(number),
            str(item.onset_step),
            str(item.onset_micro_step),
            ",".join(map(str, item.ranks)),
            item.state,
            str(item.tensors),
            str(item.records),
            describe_root(item.root).removeprefix("root ") if item.root else "-",
        )
        for number, item in enumerate(incidents, 1)
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    for row, item in zip(rows, incidents, strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        lines += [f"{' ' * (widths[0] + 2)}- {line}" for line in item.evidence]
        lines += [f"{' ' * (widths[0] + 2)}- {_batch_line(entry)}" for entry in item.batch_ids]
    return "\n".join(lines)


def _batch_line(entry: dict[str, Any]) -> str:
    """``batch ids (rank R, step S, micro-batch m): [...]``, the ids cut to 100 characters."""
    ids = json.dumps(entry.get("ids"))
    ids = ids if len(ids) <= 100 else ids[:97] + "..."
    where = f"rank {entry.get('rank')}, step {entry.get('step')}, micro-batch {entry.get('micro_step')}"
    return f"batch ids ({where}): {ids}"
