"""How fast the trainmon tab's first heatmap comes up on a big run (target: under 1 s).

Writes a run with the monitor's own writers (CSV, TensorBoard or live Parquet): ROWS parameters x
STEPS steps x RANKS ranks of one data type, plus an anomaly file with one anomaly per rank late in
the run, then builds a fresh plugin (cold caches; the files are in the OS page cache, as they are
for a run that was just written) and times (wall clock, and this process's CPU time, which a busy
machine inflates less), in-process, what the page asks for on load: /runs, /anomalies and the
landing heatmap (the first anomaly's data type, op and rank, 330 columns: a 1,200-pixel-wide view).
Then, warm: the same heatmap again, another op, one tag across all ranks, a 300-step range at full
resolution and the line chart of one tag on every rank.

    python benchmarks/dashboard.py                      # 2,000 x 5,000 x 4, csv then tensorboard
    python benchmarks/dashboard.py --format csv --window 10
    python benchmarks/dashboard.py --format parquet
    python benchmarks/dashboard.py --quick              # 200 x 300 x 2, seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tensorboard.plugins import base_plugin  # noqa: E402
from werkzeug.test import Client  # noqa: E402
from werkzeug.wrappers import Response  # noqa: E402

from dashboards.plugin.plugin import TrainmonPlugin  # noqa: E402
from monitor.anomaly.detector import Anomaly  # noqa: E402
from monitor.anomaly.dump import AnomalyDump  # noqa: E402
from monitor.record import RowSet, StepRecord  # noqa: E402
from monitor.writers.csv import CsvWriter  # noqa: E402
from monitor.writers.tensorboard import TensorBoardWriter  # noqa: E402

OPS = ("norm", "min", "max")
COLUMNS = 330


def write_run(root: Path, rows: int, steps: int, ranks: int, fmt: str, window: int) -> None:
    names = [f"module.decoder.layers.{i // 8}.mlp.linear_fc{i % 8}.weight" for i in range(rows)]
    rng = np.random.default_rng(0)
    base = rng.uniform(0.01, 10, (rows, len(OPS)))
    for rank in range(ranks):
        directory = root / f"Jan02_03-04-05-rank{rank}-{rank:08x}"
        directory.mkdir(parents=True)
        if fmt == "parquet":
            from monitor.writers.parquet import ParquetWriter

            writer = ParquetWriter(directory, rank)
        else:
            writer = CsvWriter(directory, 6, window) if fmt == "csv" else TensorBoardWriter(directory)
        rowset = RowSet.build([0] * rows, names, rank, "post_grad")
        for step in range(steps):
            writer.write(StepRecord("grad_reduced", step, OPS, rowset, base * (1 + 1e-4 * step)))
            writer.end_step(step)
        writer.close()
        step = steps * 3 // 4 + rank
        tag = f"0:{names[rows // 2]}/rank{rank}/post_grad"
        dump = AnomalyDump(root, rank)
        dump.add(
            [
                Anomaly(
                    rank, step, 0, 0, 0, 0, tag, "norm", 1e6, 1.0, "AnomalyZScore", f"spike at {step}", [rank]
                )
            ]
        )
        dump.close()


class Page:
    """The requests the trainmon tab makes, timed."""

    def __init__(self, logdir: Path) -> None:
        self.apps = TrainmonPlugin(base_plugin.TBContext(logdir=str(logdir))).get_plugin_apps()

    def get(self, route: str, **query) -> bytes:
        response = Client(self.apps[route], Response).get(route, query_string=query)
        if response.status_code != 200:
            raise RuntimeError(f"{route} {query}: {response.status_code} {response.get_data()[:300]!r}")
        return response.get_data()

    def heatmap(self, **query) -> dict:
        body = self.get("/heatmap", **query)
        (length,) = struct.unpack_from("<I", body)
        return json.loads(body[4 : 4 + length])


def timed(label: str, action, results: list) -> object:
    """Run ``action``; append (label, wall seconds, CPU seconds of this process)."""
    start, cpu = time.perf_counter(), time.process_time()
    value = action()
    results.append((label, time.perf_counter() - start, time.process_time() - cpu))
    return value


def bench(logdir: Path, rows: int, ranks: int) -> list[tuple[str, float, float]]:
    results: list[tuple[str, float, float]] = []
    page = Page(logdir)
    start, cpu = time.perf_counter(), time.process_time()
    runs = timed("/runs", lambda: json.loads(page.get("/runs"))["runs"], results)
    (run,) = runs
    landing = run["landing"]
    timed("/anomalies", lambda: page.get("/anomalies", run=run["id"], limit=500), results)
    query = dict(
        run=run["id"], prefix=landing["prefix"], op=landing["op"], rank=landing["rank"], cols=COLUMNS
    )
    view = timed("landing heatmap", lambda: page.heatmap(**query), results)
    results.append(
        ("FIRST HEATMAP (sum of the above)", time.perf_counter() - start, time.process_time() - cpu)
    )
    assert len(view["rows"]) == rows and view["anomaly_cells"], "the landing view must show the anomaly"
    timed("same heatmap again (cached)", lambda: page.heatmap(**query), results)
    timed("other op (same files)", lambda: page.heatmap(**{**query, "op": "max"}), results)
    step = view["steps"][view["anomaly_cells"][0][1]]
    timed("300-step range, every step", lambda: page.heatmap(**query, lo=step - 150, hi=step + 149), results)
    row = view["row_keys"][view["anomaly_cells"][0][0]]
    tag = dict(vpp=row[0], name=row[1], micro=row[2])
    timed(f"one tag x {ranks} ranks", lambda: page.heatmap(**{**query, "mode": "tag", **tag}), results)
    timed("line chart, all ranks", lambda: page.get("/series", **{**query, **tag}), results)
    timed("/runs again (poll)", lambda: page.get("/runs"), results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1, help="step_count_per_record of the CSV files")
    parser.add_argument("--format", choices=("csv", "tensorboard", "parquet", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="200 rows x 300 steps x 2 ranks")
    parser.add_argument("--keep", default=None, help="write the runs here and keep them")
    args = parser.parse_args(argv)
    rows, steps, ranks = (200, 300, 2) if args.quick else (args.rows, args.steps, args.ranks)
    formats = ("csv", "tensorboard") if args.format == "both" else (args.format,)
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="trainmon-dashboard-"))
    try:
        for fmt in formats:
            logdir = scratch / fmt
            shape = f"{rows} rows x {steps} steps x {ranks} ranks x {len(OPS)} ops"
            print(f"\n{fmt}: {shape} (window {args.window})")
            if not logdir.exists():
                start = time.perf_counter()
                write_run(logdir, rows, steps, ranks, fmt, args.window)
                size = sum(p.stat().st_size for p in logdir.rglob("*") if p.is_file())
                print(f"  written in {time.perf_counter() - start:.1f} s, {size / 1e9:.2f} GB")
            print(f"  {'request':36s} {'wall s':>7s} {'CPU s':>7s}   (load average {os.getloadavg()[0]:.1f})")
            for label, seconds, cpu in bench(logdir, rows, ranks):
                print(f"  {label:36s} {seconds:7.3f} {cpu:7.3f}")
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
