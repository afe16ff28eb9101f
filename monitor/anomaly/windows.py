"""The cross-rank analysis one window of steps at a time, within a memory limit.

A data type's files on every rank are listed (rank_csv.list_parts) and its steps cut into windows
whose values, estimated from the largest file of a few ranks, fit the memory limit; a window is
aligned to the files' own step spans where it can be, so that each file is read once. Every
window is read from all ranks and compared (peers.first_pass) on its own, in worker processes
where the limit leaves room for more than one, and the per-row results of all windows are
judged together (peers.judge): that last pass keeps one small row per tensor, op and step, never
the ranks' values, so the memory a run needs grows with its tensors and steps, not its ranks.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from monitor.anomaly import peers, rank_csv
from monitor.anomaly.workers import map_in_workers, max_workers, total_size
from monitor.query import engine
from monitor.query.csv_files import read_complete_lines
from monitor.run_info import read_pipeline_stage
from monitor.writers.parquet_files import row_count

#: bytes a window holds per value it reads (file contents, arrays, blocks), measured with
#: benchmarks/cross_rank.py as the proportional set size of the processes together.
BYTES_PER_VALUE = 32
#: bytes of this process before it reads anything (interpreter, numpy, pandas, pyarrow).
MAIN_BYTES = 160 * 2**20
#: bytes of a forked worker process of its own before it reads (it shares the rest with this one).
WORKER_BYTES = 100 * 2**20
#: ranks whose largest file gives the estimate of the values per step.
SAMPLED_RANKS = 4
#: windows per worker at least, where the files allow: the last ones to finish wait less.
WINDOWS_PER_JOB = 4
#: values of a run below which it is read in this process (a pool costs more than it gains).
PARALLEL_VALUES = 1 << 22


@dataclass(frozen=True)
class Plan:
    """Windows of steps (first, last) and how many are compared at once."""

    windows: list[tuple[int, int]]
    jobs: int
    values_per_step: float


@dataclass(frozen=True)
class Task:
    """One window of one data type: every rank's files that hold some of its steps."""

    prefix: str
    window: tuple[int, int]
    ranks: int
    files: list[tuple[int, str, list[rank_csv.Part]]]  # (rank column, rank directory, its files)
    k_mad: float
    ops: tuple[str, ...] | None
    steps: frozenset[int] | None


def find_outliers(
    rank_dirs: dict[int, str],
    types: tuple[str, ...],
    k_mad: float,
    steps: frozenset[int] | None,
    ops: tuple[str, ...] | None,
    memory: int,
    warn: Callable[[str], None],
) -> peers.Outliers:
    """The cross-rank outliers of the given data types, reading at most about ``memory`` bytes at
    once; ``steps`` (None: all) are reported, but every step feeds the pooled MAD."""
    listed = {rank: rank_csv.list_parts(path, types) for rank, path in rank_dirs.items()}
    out = peers.Outliers(k_mad, ops, steps)
    stages = pipeline_stages(rank_dirs, warn)
    groups: list[tuple[str, int, dict[int, list[rank_csv.Part]]]] = []
    for prefix in types:  # each pipeline stage holds other layers under the same names: apart
        by_stage: dict[int, dict[int, list[rank_csv.Part]]] = {}
        for rank, parts in listed.items():
            if parts.get(prefix):
                by_stage.setdefault(stages[rank], {})[rank] = parts[prefix]
        groups += [(prefix, stage, by_stage[stage]) for stage in sorted(by_stage)]
    for prefix, stage, holders in groups:
        plan = plan_windows(holders, memory, max_workers(), warn)
        ranks = sorted(holders)
        tasks = [
            Task(
                prefix,
                window,
                len(ranks),
                [
                    (column, rank_dirs[rank], inside)
                    for column, rank in enumerate(ranks)
                    if (inside := [p for p in holders[rank] if p.start <= window[1] and p.end >= window[0]])
                ],
                k_mad,
                ops,
                steps,
            )
            for window in plan.windows
        ]
        if plan.jobs > 1 and any(p.parquet for parts in holders.values() for p in parts):
            import pyarrow.parquet  # noqa: F401  (once here, not in every worker)
        partials, told = [], set()
        for partial, warnings in map_in_workers(compare_window, tasks, plan.jobs):
            for text in warnings:
                if text not in told:  # a file read for several windows says it once
                    told.add(text)
                    warn(text)
            partials.append(partial)
        peers.judge(prefix, ranks, partials, out, stage)
    return out


def pipeline_stages(rank_dirs: dict[int, str], warn: Callable[[str], None]) -> dict[int, int]:
    """Each rank's pipeline stage from its run-info file; 0 where there is none (msprobe's runs,
    and ours of one stage), said where only some ranks have one."""
    found = {rank: read_pipeline_stage(path) for rank, path in rank_dirs.items()}
    missing = sorted(rank for rank, stage in found.items() if stage is None)
    if missing and len(missing) < len(found):
        warn(
            f"ranks {missing} have no readable trainmon_run.json: taken as pipeline stage 0, and "
            "compared with that stage's ranks"
        )
    return {rank: stage or 0 for rank, stage in found.items()}


def compare_window(task: Task) -> tuple[peers.Partial, list[str]]:
    """Read one window from every rank and compare it (in a worker process, or this one)."""
    if multiprocessing.parent_process() is not None:  # the other cores run the other workers
        engine.use_one_thread()
    warnings: list[str] = []
    tables = [
        (column, table)
        for column, rank_dir, parts in task.files
        for table in rank_csv.read_parts(rank_dir, task.prefix, parts, task.window, warnings)
    ]
    return peers.first_pass(tables, task.ranks, task.k_mad, task.ops, task.steps), warnings


def plan_windows(
    holders: dict[int, list[rank_csv.Part]], memory: int, cores: int, warn: Callable[[str], None]
) -> Plan:
    """Windows of steps for these ranks' files, each within its share of ``memory``."""
    per_step, span = _sample(holders)
    first = min(p.start for parts in holders.values() for p in parts)

    def steps_fitting(jobs: int) -> float:  # one job runs in this process, more in workers
        share = (memory - MAIN_BYTES - (jobs > 1) * jobs * WORKER_BYTES) / jobs
        return share / (BYTES_PER_VALUE * max(per_step, 1.0))

    last = max(p.end for parts in holders.values() for p in parts)
    jobs = max(1, cores) if per_step * (last - first + 1) > PARALLEL_VALUES else 1
    while jobs > 1 and steps_fitting(jobs) < span:
        jobs -= 1
    width = steps_fitting(jobs)
    if width < span:
        if width < 1:
            needed = (MAIN_BYTES + BYTES_PER_VALUE * per_step) / 2**20
            told = (
                f"is below what one step of this run needs (about {needed:.0f} MiB): "
                "reading one step at a time"
            )
        else:
            needed = (MAIN_BYTES + BYTES_PER_VALUE * per_step * span) / 2**20
            told = (
                f"holds {int(width)} of the {span} steps a file has: each file is read about "
                f"{-(-span // int(width))} times (about {needed:.0f} MiB would read each once)"
            )
        limit = f"{memory / 2**20:.0f} MiB" if memory >= 2**20 else f"{memory} bytes"
        warn(f"memory limit {limit} {told}")
    width = max(1, int(width) // span * span if width >= span else int(width))
    balanced = span * max(1, (last - first + 1) // (WINDOWS_PER_JOB * jobs * span))
    width = max(1, min(width, balanced))
    used = sorted(
        {
            index
            for parts in holders.values()
            for p in parts
            for index in range((p.start - first) // width, (p.end - first) // width + 1)
        }
    )
    windows = [(first + i * width, first + (i + 1) * width - 1) for i in used]
    return Plan(windows, min(jobs, len(windows)), per_step)


def _sample(holders: dict[int, list[rank_csv.Part]]) -> tuple[float, int]:
    """Values per step of all ranks together, and the step span of a typical file, from the
    largest file of a few ranks spread over the run."""
    ranks = sorted(holders)
    chosen = ranks[:: max(1, len(ranks) // SAMPLED_RANKS)][:SAMPLED_RANKS]
    rates, spans = [], []
    for rank in chosen:
        part = max(holders[rank], key=lambda p: total_size((p.path,)))
        steps = part.end - part.start + 1
        rates.append(_values(part) / steps)
        spans.append(steps)
    per_rank = float(np.mean(rates)) if rates else 0.0
    return per_rank * len(ranks), max(1, int(np.median(spans)))


def _values(part: rank_csv.Part) -> int:
    """The values a file holds (0 where it cannot be read)."""
    if part.parquet:
        return row_count(part.path) or 0
    try:
        data = read_complete_lines(part.path)
    except OSError:
        return 0
    end = data.find(b"\n")
    try:
        ops = rank_csv.header_columns(data[:end].decode("utf-8", "replace"))[1] if end > 0 else ()
    except ValueError:
        return 0
    return max(0, data.count(b"\n") - 1) * len(ops)
