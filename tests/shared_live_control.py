"""Driving dynamic mode from a test: the config file a user edits while the run goes on."""

from __future__ import annotations

import os
from collections.abc import Callable

from tests.log_capture import LogRecords, trainmon_records
from tests.shared_outputs import collected_steps

#: a dynamic config as a user writes it (odd spacing included): off, two steps per switch-on
DYNAMIC_CONFIG = '{\n  "wg_distribution": true,\n\n  "dynamic_on": false,   "collect_times": 2\n}\n'
SWITCHED_ON = DYNAMIC_CONFIG.replace('"dynamic_on": false', '"dynamic_on": true')


def replace_file(path, text: str) -> None:
    """Write ``text`` to a new file renamed over ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)  # a new inode: the edit is seen even within the file system's mtime granularity


def train_while_editing(path, train_step: Callable[[int], None], steps: int) -> LogRecords:
    """Run ``train_step(step)`` for ``steps`` steps, editing the config at ``path`` on the way.

    During step 2 the config is switched on; during step 7 it is broken; during step 8 it is
    switched on again with collect_times 1; during step 11 with collect_times 10, and during step
    13 switched off by hand. Returns what the trainmon logger said meanwhile.
    """
    with trainmon_records() as log:
        for step in range(steps):
            if step == 2:
                replace_file(path, SWITCHED_ON)
            if step == 7:
                replace_file(path, "{ broken")
            if step == 8:
                replace_file(path, SWITCHED_ON.replace("2\n", "1\n"))
            if step == 11:  # collect_times 1 has ended: dynamic_on written back, nothing else changed
                assert path.read_text() == DYNAMIC_CONFIG.replace("2\n", "1\n")
                replace_file(path, SWITCHED_ON.replace("2\n", "10\n"))
            if step == 13:
                replace_file(path, DYNAMIC_CONFIG.replace("2\n", "10\n"))
            train_step(step)
    return log


def assert_the_edits_were_followed(output_dir: str, path, log: LogRecords) -> None:
    """What train_while_editing's edits must give, whatever the framework."""
    # the edit made during step 2 is seen at its end: steps 3 and 4 are collected (collect_times 2);
    # the broken edit is reported once; the edit during step 8 collects step 9 only; switched off
    # by hand during step 13, the collection from step 12 on ends after step 13
    assert collected_steps(output_dir) == [3, 4, 9, 12, 13]
    assert path.read_text() == DYNAMIC_CONFIG.replace("2\n", "10\n")  # as the user wrote it
    assert len([r for r in log.errors() if "not valid" in r.getMessage()]) == 1
