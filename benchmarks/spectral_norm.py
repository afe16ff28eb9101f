"""Accuracy and cost of the l2 features' spectral norms (``linear_hook``) on a model trained from
scratch, against ``torch.linalg.matrix_norm(ord=2)``.

The benchmarks' 6.9M GPT-like model trains with AdamW; at every ``--interval``-th step each of
its 25 linear weights is measured as a collection measures it (adapters.torch.l2.L2Features,
started from its last collected step's top vector mixed with a random one). Early training is
the hard case: the top singular values of a near-random weight lie within a few percent of each
other, and a new, larger one can rise in a direction the last top vector barely holds. Printed:
the worst relative error, the Lanczos steps of the later collected steps (mean, 90th percentile,
most) and the time of a collected step's spectral norms.

    python benchmarks/spectral_norm.py                          # lr 1e-3, every step, 60 steps
    python benchmarks/spectral_norm.py --lr 1e-3 --interval 10 --steps 300

The hardest case for a warm start is a weight that changed entirely since the last collected
step: ``--redrawn 256,512,1024`` re-draws a square Gaussian weight of each size before every
collected step (its top singular values crowd together, and the last top vector is no help) and
prints the worst error and the share of steps more than 1% low.

    python benchmarks/spectral_norm.py --redrawn 256,512,1024 --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adapters.torch.l2 as torch_l2
from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch
from monitor.config.schema import load_config


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--interval", type=int, default=1, help="collect every this many steps")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--redrawn", default="", help="sizes of square Gaussian weights re-drawn each step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.redrawn:
        for size in (int(s) for s in args.redrawn.split(",")):
            redrawn(size, args.steps)
        return 0
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=4096, hidden=256, heads=4, layers=6, seq=128)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(cfg, 8, generator) for _ in range(8)]
    config = load_config({"recording_l2_features": True, "l2_targets": {"linear_hook": []}})
    features = torch_l2.L2Features([model], config, lambda what, exc: print(what, exc))
    lanczos, applications = torch_l2.lanczos, []

    def counted(apply, start, min_steps):
        calls = [0]

        def counting(v: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return apply(v)

        result = lanczos(counting, start, min_steps)
        applications.extend([calls[0]] * start.shape[0])  # one batch: each of its weights ran them
        return result

    torch_l2.lanczos = counted
    worst, seconds, collected = 0.0, 0.0, 0
    for step in range(args.steps):
        tokens, targets = batches[step % len(batches)]
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, cfg.vocab), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.interval:
            continue
        start = time.perf_counter()
        _, values = features.linear_values(0)
        seconds += time.perf_counter() - start
        collected += 1
        with torch.no_grad():
            for index, (_, _, module) in enumerate(features.linear):
                exact = torch.linalg.matrix_norm(torch_l2.linear_weight(module).float(), 2).item()
                worst = max(worst, abs(values[index, 0].item() - exact) / exact)
    warm = np.array(applications[len(features.linear) :])
    print(
        f"lr {args.lr:g}, every {args.interval} step(s), {collected} collected: worst relative error "
        f"{worst:.1e}; warm Lanczos steps mean {warm.mean():.1f}, p90 {np.percentile(warm, 90):.0f}, "
        f"max {warm.max()}; {seconds / collected * 1e3:.1f} ms a collected step "
        f"({len(features.linear)} weights)"
    )
    return 0


def redrawn(size: int, steps: int) -> None:
    """One Linear(size, size) whose weight is re-drawn before each collected step, measured as a
    collection measures it, against ``torch.linalg.matrix_norm``."""
    torch.manual_seed(size)
    layer = nn.Linear(size, size, bias=False)
    config = load_config({"recording_l2_features": True, "l2_targets": {"linear_hook": []}})
    features = torch_l2.L2Features([layer], config, lambda what, exc: print(what, exc))
    errors = []
    for _ in range(steps):
        with torch.no_grad():
            layer.weight.normal_()
        _, values = features.linear_values(0)
        exact = torch.linalg.matrix_norm(layer.weight.detach(), 2).item()
        errors.append((exact - values[0, 0].item()) / exact)
    errors = np.array(errors)
    print(
        f"re-drawn {size} x {size}, {steps} steps: worst {errors.max():.2%} low, "
        f"{(errors > 0.01).mean():.1%} of steps more than 1% low"
    )


if __name__ == "__main__":
    sys.exit(main())
