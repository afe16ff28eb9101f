"""Step-time and memory overhead of the monitor on a GPT-like model, against msprobe 1.2.2's figures.

Each scenario runs in its own process (so its peak RSS is its own; ``ru_maxrss`` only grows).
In that process one model and one AdamW train without interruption, in blocks of steps that
alternate unmonitored (A) and monitored (B) in the counterbalanced order A B B A A B B A ...:
the first start attaches a TrainerMon, later B blocks ``start()`` it again and each B block
ends with ``flush()`` + ``stop()``, which removes every hook, so an A block is the plain
training loop. Every block begins with untimed warm-up steps (the first collected step opens
files and builds row tables once); then each step's wall time and process CPU time (all
threads, so the background writer's work is counted too) are taken. Per pair of blocks the
ratio of medians B/A is formed, and the median over pairs is reported: a ratio of
neighbouring blocks cancels the slow load drift of a shared machine. The writer's backlog at
the end of a B block (flush + stop) is reported separately, per monitored step.

"neighbours": the same CPU ratio measured from neighbouring steps, which share the machine's
load and so resolve about a percent where block pairs scatter by tens: the cost of collecting
(a collected step minus its two uncollected neighbours, every other step collected) plus the
cost of being attached (an attached, uncollected step minus its two detached neighbours), over
the unmonitored step (benchmarks/blocks.py).

Peak RSS: the process's peak after the first (unmonitored) block is the baseline; the growth
is the peak at the end minus that baseline. The monitor's modules are imported before the
baseline, so a one-off import is not counted as per-step memory.

Every scenario computes the six statistics (``--ops`` to change). "all" is wg, mv, param,
mg_direction and xy with all_xy, plus the alert rules of config_templates/everything_alerts.yaml
with the anomaly dump on. ``idle`` (attached, nothing selected) shows the method's noise floor:
on a busy 2-core machine single pairs scatter by +-30%, so ratios near 1.0 are resolved to a
few percent only. ``--quick`` runs the single-rank scenarios in one process (their peak RSS is
then not their own) and exits non-zero when the monitor logs an error or writes nothing.

    python benchmarks/overhead.py                       # the 6.9M model, every scenario (~20 min)
    python benchmarks/overhead.py --model small --scenarios all-csv,all-tb
    python benchmarks/overhead.py --quick               # a tiny model, every scenario, < 60 s (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from blocks import (  # noqa: E402
    EVERYTHING_WITH_ALERTS,
    attached_among_detached,
    collected_among_idle,
    free_port,
)

OPS = ["min", "max", "norm", "zeros", "nans", "mean"]
#: msprobe's l2 features on every attention block (up to the large model's 6) and every linear layer
L2 = {
    "recording_l2_features": True,
    "l2_targets": {"attention_hook": [f"layers.{i}.attention" for i in range(6)], "linear_hook": []},
    "sa_order": "b,s,h,d",
}
#: name -> (config keys on top of {"targets": {}, "ops": OPS}, ranks)
SCENARIOS: dict[str, tuple[dict, int]] = {
    "idle": ({}, 1),  # attached, nothing selected: the method's noise floor and the optimizer hooks
    "wg": ({"wg_distribution": True}, 1),
    "mv": ({"mv_distribution": True}, 1),
    "param": ({"param_distribution": True}, 1),
    "xy": ({"xy_distribution": True, "all_xy": True}, 1),
    "all-csv": (EVERYTHING_WITH_ALERTS, 1),
    "wg-tb": ({"wg_distribution": True, "format": "tensorboard"}, 1),
    "mv-tb": ({"mv_distribution": True, "format": "tensorboard"}, 1),
    "param-tb": ({"param_distribution": True, "format": "tensorboard"}, 1),
    "xy-tb": ({"xy_distribution": True, "all_xy": True, "format": "tensorboard"}, 1),
    "all-tb": ({**EVERYTHING_WITH_ALERTS, "format": "tensorboard"}, 1),
    "all-parquet": ({**EVERYTHING_WITH_ALERTS, "format": "parquet"}, 1),
    "all-interval100": ({**EVERYTHING_WITH_ALERTS, "step_interval": 100}, 1),
    "l2": (L2, 1),
    "all-l2": ({**EVERYTHING_WITH_ALERTS, **L2}, 1),
    "cc": ({"cc_distribution": {"enable": True}}, 2),
}
#: msprobe 1.2.2's step-time ratios, measured on this machine with the 6.9M model.
REFERENCE = {
    "wg": 1.14, "mv": 1.10, "param": 1.05, "xy": 2.48, "all-csv": 3.03,
    "wg-tb": 1.44, "mv-tb": 1.31, "param-tb": 1.10, "xy-tb": 3.54, "all-tb": 5.16,
}  # fmt: skip
#: the 0.67M model, everything on with TensorBoard.
REFERENCE_SMALL = {"all-tb": 15.0}
TARGETS = {
    "wg": 1.02, "mv": 1.02, "param": 1.02, "xy": 1.02, "all-csv": 1.10,
    "wg-tb": 1.02, "mv-tb": 1.02, "param-tb": 1.02, "xy-tb": 1.02, "all-tb": 1.10, "all-parquet": 1.10,
    "all-interval100": 1.01,
    "all-l2": 1.10,  # everything's target: l2 adds its spectral norms' reads (about 10%: missed)
}  # fmt: skip
#: peak-memory growth targets, as a fraction of the unmonitored peak.
RSS_TARGETS = {"xy": 0.10, "xy-tb": 0.10}
#: GPTConfig keyword arguments of the model sizes.
MODELS = {
    "large": {"vocab": 4096, "hidden": 256, "heads": 4, "layers": 6, "seq": 128},  # 6.87M parameters
    "small": {"vocab": 1024, "hidden": 128, "heads": 4, "layers": 2, "seq": 128},  # 0.68M parameters
    "tiny": {"vocab": 256, "hidden": 32, "heads": 2, "layers": 1, "seq": 16},  # --quick
}


# -- one scenario, in its own process ------------------------------------------------------------


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _train(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    """Train with alternating unmonitored / monitored blocks; rank 0 returns the timings."""
    import torch
    from torch import nn

    import adapters.torch.session  # noqa: F401  (imported before the baseline: see the docstring)
    import monitor.writers.tensorboard  # noqa: F401
    from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch
    from monitor import TrainerMon
    from tests.training import train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(**MODELS[args.model])
    model = TinyGPT(cfg)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = [synthetic_batch(cfg, args.batch, generator) for _ in range(8)]
    extra, _ = SCENARIOS[args.scenario]
    config = {"targets": {}, "ops": args.ops.split(","), **extra}

    def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(model(tokens).reshape(-1, cfg.vocab), targets.reshape(-1))

    def step(i: int) -> None:  # with ranks, plain data parallelism: one all_reduce per gradient
        train(model, optimizer, [[batches[i % len(batches)]]], loss=next_token_loss, data_parallel=world > 1)

    mon: TrainerMon | None = None
    counter = 0
    blocks: list[dict] = []
    baseline_peak = None
    for pair in range(args.pairs):
        for monitored in (False, True) if pair % 2 == 0 else (True, False):
            if monitored:
                if mon is None:
                    mon = TrainerMon(config)
                    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
                else:
                    mon.start()
            walls, cpus = [], []
            for i in range(args.warmup + args.steps):
                wall, cpu = time.perf_counter(), time.process_time()
                step(counter)
                counter += 1
                if i >= args.warmup:
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
            drain = 0.0
            if monitored:
                started = time.perf_counter()
                mon.flush()
                mon.stop()
                drain = time.perf_counter() - started
            if baseline_peak is None:
                baseline_peak = _peak_rss_mb()
            blocks.append({"monitored": monitored, "wall": walls, "cpu": cpus, "drain": drain})
    collect, idle = [0.0], [0.0]
    if world == 1 and extra:  # the cost from neighbouring steps (see the docstring)
        steps = iter(range(counter, counter + 10**6))

        def next_step() -> None:
            step(next(steps))

        every_other = TrainerMon({**config, "step_interval": 2})
        every_other.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        collect = collected_among_idle(next_step, every_other, 4 * args.pairs + 3)
        every_other.stop()
        never = TrainerMon({**config, "start_step": 10**9})
        never.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        never.stop()
        idle = attached_among_detached(next_step, never, 4 * args.pairs + 1)
    if rank != 0:
        return None
    written = mon.output_dir if mon is not None else None
    return {
        "collect": collect,
        "idle": idle,
        "interval": config.get("step_interval", 1),
        "files": sum(len(files) for _, _, files in os.walk(written)) if written else 0,
        "blocks": blocks,
        "baseline_peak_mb": baseline_peak,
        "peak_mb": _peak_rss_mb(),
        "parameters": sum(p.numel() for p in params),
    }


def _rank_main(rank: int, args: argparse.Namespace, world: int, port: int, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _train(args, rank, world)
    finally:
        dist.destroy_process_group()
    if result is not None:
        Path(result_path).write_text(json.dumps(result))
    # gloo's threads can abort the interpreter's own exit ("terminate called without an active
    # exception"): leave without it, as the tests' multi-rank jobs do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(args: argparse.Namespace) -> int:
    """The ``--worker`` entry: scenarios run one after the other; their results as JSON on the last line."""
    results = []
    for name in args.worker.split(","):
        args.scenario = name
        _, world = SCENARIOS[name]
        if world == 1:
            results.append(_train(args, 0, 1))
            continue
        import torch.multiprocessing as mp

        port = free_port()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            result_path = handle.name
        try:
            mp.spawn(_rank_main, args=(args, world, port, result_path), nprocs=world, join=True)
            results.append(json.loads(Path(result_path).read_text()))
        finally:
            os.unlink(result_path)
    print(json.dumps(results))
    return 0


# -- the driver ----------------------------------------------------------------------------------


def summarise(result: dict) -> dict:
    """Median over pairs of the per-pair ratios of median step times (monitored / unmonitored)."""
    blocks = result["blocks"]
    pairs = list(zip(blocks[0::2], blocks[1::2]))
    out = {}
    for key in ("wall", "cpu"):
        ratios = []
        for first, second in pairs:
            plain, watched = (second, first) if first["monitored"] else (first, second)
            ratios.append(statistics.median(watched[key]) / statistics.median(plain[key]))
        out[key] = statistics.median(ratios)
        out[f"{key}_spread"] = (min(ratios), max(ratios))
    plain_steps = [t for b in blocks if not b["monitored"] for t in b["wall"]]
    watched = [b for b in blocks if b["monitored"]]
    out["step_s"] = statistics.median(plain_steps)
    plain_cpu = statistics.median(t for b in blocks if not b["monitored"] for t in b["cpu"])
    # a sparse schedule collects one step in ``interval``: its collection cost is spread over them
    extra = statistics.median(result["collect"]) / result["interval"] + statistics.median(result["idle"])
    out["neighbours"] = 1 + extra / plain_cpu
    out["drain_ms"] = 1000 * sum(b["drain"] for b in watched) / sum(len(b["wall"]) for b in watched)
    out["rss_base"] = result["baseline_peak_mb"]
    out["rss_growth"] = result["peak_mb"] - result["baseline_peak_mb"]
    out["parameters"] = result["parameters"]
    return out


def run_scenarios(names: list[str], args: argparse.Namespace, out_root: str) -> list[dict]:
    """Run scenarios in one fresh process (``names`` after the first share its peak RSS)."""
    command = [
        sys.executable, __file__, "--worker", ",".join(names), "--model", args.model,
        "--pairs", str(args.pairs), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch", str(args.batch), "--ops", args.ops,
    ]  # fmt: skip
    env = {**os.environ, "MONITOR_OUTPUT_DIR": os.path.join(out_root, names[0]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{names} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    errors = [line for line in done.stderr.splitlines() if line.startswith(("[trainmon] ERROR", "Traceback"))]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    empty = [name for name, r in zip(names, results) if not r["files"] and SCENARIOS[name][0]]
    if errors or empty:  # a part that switched itself off would make the monitored steps look cheap
        raise RuntimeError(f"{names}: the monitor reported errors or wrote nothing ({empty}):\n{errors[:5]}")
    return [summarise(r) for r in results]


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return ""
    return "met" if value <= target else "NOT met"


def report(rows: list[tuple[str, dict]], model: str) -> None:
    reference = REFERENCE if model == "large" else REFERENCE_SMALL if model == "small" else {}
    head = (
        f"{'scenario':16s} {'wall':>6s} {'(pairs min-max)':>15s} {'cpu':>6s} {'drain':>9s} "
        f"{'peak RSS':>9s} {'growth':>14s} {'target':>7s} {'':7s} {'msprobe':>7s} {'ours/theirs':>11s} "
        f"{'neighbours':>10s}"
    )
    print(head)
    print("-" * len(head))
    for name, s in rows:
        target = TARGETS.get(name) if model == "large" else None
        ref = reference.get(name)
        share = f"{(s['wall'] - 1) / (ref - 1):11.0%}" if ref else f"{'':11s}"
        growth = f"{s['rss_growth']:+7.1f} MB {s['rss_growth'] / s['rss_base']:4.0%}"
        rss_target = RSS_TARGETS.get(name) if model == "large" else None
        verdict = _verdict(s["wall"], target)
        if rss_target is not None and s["rss_growth"] / s["rss_base"] >= rss_target:
            verdict = "NOT met"
        lo, hi = s["wall_spread"]
        print(
            f"{name:16s} {s['wall']:6.3f} {f'{lo:.2f}-{hi:.2f}':>15s} {s['cpu']:6.3f} "
            f"{s['drain_ms']:6.1f} ms {s['rss_base']:6.0f} MB {growth:>14s} "
            f"{target if target else '':>7} {verdict:7s} {ref if ref else '':>7} {share} "
            f"{s['neighbours']:10.3f}"
        )
    if "all-interval100" in dict(rows) and "all-csv" in dict(rows):
        every, sparse = dict(rows)["all-csv"]["wall"], dict(rows)["all-interval100"]["wall"]
        print(
            f"all-interval100 amortised over 100 steps (one collected step at the all-csv ratio): "
            f"{sparse + (every - 1) / 100:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: %(default)s")
    parser.add_argument("--pairs", type=int, default=12, help="pairs of blocks (unmonitored, monitored)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each block")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--ops", default=",".join(OPS), help="statistics of every scenario (default: %(default)s)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 2 pairs of 1 + 2 steps: < 60 s (CI)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.model, args.pairs, args.steps, args.warmup = "tiny", 2, 2, 1
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; expected some of {', '.join(SCENARIOS)}")
    print(
        f"model {args.model} {MODELS[args.model]}, batch {args.batch}, AdamW, 1 torch thread; "
        f"{args.pairs} pairs x ({args.warmup} warm-up + {args.steps} timed) steps per block; ops {args.ops}"
    )
    print(
        f"machine: {platform.machine()} {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; python {platform.python_version()}"
    )
    if args.quick:  # one process for the single-rank scenarios: start-up dominates otherwise
        batches = [[n for n in names if SCENARIOS[n][1] == 1], [n for n in names if SCENARIOS[n][1] > 1]]
    else:
        batches = [[n] for n in names]
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainmon-overhead-") as out_root:
        for batch in filter(None, batches):
            started = time.perf_counter()
            for name, summary in zip(batch, run_scenarios(batch, args, out_root)):
                rows.append((name, summary))
                print(
                    f"  {name}: {summary['wall']:.3f}x ({summary['parameters']:,} parameters, "
                    f"{summary['step_s'] * 1000:.0f} ms/step plain)",
                    flush=True,
                )
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    print()
    report(rows, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
