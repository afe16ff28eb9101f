"""Shared runs for the dashboard tests: real ``trainmon demo`` outputs and small generated runs.

The demo runs once per session for each format (both at once, in two processes). Generated runs
go through the monitor's own writers (CsvWriter, TensorBoardWriter, AnomalyDump) and, with
``detect``, its own detector and incident tracker (Detector, AnomalySink), so their files are
exactly what a training run leaves; expected numbers are always read back from those files by the
tests' own readers (the csv module, TensorBoard's EventAccumulator), never from the code under test.
"""

from __future__ import annotations

import csv
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from tensorboard.plugins import base_plugin
from werkzeug.test import Client
from werkzeug.wrappers import Response

from dashboards.plugin.plugin import TrainmonPlugin
from monitor.anomaly.detector import Anomaly, Detector
from monitor.anomaly.dump import AnomalyDump
from monitor.anomaly.incidents import AnomalySink
from monitor.files import make_private_dir
from monitor.record import RowSet, StepRecord
from monitor.writers.csv import CsvWriter
from monitor.writers.tensorboard import TensorBoardWriter

#: the demo: 14 steps, spike at 11 (the demo's z-score rule needs 10 steps of history first).
DEMO_STEPS, DEMO_SPIKE = 14, 11
OPS = ("norm", "min", "max", "nans")
TASKS = {"grad_reduced": "post_grad", "grad_unreduced": "acc_grad", "exp_avg": "exp_avg"}
NAMES = ("embedding.weight", "layers.0.fc1.weight", "layers.0.fc2.weight", "head.weight")
#: write_run(..., **INCIDENT_RUN) has two incidents. The first starts at step 3 with a NaN in rank
#: 0's local gradient of layers.0.fc1.weight (its root: the earliest phase), which reaches the
#: reduced gradient of both ranks at that step; it stays abnormal on rank 0 at step 4 and closes.
#: The second is an Inf in rank 1's exp_avg max of head.weight from step 9 to the end, so it is
#: still open when monitoring ends.
INCIDENT_RUN = {
    "ranks": (0, 1),
    "steps": range(12),
    "prefixes": ("grad_unreduced", "grad_reduced", "exp_avg"),
    "detect": True,
    "special": {
        (0, "grad_unreduced", 3, 1, "norm"): float("nan"),
        (0, "grad_reduced", 3, 1, "norm"): float("nan"),
        (1, "grad_reduced", 3, 1, "norm"): float("nan"),
        (0, "grad_reduced", 4, 1, "norm"): float("nan"),
        **{(1, "exp_avg", step, 3, "max"): float("inf") for step in (9, 10, 11)},
    },
}


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory) -> dict[str, Path]:
    """``{"csv": root, "tensorboard": root}``: two ``trainmon demo`` output roots in one logdir."""
    pytest.importorskip("torch")
    logdir = tmp_path_factory.mktemp("demo_logdir")
    processes = {}
    for fmt in ("csv", "tensorboard"):
        args = [sys.executable, "-m", "monitor.cli", "demo", "--steps", str(DEMO_STEPS)]
        args += ["--spike-step", str(DEMO_SPIKE), "--format", fmt, "--output", str(logdir / f"demo_{fmt}")]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        processes[fmt] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    for process in processes.values():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output.decode(errors="replace")
    return {fmt: logdir / f"demo_{fmt}" for fmt in processes}


def rank_dir(root: Path, rank: int = 0) -> Path:
    (found,) = [p for p in root.iterdir() if f"-rank{rank}-" in p.name]
    return found


def read_csv_rows(directory: Path, prefix: str) -> list[dict]:
    """Every row of ``{prefix}_*.csv`` with the csv module; values as Python floats of the text."""
    pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)-\d+\.csv$")
    files = [(int(m.group(1)), p) for p in directory.iterdir() if (m := pattern.match(p.name))]
    rows = []
    for _, path in sorted(files):
        with open(path, newline="", encoding="utf-8") as handle:
            for record in csv.DictReader(handle):
                rows.append(
                    {
                        "vpp": int(record.pop("vpp_stage")),
                        "name": record.pop("name"),
                        "step": int(record.pop("step")),
                        "micro": int(record.pop("micro_step", -1)),
                        "values": {op: float(text) for op, text in record.items()},
                    }
                )
    return rows


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN."""
    return (np.isnan(a) and np.isnan(b)) or a == b


def generated_value(rank: int, prefix_index: int, step: int, row: int, op: str) -> float:
    """The value write_run writes (before ``special``) for the ``prefix_index``-th data type."""
    if op == "nans":
        return 0.0
    return (1 + row) * 10.0 ** (prefix_index - OPS.index(op)) * (1 + 0.01 * step + 0.1 * rank)


def _writer(fmt: str, path: Path, rank: int, window: int):
    if fmt == "csv":
        return CsvWriter(path, 6, window)
    if fmt == "parquet":
        from monitor.writers.parquet import ParquetWriter

        return ParquetWriter(path, rank, merge_steps=window)
    return TensorBoardWriter(path)


def write_run(
    root: Path,
    *,
    ranks: Sequence[int] = (0,),
    steps: Sequence[int] = range(6),
    names: Sequence[str] = NAMES,
    fmt: str = "csv",
    window: int = 1,
    prefixes: Sequence[str] = ("grad_reduced",),
    special: dict | None = None,
    skip: dict | None = None,
    anomalies: Sequence[tuple] = (),
    detect: bool = False,
    stamp: str = "Jan02_03-04-05",
) -> dict[int, Path]:
    """A run of generated values written by the monitor's writers; returns rank -> directory
    (``window``: steps per CSV file, or per merged Parquet file).

    ``special`` maps (rank, prefix, step, row, op) to a value (NaN, Inf, ...); ``skip`` maps
    (rank, prefix, step) to row indices left out of that step. ``anomalies`` are
    (rank, prefix, step, row, op) written to anomaly_detected/rank{R}/anomaly.json. With ``detect``
    every record goes through the monitor's detector (non-finite values only) and incident tracker
    instead, which write anomaly.json and incidents.json as in training.
    """
    assert not (detect and anomalies), "detect writes the anomaly files itself"
    special, skip = special or {}, skip or {}
    dirs = {}
    for rank in ranks:
        path = root / f"{stamp}-rank{rank}-{rank:08x}"
        make_private_dir(path)
        dirs[rank] = path
        writer = _writer(fmt, path, rank, window)
        rowsets = {p: RowSet.build([0] * len(names), names, rank, TASKS[p]) for p in prefixes}
        sink = AnomalySink(Detector([], rank), AnomalyDump(root, rank)) if detect else None
        for step in steps:
            for p_index, prefix in enumerate(prefixes):
                values = np.array(
                    [[generated_value(rank, p_index, step, r, op) for op in OPS] for r in range(len(names))]
                )
                for (s_rank, s_prefix, s_step, row, op), value in special.items():
                    if (s_rank, s_prefix, s_step) == (rank, prefix, step):
                        values[row, OPS.index(op)] = value
                keep = [r for r in range(len(names)) if r not in skip.get((rank, prefix, step), ())]
                rows = rowsets[prefix] if len(keep) == len(names) else rowsets[prefix].take(keep)
                record = StepRecord(prefix, step, OPS, rows, values[keep])
                writer.write(record)
                if sink is not None:
                    sink.write(record)
            writer.end_step(step)
            if sink is not None:
                sink.end_step(step)
        writer.close()
        if sink is not None:
            sink.close()
    by_rank: dict[int, list[Anomaly]] = {}
    for call, (rank, prefix, step, row, op) in enumerate(anomalies):
        tag = f"0:{names[row]}/rank{rank}/{TASKS[prefix]}"
        message = f"Rule AnomalyNan reports anomaly signal in ('{tag}', '{op}') at step {step}."
        by_rank.setdefault(rank, []).append(
            Anomaly(rank, step, 0, 0, 0, call, tag, op, float("nan"), 1.0, "AnomalyNan", message, [rank])
        )
    for rank, found in by_rank.items():
        dump = AnomalyDump(root, rank)
        dump.add(found)
        dump.close()
    return dirs


def incident_documents(root: Path) -> dict[int, dict]:
    """rank -> root/anomaly_detected/rank{R}/incidents.json, read with json."""
    found = {}
    for path in sorted((root / "anomaly_detected").glob("rank*/incidents.json")):
        document = json.loads(path.read_text())
        found[document["rank"]] = document
    return found


def anomaly_records(root: Path) -> list[dict]:
    """All records of root/anomaly_detected/*/anomaly.json, read with json."""
    records = []
    for path in sorted((root / "anomaly_detected").glob("*/anomaly.json")):
        records.extend(json.loads(path.read_text()).values())
    return records


class Api:
    """The plugin's routes, called as TensorBoard would."""

    def __init__(self, logdir) -> None:
        self.plugin = TrainmonPlugin(base_plugin.TBContext(logdir=str(logdir)))
        self.apps = self.plugin.get_plugin_apps()

    def get(self, route: str, **query):
        return Client(self.apps[route], Response).get(route, query_string=query)

    def json(self, route: str, **query):
        response = self.get(route, **query)
        assert response.status_code == 200, response.get_data(as_text=True)
        return response.get_json()

    def runs(self) -> dict[str, dict]:
        return {run["name"]: run for run in self.json("/runs")["runs"]}

    def heatmap(self, **query) -> dict:
        """The binary answer decoded by its documented layout (u32 length, JSON, float64, uint8)."""
        response = self.get("/heatmap", **query)
        assert response.status_code == 200, response.get_data(as_text=True)
        body = response.get_data()
        (length,) = struct.unpack_from("<I", body)
        header = json.loads(body[4 : 4 + length])
        shape = (len(header["rows"]), len(header["steps"]))
        cells = shape[0] * shape[1]
        header["values"] = np.frombuffer(body, "<f8", cells, 4 + length).reshape(shape)
        header["present"] = np.frombuffer(body, np.uint8, cells, 4 + length + 8 * cells).reshape(shape) == 0
        assert len(body) == 4 + length + 9 * cells
        return header
