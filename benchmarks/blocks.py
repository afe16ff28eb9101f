"""What the CPU-time benchmarks share: the recommended alert rules, training in alternating
unmonitored / monitored blocks, running each scenario in a fresh process, and a free port for
the ranks of one.

Blocks go A B B A A B ... (A unmonitored, B monitored); each starts with an untimed step (the
first collected step builds row tables and opens files) and its cost is the process CPU time
(every thread, so the background writer counts) per timed step, a monitored block's
``flush()`` included, so work left to the writer is not hidden; its ``stop()`` (removing the
hooks, closing the files: once per run in real training) is not timed. Neighbouring blocks cancel the
slow load drift of a shared machine.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
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
    step: Callable[[], None],
    attach: Callable[[], Any],
    pairs: int,
    steps: int,
    clock: Callable[[], float] = time.process_time,
    before_block: Callable[[bool], None] | None = None,
) -> tuple[list, Any]:
    """Train ``pairs`` pairs of blocks; ``attach()`` returns a TrainerMon the first time a block
    is monitored. Returns the blocks (``monitored``, ``seconds`` per step by ``clock``: process
    CPU time by default) and the monitor. ``before_block(monitored)`` runs before each block's
    first (untimed) step."""
    mon = None
    blocks = []
    for pair in range(pairs):
        for monitored in (False, True) if pair % 2 == 0 else (True, False):
            if monitored:
                if mon is None:
                    mon = attach()
                else:
                    mon.start()
            if before_block is not None:
                before_block(monitored)
            step()
            started = clock()
            for _ in range(steps):
                step()
            if monitored:
                mon.flush()
            blocks.append({"monitored": monitored, "seconds": (clock() - started) / steps})
            if monitored:  # detaching is once per run, not a cost per step
                mon.stop()
    return blocks, mon


def collected_among_idle(step: Callable[[], None], mon: Any, steps: int) -> list[float]:
    """With ``mon`` attached and collecting every other step (``step_interval: 2``): per
    collected step, its CPU time (the writer's ``flush()`` included) minus the mean of its two
    uncollected neighbours. Neighbouring steps share the machine's load, so this resolves the
    cost of collecting a step far more finely than blocks do; what an attached monitor costs on
    steps it does not collect is what the blocks add on top."""
    times = []
    for _ in range(steps):
        cpu = time.process_time()
        collecting = mon.monitoring and mon.step % 2 == 0
        step()
        if collecting:
            mon.flush()
        times.append((collecting, time.process_time() - cpu))
    return [
        times[i][1] - (times[i - 1][1] + times[i + 1][1]) / 2
        for i in range(2, len(times) - 1)
        if times[i][0] and not times[i - 1][0] and not times[i + 1][0]
    ]


def paired_twins(plain: Callable[[], None], watched: Callable[[], None], rounds: int) -> list[float]:
    """Two copies of a model, one unmonitored (``plain``) and one monitored (``watched``, its
    writer's ``flush()`` inside; the first three rounds untimed), stepping in turn (each first in
    every other round): per round, the monitored step's CPU time minus the unmonitored one's.
    Adjacent steps share the machine's load and every step counts, so the mean of the differences
    resolves the cost of a collected step to a few percent where single steps scatter by +-20%."""
    for _ in range(3):
        plain()
        watched()
    differences = []
    for index in range(rounds):
        first, second = (plain, watched) if index % 2 == 0 else (watched, plain)  # no order effect
        cpu = time.process_time()
        first()
        middle = time.process_time()
        second()
        end = time.process_time()
        first_cpu, second_cpu = middle - cpu, end - middle
        differences.append(second_cpu - first_cpu if index % 2 == 0 else first_cpu - second_cpu)
    return differences


def mean_and_margin(values: list[float]) -> tuple[float, float]:
    """The mean and its 95% margin (two standard errors)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), 2 * spread / len(values) ** 0.5


def attached_among_detached(step: Callable[[], None], mon: Any, steps: int) -> list[float]:
    """With ``mon`` set up never to collect (e.g. ``start_step`` far ahead) and stopped:
    attached on every other step (``start()`` and ``stop()`` untimed); per attached step, its CPU
    time minus the mean of its two detached neighbours: what the monitor costs on a step it
    does not collect (its hooks checking a flag)."""
    times = []
    for index in range(steps):
        attached = index % 2 == 1
        if attached:
            mon.start()
        cpu = time.process_time()
        step()
        times.append((attached, time.process_time() - cpu))
        if attached:
            mon.stop()
    return [
        times[i][1] - (times[i - 1][1] + times[i + 1][1]) / 2 for i in range(1, len(times) - 1) if times[i][0]
    ]


def files_written(mon: Any) -> int:
    """How many files the monitor wrote (none: a part switched itself off and looks cheap)."""
    return sum(len(names) for _, _, names in os.walk(mon.output_dir)) if mon is not None else 0


def pairs_of(blocks: list[dict]) -> list[tuple[float, float]]:
    """Per pair of neighbouring blocks: (unmonitored, monitored) time per step."""
    out = []
    for first, second in zip(blocks[0::2], blocks[1::2]):
        plain, watched = (second, first) if first["monitored"] else (first, second)
        out.append((plain["seconds"], watched["seconds"]))
    return out


def free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
