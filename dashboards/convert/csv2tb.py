"""``trainmon csv2tb`` and msprobe's ``csv2tensorboard_by_step``: CSV outputs -> TensorBoard.

Runs written with ``format: parquet`` convert alike (their live Parquet files are read instead).

Same call and output as msprobe's converter: ``{out}/rank{R}/{data_type}/`` holds one event
file per rank and data type, scalar tags ``vp{vpp_stage}:{name}[:micro{m}]/{op}``, written in step
order; ``out`` defaults to ``{monitor_path}/{time}-csv2tensorboard_by_step``. Each output directory
also gets a Custom Scalars layout (per op, one chart per layer group).

Differences, all fixes of msprobe's converter: every directory of a rank in the time range is read (in
time order) instead of the last one listed; a row written twice for a step keeps the later value
(counted and reported) instead of abandoning the remaining files or crashing the worker; rows that
do not parse are skipped and reported; writers are closed; the default output name uses host-local
time; the ``other`` data type (mg_direction) converts too; work is split per (rank, data type)
over the processes, so ranks of uneven size balance.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from dashboards.convert.progress import run_jobs
from dashboards.convert.runs import job_label, read_series, select_jobs
from monitor.files import TIME_FORMAT, make_private_dir
from monitor.writers.custom_scalars import group_charts, layer_groups, write_layout
from monitor.writers.tensorboard import TensorBoardWriter

logger = logging.getLogger("trainmon")

OUTPUT_SUFFIX = "-csv2tensorboard_by_step"
_EVENT_PREFIX = "events.out.tfevents."


def series_names(series: Iterable[Any]) -> list[str]:
    """``vp{vpp}:{name}`` plus ``:micro{m}`` for rows with a micro-step (msprobe's names)."""
    return [
        f"vp{k.vpp_stage}:{k.name}" + (f":micro{k.micro_step}" if k.micro_step >= 0 else "")
        for k in series.rows
    ]


def _clear(target: str) -> None:
    """Remove event files of an earlier conversion in ``target`` (nothing else is touched)."""
    old = [e.path for e in os.scandir(target) if e.name.startswith(_EVENT_PREFIX) and not e.is_dir()]
    if old:
        logger.warning(
            "trainmon csv2tb: replacing %d event file(s) of an earlier conversion in %s", len(old), target
        )
        for path in old:
            os.unlink(path)


def convert_one(job: tuple[int, list[str], str, str]) -> dict:
    """Convert one rank's data type: ``(rank, its directories, data type, output root)``."""
    rank, dirs, prefix, out = job
    series = read_series(dirs, prefix)
    if series is None:
        return {"values": 0, "steps": 0, "duplicates": 0, "skipped": 0}
    target = os.path.join(out, f"rank{rank}", prefix)
    make_private_dir(target)
    _clear(target)
    names = series_names(series)
    tags = np.array([[f"{name}/{op}" for op in series.ops] for name in names], dtype=object)
    cuts = np.flatnonzero(np.diff(series.steps)) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(series.steps)]
    writer = TensorBoardWriter(target)
    written = 0
    try:
        for start, end in zip(starts.tolist(), ends.tolist()):
            ids = series.ids[start:end]
            present = series.present[start:end].ravel()
            step_tags = tags[ids].ravel()[present]
            writer.write_scalars(
                int(series.steps[start]), step_tags.tolist(), series.values[start:end].ravel()[present]
            )
            written += int(present.sum())
    finally:
        writer.close()
    groups = layer_groups((key.vpp_stage, key.name) for key in series.rows)
    write_layout(
        target,
        {
            f"{prefix} {op}": group_charts(groups, lambda vpp: f"vp{vpp}:", f"/{re.escape(op)}")
            for op in series.ops
        },
    )
    return {
        "values": written,
        "steps": len(starts),
        "duplicates": series.duplicates,
        "skipped": series.skipped,
    }


def csv2tensorboard_by_step(
    monitor_path: str,
    time_start: str | None = None,
    time_end: str | None = None,
    process_num: int = 1,
    data_type_list: list[str] | None = None,
    output_dirpath: str | None = None,
    *,
    progress: bool = True,
) -> str:
    """Convert the CSV outputs under ``monitor_path`` to TensorBoard event files.

    Args:
        monitor_path: the output root holding ``{time}-rank{R}-{id}`` directories.
        time_start, time_end: inclusive bounds on the directories' time tags (``Dec03_21-34-40``).
        process_num: worker processes (1 to 128).
        data_type_list: data types to convert (default: every one found).
        output_dirpath: output root (default ``{monitor_path}/{time}-csv2tensorboard_by_step``).
        progress: show a progress bar on stderr.

    Returns:
        The output root.

    Raises:
        ConvertError: a bad argument, or no rank directory in the time range.
    """
    selection = select_jobs(monitor_path, time_start, time_end, process_num, data_type_list)
    out = output_dirpath or os.path.join(
        monitor_path, _dt.datetime.now().astimezone().strftime(TIME_FORMAT) + OUTPUT_SUFFIX
    )
    jobs = [(*job, out) for job in selection.jobs]
    make_private_dir(out)
    for (rank, _, prefix, _), result in run_jobs(
        convert_one, jobs, selection.processes, "csv2tb", job_label, progress
    ):
        if result["duplicates"]:
            logger.warning(
                "trainmon csv2tb: rank%d/%s: %d rows written twice for a step; the later ones were kept "
                "(a restarted run, or several runs in one directory: --start/--end choose one)",
                rank,
                prefix,
                result["duplicates"],
            )
        if result["skipped"]:
            logger.warning(
                "trainmon csv2tb: rank%d/%s: skipped %d rows that did not parse",
                rank,
                prefix,
                result["skipped"],
            )
    return out
