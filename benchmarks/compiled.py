"""Cost of the monitor on a model whose transformer blocks are compiled with torch.compile.

Two copies of the demo GPT (same weights), each block compiled in place (inductor); the monitor
is attached to one of them before its first call. Blocks of steps alternate between the two
copies (A B B A ...), each block's CPU time per step measured as in benchmarks/blocks.py, so the
ratio watched / plain of neighbouring blocks cancels the machine's drift.

Scenarios (everything: weight gradients, moments, parameters, mg_direction, activations with
all_xy, min/max/norm/mean):

- ``collected``: every step is collected: module hooks measure on every step, which therefore
  runs the compiled blocks eagerly;
- ``uncollected``: the monitor is attached, with every hook in place, but collects only at step 0
  (a step interval longer than the run; ``collect_times`` would take the hooks off after its last
  collection, which measures an unmonitored model), so the measured steps run the compiled code,
  in which the hooks left nothing;
- ``eager-collected``: the same as ``collected`` without torch.compile, for comparison.

    python benchmarks/compiled.py            # the 0.68M model, 4 pairs (a few minutes: compiles)
    python benchmarks/compiled.py --quick    # the tiny model, 2 pairs (CI)
"""

from __future__ import annotations

import argparse
import copy
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

from blocks import EVERY_DATA_TYPE, chosen_scenarios, files_written, pairs_of, run_worker  # noqa: E402

OPS = ["min", "max", "norm", "mean"]
SCENARIOS = {
    "collected": ({"step_interval": 1}, True),
    "uncollected": ({"step_interval": 10**9}, True),
    "eager-collected": ({"step_interval": 1}, False),
}
MODELS = {
    "small": {"vocab": 1024, "hidden": 128, "heads": 4, "layers": 2, "seq": 128},
    "tiny": {"vocab": 256, "hidden": 32, "heads": 2, "layers": 2, "seq": 16},
}


def _work(scenario: str, model_size: str, pairs: int, steps: int) -> dict:
    import torch
    from torch import nn

    from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch
    from monitor import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(**MODELS[model_size])
    extra, compiled = SCENARIOS[scenario]
    plain = TinyGPT(cfg)
    watched = copy.deepcopy(plain)
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, watched)}
    mon = TrainerMon({"targets": {}, "ops": OPS, **EVERY_DATA_TYPE, **extra})
    mon.set_monitor(watched, grad_acc_steps=1, optimizer=optimizers[id(watched)])
    if compiled:
        for model in (plain, watched):
            for block in model.layers:
                block.compile()
    generator = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(cfg, 8, generator) for _ in range(4)]

    def step(model: nn.Module, i: int) -> None:
        tokens, targets = batches[i % len(batches)]
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, cfg.vocab), targets.reshape(-1))
        loss.backward()
        optimizers[id(model)].step()
        optimizers[id(model)].zero_grad(set_to_none=True)

    for i in range(3):  # compile both (watched: collected, so eager, at step 0 only)
        step(plain, i)
        step(watched, i)
    blocks = []
    for pair in range(pairs):
        for model in (plain, watched) if pair % 2 == 0 else (watched, plain):
            step(model, 0)
            cpu = time.process_time()
            for i in range(steps):
                step(model, i)
            if model is watched:
                mon.flush()
            blocks.append({"monitored": model is watched, "seconds": (time.process_time() - cpu) / steps})
    mon.stop()
    return {"blocks": blocks, "files": files_written(mon)}


def measure(scenario: str, model: str, pairs: int, steps: int, out_root: str) -> dict:
    arguments = ["--worker", scenario, "--model", model, "--pairs", str(pairs), "--steps", str(steps)]
    result = run_worker(__file__, arguments, os.path.join(out_root, scenario), scenario)
    if not result["files"]:
        raise RuntimeError(f"{scenario}: nothing written")
    pairs = pairs_of(result["blocks"])
    ratios = [watched / plain for plain, watched in pairs]
    plain_ms = 1000 * statistics.median(plain for plain, _ in pairs)
    return {"scenario": scenario, "plain_ms": plain_ms, "ratio": statistics.median(ratios), "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--pairs", type=int, default=4, help="pairs of blocks (plain, watched)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 pairs (CI)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_work(args.worker, args.model, args.pairs, args.steps)))
        return 0
    if args.quick:
        args.model, args.pairs, args.steps = "tiny", 2, 3
    scenarios = chosen_scenarios(parser, args.scenarios, SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="trainmon-compiled-") as out_root:
        results = [measure(s, args.model, args.pairs, args.steps, out_root) for s in scenarios]
    print(f"{'scenario':16s} {'plain step':>11s} {'ratio':>6s}  per pair")
    for r in results:
        pairs = " ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"{r['scenario']:16s} {r['plain_ms']:8.1f} ms {r['ratio']:6.2f}  {pairs}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
