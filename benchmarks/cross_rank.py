"""Cross-rank outliers: speed on a large synthetic run, and false-positive / detection rates.

Speed (default): writes RANKS rank directories with TAGS grad_unreduced rows per step for STEPS
steps (one op, ``norm``; PER_FILE steps per CSV file, the config's step_count_per_record) in a
temporary directory, runs ``trainmon anomaly-analyse --cross-rank`` on it in a subprocess and
prints its wall time and peak RSS. Defaults: 64 ranks x 1,000 tags x 1,000 steps = 64M values.

Rates (--rates): 8 tensors, i.i.d. lognormal inter-rank noise (log-sd 0.05) around a level that
changes every step, fed through the statistics in memory (4M values per rank count); prints the
share of values flagged (false positives) and the share of one rank's values found when scaled by
1.25, 1.5 and 3 at every 50th step.

    python benchmarks/cross_rank.py [--ranks 64] [--tags 1000] [--steps 1000] [--per-file 1]
    python benchmarks/cross_rank.py --format parquet    # the same run as format: parquet writes it
    python benchmarks/cross_rank.py --format parquet --ranks 1000 --memory-limit 4GB --keep DIR
    python benchmarks/cross_rank.py --quick --format parquet   # seconds, for CI
    python benchmarks/cross_rank.py --rates
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from monitor.anomaly import peers
from monitor.anomaly.rank_csv import Table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = 65_536


def generate(root: str, ranks: int, tags: int, steps: int, per_file: int, seed: int = 0) -> int:
    """Write the run; returns the bytes written. Values come from a pool of formatted numbers."""
    rng = np.random.default_rng(seed)
    pool = np.array([f"{v:.6g}\n" for v in rng.lognormal(0.0, 0.05, POOL)], dtype=object)
    heads = np.array([f"0,layers.{t // 8}.mlp.fc{t % 8}.weight," for t in range(tags)], dtype=object)
    total = 0
    for rank in range(ranks):
        directory = os.path.join(root, f"Jan01_00-00-00-rank{rank}-{rank:08x}")
        os.makedirs(directory)
        for first in range(0, steps, per_file):
            lines = ["vpp_stage,name,step,norm\n"]
            for step in range(first, min(first + per_file, steps)):
                values = pool[rng.integers(0, POOL, tags)]
                lines.append("".join(heads + f"{step}," + values))
            text = "".join(lines)
            with open(
                os.path.join(directory, f"grad_unreduced_{first}-{first + per_file - 1}.csv"), "w"
            ) as f:
                f.write(text)
            total += len(text)
    return total


def generate_parquet(root: str, ranks: int, tags: int, steps: int, seed: int = 0) -> int:
    """The run in the layout of ``format: parquet`` (merged files of 100 steps); returns the bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from monitor.writers.parquet import MERGE_STEPS, MERGED_ZSTD_LEVEL
    from monitor.writers.parquet_files import VALUES_DIR, file_options, merged_file_name, schema

    rng = np.random.default_rng(seed)
    names = pa.array([f"layers.{t // 8}.mlp.fc{t % 8}.weight" for t in range(tags)])
    total = 0
    for rank in range(ranks):
        directory = os.path.join(root, f"Jan01_00-00-00-rank{rank}-{rank:08x}", VALUES_DIR)
        directory = os.path.join(directory, "data_type=grad_unreduced")
        os.makedirs(directory)
        for first in range(0, steps, MERGE_STEPS):
            last = min(first + MERGE_STEPS, steps) - 1
            count = (last - first + 1) * tags
            table = pa.Table.from_arrays(
                [
                    pa.array(np.full(count, rank, np.int64)),
                    pa.array(np.repeat(np.arange(first, last + 1), tags)),
                    pa.nulls(count, pa.int64()),
                    pa.array(np.zeros(count, np.int64)),
                    pa.DictionaryArray.from_arrays(
                        np.tile(np.arange(tags, dtype=np.int32), last - first + 1), names
                    ),
                    pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), pa.array(["norm"])),
                    pa.array(rng.lognormal(0.0, 0.05, count)),
                ],
                schema=schema(),
            )
            path = os.path.join(directory, merged_file_name(first, last))
            pq.write_table(table, path, **file_options(MERGED_ZSTD_LEVEL))
            total += os.path.getsize(path)
    return total


class TreeMemory:
    """The peak of the proportional set size (shared pages split between the processes that map
    them) of a process and its children together, sampled every 250 ms from /proc (more often
    costs the measured processes time: the kernel walks their page tables)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.pss = pid, 0

    def follow(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            self.pss = max(self.pss, sum(_pss(pid) for pid in _tree(self.pid)))
            time.sleep(0.25)


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return found


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def speed(args: argparse.Namespace) -> int:
    root = args.keep or tempfile.mkdtemp(prefix="trainmon-cross-rank-bench-")
    try:
        if not (args.keep and os.path.isdir(args.keep) and os.listdir(args.keep)):
            start = time.perf_counter()
            if args.format == "parquet":
                size = generate_parquet(root, args.ranks, args.tags, args.steps)
            else:
                size = generate(root, args.ranks, args.tags, args.steps, args.per_file)
            values = args.ranks * args.tags * args.steps
            took = time.perf_counter() - start
            print(
                f"generated {values:,} values ({args.ranks} ranks x {args.tags} tags x {args.steps} steps, "
                f"{args.per_file} step(s) per file), {size / 2**20:.0f} MiB, in {took:.1f} s"
            )
        command = [sys.executable, "-m", "monitor.anomaly_analyse", "--cross-rank", "-d", root, "-k", "3"]
        command += ["--memory-limit", args.memory_limit] if args.memory_limit else []
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # no pipe to fill
            proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=err, text=True)
            peak = TreeMemory(proc.pid)
            peak.follow(proc)
            wall = time.perf_counter() - start
            stdout, stderr = (_read(f) for f in (out, err))
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(stdout.rstrip())
        if proc.returncode != 0:
            print(stderr.rstrip(), file=sys.stderr)
            return 1
        print(
            f"analysis: wall {wall:.1f} s, CPU {usage.ru_utime + usage.ru_stime:.1f} s (all its processes), "
            f"peak memory {peak.pss / 2**20:.0f} MiB (PSS of all its processes together), "
            f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB (largest process)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


TENSORS = 8


def _flag_share(series: np.ndarray, k_mad: float, column: int | None, rows: slice) -> float:
    """Share flagged (all ranks, or one rank's) in the chosen steps of a (steps, tensors, ranks) array."""
    steps, tensors, ranks = series.shape
    codes = np.tile(np.arange(tensors, dtype=np.int32), steps)
    per_rank = {
        r: [
            Table(
                ("norm",),
                [f"t{t}" for t in range(tensors)],
                codes,
                np.zeros(steps * tensors, np.int32),
                None,
                np.repeat(np.arange(steps), tensors),
                series[:, :, r].reshape(-1, 1),
            )
        ]
        for r in range(ranks)
    }
    out = peers.Outliers(k_mad)
    ranks = sorted(per_rank)
    tables = [(column, table) for column, rank in enumerate(ranks) for table in per_rank[rank]]
    passes = [peers.first_pass(tables, len(ranks), out.k_mad, out.only_ops, out.only_steps)]
    peers.judge("grad_unreduced", ranks, passes, out)
    chosen = np.zeros(steps, dtype=bool)
    chosen[rows] = True
    hits = chosen[out["step"]]
    if column is None:
        return float(hits.sum()) / (chosen.sum() * tensors * ranks)
    return float((hits & (out["rank"] == column)).sum()) / (chosen.sum() * tensors)


def rates(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    print(f"{TENSORS} tensors, inter-rank noise log-sd 0.05, level log-sd 1 per step and tensor")
    print("ranks  k_mad  false-positive rate  found x1.25  x1.5   x3")
    for ranks in (4, 8, 16, 64):
        steps = 4_000_000 // (ranks * TENSORS)
        level = np.exp(rng.normal(0.0, 1.0, size=(steps, TENSORS, 1)))
        series = level * np.exp(rng.normal(0.0, 0.05, size=(steps, TENSORS, ranks)))
        for k_mad in (5.0, 8.0):
            fp = _flag_share(series, k_mad, None, slice(None))
            found = []
            for factor in (1.25, 1.5, 3.0):
                scaled = series.copy()
                scaled[::50, :, 0] *= factor
                found.append(_flag_share(scaled, k_mad, 0, slice(None, None, 50)))
            print(f"{ranks:5d}  {k_mad:5g}  {fp:19.1e}  " + "  ".join(f"{f:10.2f}" for f in found))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tags", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-file", type=int, default=1)
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv", help="the run's output format")
    parser.add_argument("--memory-limit", default=None, help="the analysis' --memory-limit")
    parser.add_argument(
        "--keep", default=None, metavar="DIR", help="write the run here and keep it (analyse it if there)"
    )
    parser.add_argument("--quick", action="store_true", help="8 ranks x 100 tags x 200 steps, seconds (CI)")
    parser.add_argument("--rates", action="store_true", help="false-positive and detection rates instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.tags, args.steps = 8, 100, 200
    if args.rates:
        rates(args)
        return 0
    return speed(args)


if __name__ == "__main__":
    raise SystemExit(main())
