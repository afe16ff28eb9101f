"""Finding the monitor's runs under TensorBoard's logdir, without following links out of it.

A *root* is a directory that holds per-rank directories ``{time}-rank{R}-{id8}`` (and usually
``anomaly_detected/``): a ``MONITOR_OUTPUT_DIR``. A *run* is one job's rank directories in a root:
when a root holds several jobs (the same rank appears again), its directories are split into
runs in time order, each new run starting at the first repeated rank. The anomaly files of a root
belong to its newest run (each job replaces them).

Only directories are walked (never symbolic links), to a bounded depth and number of entries, so
a huge or hostile logdir cannot make a request slow or leave the logdir.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field

from monitor.anomaly.anomaly_files import INPUT_NAME, earlier_runs_files
from monitor.files import RANK_DIR_PATTERN, parse_time_tag

ANOMALY_DIR = "anomaly_detected"
#: directory levels below the logdir that are searched for roots (logdir/a/b/rankdir: 2).
MAX_DEPTH = 4
#: directory entries looked at in one discovery, at most.
MAX_ENTRIES = 200_000


@dataclass
class Run:
    """One job's outputs.

    Attributes:
        id: a stable identifier (relative root and first rank directory name); only ever compared,
            never used as a path.
        name: what the user sees: the root relative to the logdir, with the start time when the
            root holds several runs.
        root: absolute path of the root.
        rank_dirs: rank -> absolute path of its directory.
        anomaly_dir: ``root/anomaly_detected`` for the newest run of a root that has one, else None.
        replaced: an older run of a root whose anomaly files a newer run replaced (the monitor
            kept them beside as ``anomaly.json.earlier-<time>``; the tab says so).
        newest: the newest run of its root (the tab opens on one where no run has anomalies).
    """

    id: str
    name: str
    root: str
    rank_dirs: dict[int, str] = field(default_factory=dict)
    anomaly_dir: str | None = None
    replaced: bool = False
    newest: bool = True


def _kept_earlier(anomaly_dir: str) -> bool:
    """Whether a run began after another in this output directory had written anomaly files
    (the monitor kept them beside its own, in a rank's folder)."""
    try:
        folders = [e.path for e in os.scandir(anomaly_dir) if e.is_dir(follow_symlinks=False)]
        return bool(earlier_runs_files([os.path.join(folder, INPUT_NAME) for folder in folders]))
    except OSError:
        return False


def _walk(logdir: str) -> dict[str, list[os.DirEntry]]:
    """Root path -> its rank directory entries."""
    roots: dict[str, list[os.DirEntry]] = {}
    pending = [(logdir, 0)]
    seen = 0
    while pending and seen < MAX_ENTRIES:
        path, depth = pending.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        seen += len(entries)
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            if RANK_DIR_PATTERN.match(entry.name):
                roots.setdefault(path, []).append(entry)
            elif entry.name != ANOMALY_DIR and depth < MAX_DEPTH:
                pending.append((entry.path, depth + 1))
    return roots


def _order_key(entry: os.DirEntry) -> tuple:
    match = RANK_DIR_PATTERN.match(entry.name)
    stamp = parse_time_tag(match.group(1)) if match else None
    try:
        mtime = entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        mtime = 0.0
    return (stamp or _dt.datetime.min, mtime, entry.name)


def _split_jobs(entries: list[os.DirEntry]) -> list[dict[int, os.DirEntry]]:
    jobs: list[dict[int, os.DirEntry]] = []
    for entry in sorted(entries, key=_order_key):
        rank = int(RANK_DIR_PATTERN.match(entry.name).group(2))
        if not jobs or rank in jobs[-1]:
            jobs.append({})
        jobs[-1][rank] = entry
    return jobs


def discover(logdir: str) -> list[Run]:
    """Every run under ``logdir``, sorted by name."""
    logdir = os.path.abspath(logdir)
    runs = []
    for root, entries in _walk(logdir).items():
        relative = os.path.relpath(root, logdir)
        label = os.path.basename(logdir) if relative == "." else relative
        jobs = _split_jobs(entries)
        anomaly_dir = os.path.join(root, ANOMALY_DIR)
        has_anomalies = os.path.isdir(anomaly_dir) and not os.path.islink(anomaly_dir)
        kept_earlier = has_anomalies and len(jobs) > 1 and _kept_earlier(anomaly_dir)
        for number, job in enumerate(jobs):
            # named by its lowest rank's directory: the order of ranks started within one second
            # falls back to modification times, which change as each rank writes
            first = job[min(job)].name
            name = label if len(jobs) == 1 else f"{label} @ {RANK_DIR_PATTERN.match(first).group(1)}"
            runs.append(
                Run(
                    id=f"{relative}#{first}",
                    name=name,
                    root=root,
                    rank_dirs={rank: entry.path for rank, entry in sorted(job.items())},
                    anomaly_dir=anomaly_dir if has_anomalies and number == len(jobs) - 1 else None,
                    replaced=kept_earlier and number < len(jobs) - 1,
                    newest=number == len(jobs) - 1,
                )
            )
    return sorted(runs, key=lambda run: (run.name, run.id))
