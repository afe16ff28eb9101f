"""Reading many files in worker processes when they are large, in this process otherwise.

The offline analyses (anomaly files; the cross-rank analysis' windows of steps) read one input per
task and ship back small results; below a few tens of MiB the cost of starting a pool outweighs
the gain.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import repeat
from typing import Any, TypeVar

#: worker processes at most, whatever the core count.
MAX_JOBS = 8

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def total_size(paths: Iterable[str]) -> int:
    """Bytes in the files (files that cannot be read count 0)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total


def max_workers() -> int:
    """The cores this process may use, at most MAX_JOBS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return min(cores, MAX_JOBS)


def map_in_workers(
    function: Callable[..., _Result],
    items: Sequence[_Item],
    jobs: int,
    *shared: Any,
    chunksize: int = 1,
) -> list[_Result]:
    """``[function(item, *shared) for item in items]``, in ``jobs`` worker processes when jobs > 1.

    A pool that cannot start falls back to this process.
    """
    jobs = max(1, min(jobs, len(items)))
    if jobs > 1:
        try:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                return list(pool.map(function, items, *(repeat(s) for s in shared), chunksize=chunksize))
        except (OSError, BrokenProcessPool):
            pass  # no usable process pool here (e.g. no /dev/shm): do it in this process
    return [function(item, *shared) for item in items]
