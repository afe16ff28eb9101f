"""``trainmon_run.json`` in each rank directory: what ran, so that readers can explain the rows.

msprobe writes statistics only; a reader of its files cannot tell which framework, versions or
model produced them. Ours adds one small JSON file per rank directory, written atomically when the
session starts (msprobe's tools read only the CSV and event files, so they are not disturbed):
trainmon's version, the framework and its version, rank and world size, and the class name of
each model chunk's root module. The dashboard uses the last to show the root module's rows, which
the files name ``.input`` / ``.output`` as msprobe does, by their class (``GPT.input``), and
``anomaly-analyse --cross-rank`` the pipeline stage, to compare ranks of one stage only. A shared
module at the top of ``monitor``: the session writes the file, the readers of every layer read it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from monitor.files import atomic_write_text

logger = logging.getLogger("trainmon")

RUN_INFO_FILE = "trainmon_run.json"
#: a run-info file larger than this is not ours (it is not read).
_MAX_BYTES = 1 << 20


def run_info(
    framework: str, framework_version: str, rank: int, world_size: int, root_modules: Sequence[str]
) -> dict[str, Any]:
    """The run-info document of one rank; ``root_modules`` holds one class name per model chunk.
    ``MonitorCore`` adds the rank's pipeline stage, its pipeline's ranks and the config when it
    writes the file."""
    from monitor import __version__

    return {
        "trainmon_version": __version__,
        "framework": framework,
        "framework_version": framework_version,
        "rank": rank,
        "world_size": world_size,
        "root_modules": list(root_modules),
    }


def write_run_info(directory: str, info: Mapping[str, Any]) -> str:
    """Replace ``directory``'s run-info file with ``info``; returns its path."""
    path = os.path.join(directory, RUN_INFO_FILE)
    atomic_write_text(path, json.dumps(info, indent=1) + "\n")
    return path


def _read_field(directory: str, key: str) -> Any:
    """One field of ``directory``'s run-info file; None when absent or unreadable."""
    path = os.path.join(directory, RUN_INFO_FILE)
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            return None
        with open(path, encoding="utf-8") as handle:
            return json.load(handle).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def read_root_modules(directory: str) -> dict[int, str]:
    """Chunk -> root module class name from ``directory``'s run-info file; {} when absent or unreadable."""
    roots = _read_field(directory, "root_modules")
    if not isinstance(roots, list):
        return {}
    return {chunk: name for chunk, name in enumerate(roots) if isinstance(name, str) and name}


def read_pipeline_stage(directory: str) -> int | None:
    """The rank's pipeline stage from ``directory``'s run-info file; None when absent or unreadable."""
    stage = _read_field(directory, "pp_stage")
    return stage if type(stage) is int and stage >= 0 else None
