"""The statistics kernel alone (adapters/torch/stats.py ``stat_matrix``) against the memory floor.

Tensors of mixed sizes (a few large matrices, many medium ones, many small vectors), half of the
bytes fp32 and half bf16, 256 MB in all. The floor is measured in the same run: one ``torch.sum``
pass over the same tensors, i.e. reading every byte once. Op sets and the floor are timed in
turns (round-robin, so a load change on a shared machine hits them alike); per op set the
median CPU time of the calling thread (with one torch thread every op runs there) and the
median of its per-round ratios to the floor are printed.

    python benchmarks/stats.py              # 256 MB, 1 thread, 7 rounds
    python benchmarks/stats.py --quick      # 16 MB, 3 rounds, a few seconds (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from adapters.torch.stats import stat_matrix  # noqa: E402

ALL_SIX = ("min", "max", "norm", "mean", "zeros", "nans")
#: label -> ops; the first two have targets (ratio to the floor).
OP_SETS = {
    "all six": ALL_SIX,
    "norm": ("norm",),
    "min+max": ("min", "max"),
    "mean": ("mean",),
    "zeros": ("zeros",),
    "nans": ("nans",),
}
TARGETS = {"all six": 3.0, "norm": 1.3}
#: element counts of one "layer" of tensors at 256 MB: a large matrix, medium ones, vectors.
LAYER = (4 << 20, 1 << 20, 1 << 20, 1 << 18, 1 << 16, 4096, 1024, 1024, 256)


def make_tensors(total_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    """Layers of tensors (LAYER's sizes, scaled to ``total_bytes``), alternately fp32 and bf16."""
    generator = torch.Generator().manual_seed(seed)
    scale = min(1.0, total_bytes / (256 << 20))
    tensors, used, layer = [], 0, 0
    while used < total_bytes:
        dtype = torch.float32 if layer % 2 == 0 else torch.bfloat16
        for full in LAYER:
            numel = max(64, int(full * scale))
            size = numel * (4 if dtype == torch.float32 else 2)
            if used + size > total_bytes:
                numel = (total_bytes - used) // (4 if dtype == torch.float32 else 2)
                if numel == 0:
                    break
            t = torch.randn(numel, generator=generator).to(dtype)
            t[:: max(1, numel // 100)] = 0.0  # a few zeros, so ``zeros`` counts something
            tensors.append(t)
            used += t.numel() * t.element_size()
        layer += 1
    return tensors


def floor_pass(tensors: list[torch.Tensor]) -> None:
    """The memory floor: read every element once."""
    for t in tensors:
        t.sum()


def timed(fn, *args) -> float:
    """CPU time of this thread (torch runs single-threaded ops here): steadier than wall time when
    other processes share the machine."""
    started = time.thread_time()
    fn(*args)
    return time.thread_time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="total size of the tensors")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="16 MB, 3 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 16, 3
    torch.set_num_threads(args.threads)
    tensors = make_tensors(args.mb << 20)
    fp32 = sum(t.numel() * 4 for t in tensors if t.dtype == torch.float32)
    print(
        f"{len(tensors)} tensors, {args.mb} MB ({fp32 / 2**20:.0f} MB fp32, "
        f"{(args.mb << 20) / 2**20 - fp32 / 2**20:.0f} MB bf16), {args.threads} thread(s), "
        f"{args.rounds} rounds, torch {torch.__version__}"
    )
    floor_pass(tensors)  # warm-up: page in, allocator
    for ops in OP_SETS.values():
        stat_matrix(tensors, ops)
    floors: list[float] = []
    times: dict[str, list[float]] = {label: [] for label in OP_SETS}
    for _ in range(args.rounds):
        floors.append(timed(floor_pass, tensors))
        for label, ops in OP_SETS.items():
            times[label].append(timed(stat_matrix, tensors, ops))
    floor = statistics.median(floors)
    print(f"{'op set':10s} {'CPU ms':>8s} {'x floor':>8s} {'GB/s':>7s} {'target':>7s}")
    print(f"{'floor':10s} {floor * 1000:8.1f} {1.0:8.2f} {(args.mb / 1024) / floor:7.2f}")
    for label, values in times.items():
        ratio = statistics.median(v / f for v, f in zip(values, floors))
        target = TARGETS.get(label)
        verdict = "" if target is None or args.quick else ("met" if ratio <= target else "NOT met")
        print(
            f"{label:10s} {statistics.median(values) * 1000:8.1f} {ratio:8.2f} "
            f"{(args.mb / 1024) / statistics.median(values):7.2f} {target or '':>7} {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
