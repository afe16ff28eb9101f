"""What the CPU-time benchmarks share: the recommended alert rules, training in alternating
unmonitored / monitored blocks, and running each scenario in a fresh process.

Blocks go A B B A A B ... (A unmonitored, B monitored); each starts with an untimed step (the
first collected step builds row tables and opens files) and its cost is the process CPU time
(every thread, so the background writer counts) per timed step, a monitored block's
``flush()`` included, so work left to the writer is not hidden. Neighbouring blocks cancel the
slow load drift of a shared machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: the alert rules of config_templates/everything_alerts.yaml (the recommended ones)
RECOMMENDED_RULES: list[dict] = yaml.safe_load(
    (ROOT / "config_templates" / "everything_alerts.yaml").read_text(encoding="utf-8")
)["alert"]["rules"]
#: every data type a benchmark's "everything" scenario switches on (collectives need ranks)
EVERY_DATA_TYPE = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "mg_direction": True,
    "xy_distribution": True,
    "all_xy": True,
}
#: the same with the recommended alert rules and the anomaly dump
EVERYTHING_WITH_ALERTS = {**EVERY_DATA_TYPE, "alert": {"rules": RECOMMENDED_RULES, "dump": True}}


def chosen_scenarios(parser: Any, text: str, known: Any) -> list[str]:
    """The comma-separated scenario names of ``--scenarios``; an unknown one is a usage error."""
    names = text.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; expected some of {list(known)}")
    return names


def alternate(
    step: Callable[[], None], attach: Callable[[], Any], pairs: int, steps: int
) -> tuple[list, Any]:
    """Train ``pairs`` pairs of blocks; ``attach()`` returns a TrainerMon the first time a block
    is monitored. Returns the blocks (``monitored``, ``cpu`` per step) and the monitor."""
    mon = None
    blocks = []
    for pair in range(pairs):
        for monitored in (False, True) if pair % 2 == 0 else (True, False):
            if monitored:
                if mon is None:
                    mon = attach()
                else:
                    mon.start()
            step()
            cpu = time.process_time()
            for _ in range(steps):
                step()
            if monitored:
                mon.flush()
                mon.stop()
            blocks.append({"monitored": monitored, "cpu": (time.process_time() - cpu) / steps})
    return blocks, mon


def files_written(mon: Any) -> int:
    """How many files the monitor wrote (none: a part switched itself off and looks cheap)."""
    return sum(len(names) for _, _, names in os.walk(mon.output_dir)) if mon is not None else 0


def pairs_of(blocks: list[dict]) -> list[tuple[float, float]]:
    """Per pair of neighbouring blocks: (unmonitored, monitored) CPU time per step."""
    out = []
    for first, second in zip(blocks[0::2], blocks[1::2]):
        plain, watched = (second, first) if first["monitored"] else (first, second)
        out.append((plain["cpu"], watched["cpu"]))
    return out


def run_worker(script: str, arguments: list[str], output_dir: str, what: str) -> dict:
    """Run ``script --worker ...`` in a fresh process (one thread, its own output directory) and
    return the JSON on its last line; fails when it crashed or the monitor logged an error."""
    env = {**os.environ, "MONITOR_OUTPUT_DIR": output_dir, "OMP_NUM_THREADS": "1", "GLOG_v": "3"}
    done = subprocess.run([sys.executable, script, *arguments], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: exit {done.returncode}\n{done.stderr[-4000:]}")
    errors = [line for line in done.stderr.splitlines() if line.startswith(("[trainmon] ERROR", "Traceback"))]
    if errors:
        raise RuntimeError(f"{what}: the monitor reported errors:\n{errors[:5]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
