"""What the plugin knows about the logdir: runs, their sources, anomalies and incidents, one cache.

Everything is read lazily and kept: discovery is repeated at most every DISCOVERY_SECONDS, each
rank directory keeps its Source (and so its row order and file indexes) for the server's life,
parsed chunks share one byte-bounded cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from dashboards.plugin.anomalies import AnomalyItem, AnomalyList, AnomalyReader
from dashboards.plugin.cache import ByteLRU, cache_bytes_from_env
from dashboards.plugin.discovery import Run, discover
from dashboards.plugin.eventsource import EventSource
from dashboards.plugin.incidents import Incident, IncidentList, IncidentReader
from dashboards.plugin.parquetsource import ParquetSource
from dashboards.plugin.sources import CsvSource, PrefixInfo, Source
from monitor.anomaly.rank_csv import has_csv_files
from monitor.datatypes.tasks import OP_ORDER, PREFIX_ORDER, order_key

DISCOVERY_SECONDS = 2.0


def open_source(path: str, cache: ByteLRU) -> Source | None:
    """A CsvSource when the directory has monitor CSV files, else a ParquetSource when it has live
    Parquet files, else an EventSource when it has event files, else None."""
    try:
        if has_csv_files(path):
            return CsvSource(path, cache)
        if ParquetSource.holds(path):
            return ParquetSource(path, cache)
        if EventSource.event_files(path):
            return EventSource(path, cache)
    except OSError:
        return None
    return None


def preferred_op(ops: Sequence[str]) -> str:
    """``norm`` when there is one, else the first op in OP_ORDER, else the first op."""
    return min(ops, key=lambda op: order_key(op, OP_ORDER)) if ops else ""


class RunStore:
    """Runs under ``logdir`` and their data, for the plugin's routes."""

    def __init__(self, logdir: str, cache_bytes: int | None = None) -> None:
        self.logdir = logdir
        self.cache = ByteLRU(cache_bytes or cache_bytes_from_env(), lambda block: block.nbytes)
        self.anomaly_reader = AnomalyReader()
        self.incident_reader = IncidentReader()
        self._runs: list[Run] = []
        self._found_at = float("-inf")
        self._sources: dict[str, Source | None] = {}
        self._lock = threading.Lock()

    def runs(self) -> list[Run]:
        """The runs (discovery at most every DISCOVERY_SECONDS)."""
        with self._lock:
            now = time.monotonic()
            if now - self._found_at >= DISCOVERY_SECONDS:
                self._runs = discover(self.logdir) if self.logdir else []
                self._found_at = now
            return self._runs

    def run(self, run_id: str) -> Run | None:
        """The run with this id, or None (ids are only compared, never used as paths)."""
        return next((run for run in self.runs() if run.id == run_id), None)

    def sources(self, run: Run) -> dict[int, Source]:
        """rank -> Source of the run's rank directories that hold data (refreshed)."""
        found = {}
        for rank, path in run.rank_dirs.items():
            with self._lock:
                if self._sources.get(path) is None:
                    self._sources[path] = open_source(path, self.cache)
                source = self._sources[path]
            if source is not None:
                source.refresh()
                found[rank] = source
        return found

    def anomalies(self, run: Run) -> AnomalyList:
        return self.anomaly_reader.read(run.anomaly_dir)

    def incidents(self, run: Run) -> IncidentList:
        return self.incident_reader.read(run.anomaly_dir)

    def prefixes(self, sources: dict[int, Source]) -> dict[str, dict]:
        """Data type -> {ops, first_step, last_step, ranks}, over all ranks, in display order."""
        merged: dict[str, dict] = {}
        for rank, source in sorted(sources.items()):
            info: PrefixInfo
            for prefix, info in source.prefixes().items():
                entry = merged.setdefault(
                    prefix,
                    {"ops": [], "first_step": info.first_step, "last_step": info.last_step, "ranks": []},
                )
                entry["ops"].extend(op for op in info.ops if op not in entry["ops"])
                entry["first_step"] = min(entry["first_step"], info.first_step)
                entry["last_step"] = max(entry["last_step"], info.last_step)
                entry["ranks"].append(rank)
        for entry in merged.values():
            entry["ops"].sort(key=lambda op: order_key(op, OP_ORDER))
        return {p: merged[p] for p in sorted(merged, key=lambda p: order_key(p, PREFIX_ORDER))}

    def summary(self, run: Run) -> dict:
        """What /runs says about one run, including the landing view."""
        sources = self.sources(run)
        prefixes = self.prefixes(sources)
        anomalies, incidents = self.anomalies(run), self.incidents(run)
        kinds = sorted({source.kind for source in sources.values()})
        merged = [i.merged for i in incidents.incidents]
        news = (len(merged), sum(m.records for m in merged), sum(m.state == "open" for m in merged))
        version = repr(([(r, s.version()) for r, s in sorted(sources.items())], len(anomalies.items), news))
        return {
            "id": run.id,
            "name": run.name,
            "format": "+".join(kinds),
            "ranks": sorted(sources),
            "prefixes": prefixes,
            "anomalies": len(anomalies.items),
            # None: no incidents file (msprobe's own monitor), the tab then lists anomalies only
            "incidents": len(incidents.incidents) if incidents.files else None,
            "replaced": run.replaced,
            "newest": run.newest,
            "version": version,
            "landing": landing(prefixes, anomalies.items, incidents.incidents),
        }


def landing(
    prefixes: dict[str, dict], anomalies: Sequence[AnomalyItem], incidents: Sequence[Incident] = ()
) -> dict | None:
    """The first view: the root of the first incident that has a cell, else the first anomaly that
    has a cell, else the data type with the newest step.

    Ties on the newest step go to the earlier data type in PREFIX_ORDER; the op is ``norm`` when
    there is one; the rank is the lowest that has the data type.
    """
    for incident in incidents:
        view = _cell_view(prefixes, incident.root)
        if view is not None:
            return {**view, "anomaly": None, "incident": incident.number}
    for item in anomalies:
        view = _cell_view(prefixes, item)
        if view is not None:
            return {**view, "anomaly": item.index, "incident": None}
    if not prefixes:
        return None
    prefix = min(prefixes, key=lambda p: (-prefixes[p]["last_step"], order_key(p, PREFIX_ORDER)))
    entry = prefixes[prefix]
    return {
        "prefix": prefix,
        "op": preferred_op(entry["ops"]),
        "rank": min(entry["ranks"]),
        "anomaly": None,
        "incident": None,
    }


def _cell_view(prefixes: dict[str, dict], item: AnomalyItem | None) -> dict | None:
    """The heatmap (data type, op, rank) that shows a record's cell, or None when there is none."""
    entry = prefixes.get(item.prefix) if item is not None else None
    if entry is None or item.record.rank not in entry["ranks"]:
        return None
    op = item.record.op if item.record.op in entry["ops"] else preferred_op(entry["ops"])
    return {"prefix": item.prefix, "op": op, "rank": item.record.rank}
