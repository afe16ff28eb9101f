"""The monitor's cost on a CUDA GPU: the statistics of many tensors, and whole training steps.

Needs a CUDA device (it refuses to run without one); the CPU benchmarks (overhead.py,
scaling.py) measure process CPU time, which on a GPU says little: here the host launches work
and waits, so the cost is wall time with the device synchronised at each step's end.

"stats": ``stat_matrix`` + the one device-to-host copy over N float32 tensors that hold 64M
elements together (a model's gradients), per call: the host's time to issue the work ("host",
what delays the training thread) and the time until the values are on the host ("ready"); with
``torch._foreach_norm`` alone (what gradient clipping spends) as the floor.

"dispatch" (no GPU needed): the same device ops on CPU tensors, for the host's cost of issuing
them per tensor, which does not depend on a GPU.

"steps": a GPT-like model (about 200M parameters, bf16 autocast, AdamW) trained in alternating
unmonitored (A) and monitored (B) blocks, A B B A ..., as overhead.py does; per pair the ratio
of median step times B/A, the median over pairs reported with its spread, and the peak of
allocated device memory in B blocks over A blocks. "many": the same for N/2 Linear(64, 64)
layers summed (N parameter tensors), in microseconds per tensor and step. "profile": torch's
profiler over monitored GPT steps of each scenario, the ops by host and by device time and the
host's waits for the device (not part of the default run).

    python benchmarks/overhead_cuda.py                     # everything
    python benchmarks/overhead_cuda.py --parts stats --json out.json
    python benchmarks/overhead_cuda.py --parts dispatch                # no GPU needed
    python benchmarks/overhead_cuda.py --parts profile --scenarios xy  # where a step's time goes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from blocks import EVERYTHING_WITH_ALERTS, pairs_of  # noqa: E402
from blocks import alternate as alternate_blocks  # noqa: E402
from torch import nn  # noqa: E402

OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
SCENARIOS = {
    "wg": {"wg_distribution": True},
    "mv": {"mv_distribution": True},
    "param": {"param_distribution": True},
    "xy": {"xy_distribution": True, "all_xy": True},
    "all": EVERYTHING_WITH_ALERTS,
}
#: about 200M parameters; a step of batch 8 takes tens of milliseconds on an H200
GPT = {"vocab": 32768, "hidden": 1024, "heads": 16, "layers": 12, "seq": 512}
OUTPUT = os.environ.get("MONITOR_OUTPUT_DIR") or tempfile.mkdtemp(prefix="trainmon-cuda-")


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def stat_costs(counts: list[int], elements: int = 1 << 26, repeats: int = 7) -> list[dict]:
    """Per tensor count: host and ready times of one stat_matrix call, and of _foreach_norm."""
    from adapters.torch.stats import stat_matrix, to_host

    rows = []
    for count in counts:
        generator = torch.Generator(device="cuda").manual_seed(count)
        size = elements // count
        tensors = [torch.randn(size, device="cuda", generator=generator) for _ in range(count)]
        timings: dict[str, list[float]] = {"host": [], "ready": [], "floor": []}
        for repeat in range(repeats + 2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            values, fetch = to_host(stat_matrix(tensors, OPS))
            issued = time.perf_counter()
            values = fetch() if values is None else values
            ready = time.perf_counter()
            torch.cuda.synchronize()
            floor = time.perf_counter()
            torch.stack(torch._foreach_norm(tensors, 2)).cpu()
            floor_done = time.perf_counter()
            if repeat >= 2:
                timings["host"].append(issued - started)
                timings["ready"].append(ready - started)
                timings["floor"].append(floor_done - floor)
        row = {"tensors": count, **{k: _median_ms(v) for k, v in timings.items()}}
        row["host_us_per_tensor"] = 1000 * row["host"] / count
        rows.append(row)
        print(
            f"stats  {count:6d} tensors: host {row['host']:8.2f} ms"
            f" ({row['host_us_per_tensor']:5.1f} us each)  ready {row['ready']:8.2f} ms"
            f"  foreach_norm {row['floor']:6.2f} ms",
            flush=True,
        )
        del tensors
    return rows


def dispatch_costs(counts: list[int], repeats: int = 5) -> list[dict]:
    """The accelerator path's host cost per tensor, its device ops run on CPU tensors: without
    a GPU this is the part of the cost that does not depend on one (what torch spends to issue
    each operation). N tensors, half of 256 elements and half of 16 (weights and biases)."""
    from adapters.torch.device_stats import device_block

    torch.set_num_threads(1)
    rows = []
    for count in counts:
        tensors = [torch.randn(256 if i % 2 else 16) for i in range(count)]
        device_block(tensors, tuple(OPS), 1e-8)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            device_block(tensors, tuple(OPS), 1e-8)
            samples.append(time.perf_counter() - started)
        row = {"tensors": count, "host": _median_ms(samples)}
        row["host_us_per_tensor"] = 1000 * row["host"] / count
        rows.append(row)
        print(
            f"dispatch {count:6d} tensors (CPU): {row['host']:8.2f} ms"
            f" ({row['host_us_per_tensor']:5.2f} us each)",
            flush=True,
        )
    return rows


class ManyLinears(nn.Module):
    """N/2 Linear(64, 64) applied to one input and summed: N parameter tensors."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(tensors // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def alternate(label: str, model: nn.Module, loss_of, config: dict, pairs: int, steps: int) -> dict:
    """Ratios of step times (B/A) per pair of neighbouring blocks (benchmarks/blocks.py, wall
    time with the device synchronised at each step's end) and the peak device memory of B over
    A; the monitor writes under ``label`` in the output directory."""
    from monitor import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(OUTPUT, label)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def attach() -> TrainerMon:
        mon = TrainerMon({"targets": {}, "ops": OPS, **config})
        mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
        return mon

    peaks: dict[bool, list[int]] = {False: [], True: []}
    last: list[bool] = []

    def block_boundary(monitored: bool | None) -> None:  # the peak of the block that ended
        if last:
            peaks[last.pop()].append(torch.cuda.max_memory_allocated())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if monitored is not None:
            last.append(monitored)

    blocks, _ = alternate_blocks(step, attach, pairs, steps, time.perf_counter, block_boundary)
    block_boundary(None)
    measured = pairs_of(blocks)
    ratios = [watched / plain for plain, watched in measured]
    return {
        "ratio": statistics.median(ratios),
        "spread": [min(ratios), max(ratios)],
        "extra_ms": 1000 * statistics.median(watched - plain for plain, watched in measured),
        "step_ms": _median_ms([plain for plain, _ in measured]),
        "peak_growth": max(peaks[True]) / max(peaks[False]) - 1,
    }


def gpt_steps(names: list[str], pairs: int, steps: int) -> dict:
    from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch

    cfg = GPTConfig(**GPT)
    torch.manual_seed(0)
    model = TinyGPT(cfg).cuda()
    tokens, targets = (t.cuda() for t in synthetic_batch(cfg, 8, torch.Generator().manual_seed(0)))

    def loss_of(m: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(m(tokens).reshape(-1, cfg.vocab).float(), targets.reshape(-1))

    results = {}
    params = sum(p.numel() for p in model.parameters())
    for name in names:
        r = results[name] = alternate(f"gpt-{name}", model, loss_of, SCENARIOS[name], pairs, steps)
        print(
            f"steps  GPT {params / 1e6:.0f}M {name:6s}: {r['ratio']:.3f}"
            f" ({r['spread'][0]:.3f}-{r['spread'][1]:.3f})  +{r['extra_ms']:6.2f} ms"
            f" on {r['step_ms']:6.1f} ms  peak memory {r['peak_growth']:+.1%}",
            flush=True,
        )
    return results


def profile_steps(names: list[str], steps: int) -> dict:
    """Where a monitored GPT step's time goes, per scenario (``profile_one``)."""
    return {name: profile_one(name, steps) for name in names}


def profile_one(name: str, steps: int, top: int = 25) -> dict:
    """torch's profiler over ``steps`` collected steps of the GPT with scenario ``name`` (CPU and
    CUDA activities): the ops by their own host time and by their device time, and the host's
    waits for the device (synchronisations, values read back), printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch
    from monitor import TrainerMon

    cfg = GPTConfig(**GPT)
    torch.manual_seed(0)
    model = TinyGPT(cfg).cuda()
    tokens, targets = (t.cuda() for t in synthetic_batch(cfg, 8, torch.Generator().manual_seed(0)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(OUTPUT, f"profile-{name}")
    mon = TrainerMon({"targets": {}, "ops": OPS, **SCENARIOS[name]})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens).reshape(-1, cfg.vocab).float()
        nn.functional.cross_entropy(logits, targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    mon.stop()
    averages = prof.key_averages()
    device_time = "self_device_time_total"
    by_host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_device = sorted(averages, key=lambda e: getattr(e, device_time, 0), reverse=True)[:top]
    waiting = ("synchronize", "_local_scalar_dense", "item")
    waits = [e for e in averages if any(word in e.key.lower() for word in waiting)]
    print(f"profile {name}: {steps} steps", flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
    print(averages.table(sort_by=device_time, row_limit=top), flush=True)
    return {
        "host_ms": {e.key: e.self_cpu_time_total / 1000 / steps for e in by_host},
        "device_ms": {e.key: getattr(e, device_time, 0) / 1000 / steps for e in by_device},
        "calls_per_step": {e.key: e.count / steps for e in by_host},
        "waits_per_step": {e.key: e.count / steps for e in waits},
    }


def many_steps(counts: list[int], names: list[str], pairs: int, steps: int) -> dict:
    results = {}
    for count in counts:
        torch.manual_seed(0)
        model = ManyLinears(count).cuda()
        x = torch.randn(256, 64, device="cuda")

        def loss_of(m: nn.Module, x: torch.Tensor = x) -> torch.Tensor:
            return m(x).pow(2).mean()

        for name in names:
            r = alternate(f"{count}-{name}", model, loss_of, SCENARIOS[name], pairs, steps)
            r["us_per_tensor"] = 1000 * r["extra_ms"] / count
            results[f"{count}/{name}"] = r
            print(
                f"many   {count:6d} tensors {name:6s}: {r['ratio']:.3f}  +{r['extra_ms']:7.2f} ms on"
                f" {r['step_ms']:7.2f} ms = {r['us_per_tensor']:5.1f} us a tensor",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        help="comma-separated, of: dispatch (CPU), stats, steps, many, profile (default: stats,steps,many)",
    )
    parser.add_argument("--counts", default="77,400,2000,8000", help="tensor counts of 'stats' and 'many'")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="of 'steps': %(default)s")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    parts = (args.parts or "stats,steps,many").split(",")
    if set(parts) - {"dispatch"} and not torch.cuda.is_available():
        parser.error("no CUDA device: only --parts dispatch runs without a GPU")
    counts = [int(c) for c in args.counts.split(",")]
    if torch.cuda.is_available():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results: dict = {}
    if "dispatch" in parts:
        results["dispatch"] = dispatch_costs(counts)
    if "stats" in parts:
        results["stats"] = stat_costs(counts)
    if "steps" in parts:
        results["steps"] = gpt_steps(args.scenarios.split(","), args.pairs, args.steps)
    if "profile" in parts:
        results["profile"] = profile_steps(args.scenarios.split(","), args.steps)
    if "many" in parts:
        results["many"] = many_steps([c for c in counts if c >= 2000], ["wg", "all"], args.pairs, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
