"""Benchmark of ``python -m monitor.anomaly_analyse`` on a large synthetic anomaly tree.

Generates RANKS directories ``rank{R}/anomaly.json`` with PER_RANK records each in a temporary
directory (removed afterwards unless --keep), runs the analysis in a subprocess and prints its wall
time and peak RSS. Defaults: 1,000 ranks x 1,000 records = 1,000,000 records.

    python benchmarks/anomaly_analyse.py [--ranks 1000] [--per-rank 1000] [--format ours|reference]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("actv", "actv_grad", "acc_grad", "post_grad", "exp_avg", "exp_avg_sq", "mg_direction", "post_0")
OPS = ("norm", "min", "max", "mean", "nans", "zeros")


def _record(rank: int, index: int, rng: random.Random, fmt: str, pp: int) -> tuple[str, str]:
    """(key, indented JSON text) of one record laid out like the writers' indent=1 output."""
    step = rng.randrange(0, 200)
    vpp = rng.randrange(0, 2)
    call_id = index
    task = TASKS[index % len(TASKS)]
    tag = f"{vpp}:layers.{index % 64}.mlp.fc{index % 3}.weight/rank{rank}/{task}"
    op = OPS[index % len(OPS)]
    value, mean = rng.uniform(10, 1000), rng.uniform(0.1, 5)
    message = (
        f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', '{op}') at step {step}, "
        f"current value {value}, history mean {mean}."
    )
    common = (
        f'  "rank": {rank},\n  "step": {step},\n  "micro_step": {index % 4},\n  "pp_stage": {pp},\n'
        f'  "vpp_stage": {vpp},\n  "call_id": {call_id},\n  "tag_name": "{tag}",\n'
    )
    mates = f'  "group_mates": [\n   {rank - rank % 4},\n   {rank - rank % 4 + 1}\n  ]\n'
    if fmt == "ours":
        key = f"{tag}_{op}_step_{step}_call_{call_id}"
        body = (
            f'{common}  "op": "{op}",\n  "value": {value},\n  "baseline": {mean},\n'
            f'  "rule": "AnomalyTurbulence",\n  "message": "{message}",\n{mates}'
        )
    else:
        key = f"{tag}_step_{step}_call_{call_id}"
        body = f'{common}  "message": "{message}",\n{mates}'
    return key, f' "{key}": {{\n{body} }}'


def generate(root: str, ranks: int, per_rank: int, fmt: str, seed: int = 0) -> int:
    """Write the tree; returns the total number of bytes written."""
    rng = random.Random(seed)
    total = 0
    for rank in range(ranks):
        directory = os.path.join(root, f"rank{rank}")
        os.makedirs(directory)
        pp = rank * 4 // max(ranks, 1)
        parts = [_record(rank, i, rng, fmt, pp)[1] for i in range(per_rank)]
        text = "{\n" + ",\n".join(parts) + "\n}"
        with open(os.path.join(directory, "anomaly.json"), "w", encoding="utf-8") as handle:
            handle.write(text)
        total += len(text)
    return total


def _tree_rss(pid: int) -> int:
    """Resident bytes of pid and its direct children (Linux /proc; 0 elsewhere)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    try:
        pids = [pid]
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{name}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(name))
        for member in pids:
            with contextlib.suppress(OSError), open(f"/proc/{member}/statm") as handle:
                total += int(handle.read().split()[1]) * page
    except OSError:
        return 0
    return total


def _sample_tree_rss(proc: subprocess.Popen, peak: list[int]) -> None:
    while proc.poll() is None:
        peak[0] = max(peak[0], _tree_rss(proc.pid))
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--per-rank", type=int, default=1000)
    parser.add_argument("--format", choices=("ours", "reference"), default="ours")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the generated tree")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="trainmon-anomaly-bench-")
    try:
        start = time.perf_counter()
        size = generate(root, args.ranks, args.per_rank, args.format)
        print(
            f"generated {args.ranks * args.per_rank:,} records ({args.format} format) in "
            f"{args.ranks} files, {size / 2**20:.0f} MiB, in {time.perf_counter() - start:.1f} s"
        )
        command = [sys.executable, "-m", "monitor.anomaly_analyse", "-d", root, "-k", str(args.topk)]
        start = time.perf_counter()
        with subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as proc:
            peak_tree = [0]
            sampler = threading.Thread(target=_sample_tree_rss, args=(proc, peak_tree), daemon=True)
            sampler.start()
            stdout, stderr = proc.communicate()
        wall = time.perf_counter() - start
        sampler.join()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_kib = usage.ru_maxrss  # KiB on Linux
        cpu = usage.ru_utime + usage.ru_stime
        print(stdout.rstrip())
        if proc.returncode != 0:
            print(stderr.rstrip(), file=sys.stderr)
            print(f"analysis failed with exit status {proc.returncode}", file=sys.stderr)
            return 1
        tree = (
            f", sampled peak RSS of the process tree {peak_tree[0] / 2**20:.0f} MiB" if peak_tree[0] else ""
        )
        print(
            f"analysis: wall {wall:.2f} s, CPU {cpu:.2f} s (all its processes), "
            f"peak RSS {peak_kib / 1024:.0f} MiB (largest process){tree}"
        )
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
