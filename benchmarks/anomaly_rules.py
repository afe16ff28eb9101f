"""False-positive rates of the anomaly rules on stationary noise (the figures in rules.py).

Feeds TAGS x STEPS values of i.i.d. noise through each rule (vectorised over tags, as the detector
does) and prints, per rule configuration and noise, flagged / judged values (a value is judged
once the rule's warm-up is over). Noise: lognormal with log-sd 0.1 and 0.5, and a heavy-tailed
"log-t3" (exp of 0.5 x Student t with 3 degrees of freedom). Defaults: 100 tags x 10,000 steps.

    python benchmarks/anomaly_rules.py [--tags 100] [--steps 10000] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np

from monitor.anomaly.rules import AnomalyTurbulence, AnomalyZScore, RunningMeanTurbulence

CONFIGS = (
    ("AnomalyZScore defaults (threshold 6, min_ratio 4)", lambda: AnomalyZScore()),
    ("AnomalyZScore min_ratio 5", lambda: AnomalyZScore(min_ratio=5.0)),
    ("AnomalyZScore threshold 4", lambda: AnomalyZScore(threshold=4.0)),
    ("AnomalyZScore threshold 4, min_ratio 1", lambda: AnomalyZScore(threshold=4.0, min_ratio=1.0)),
    ("AnomalyZScore threshold 3, min_ratio 1", lambda: AnomalyZScore(threshold=3.0, min_ratio=1.0)),
    (
        "AnomalyZScore threshold 4, min_ratio 1, beta 0.99",
        lambda: AnomalyZScore(4.0, min_ratio=1.0, beta=0.99),
    ),
    ("AnomalyTurbulence threshold 0.5", lambda: AnomalyTurbulence(threshold=0.5, ops=("norm",))),
    ("AnomalyTurbulence threshold 0.5 two_sided", lambda: AnomalyTurbulence(0.5, ("norm",), two_sided=True)),
    ("AnomalyTurbulence 1.2.2 threshold 0.5", lambda: RunningMeanTurbulence(threshold=0.5)),
)


def noise(kind: str, tags: int, steps: int, seed: int) -> np.ndarray:
    """(steps, tags, 1) positive values."""
    rng = np.random.default_rng(seed)
    if kind == "log-t3 s=0.5":
        return np.exp(0.5 * rng.standard_t(3, size=(steps, tags, 1)))
    sigma = float(kind.rsplit("=", 1)[1])
    return rng.lognormal(0.0, sigma, size=(steps, tags, 1))


def false_positive_rate(rule, series: np.ndarray) -> float:
    """Flagged / judged values of a rule over a (steps, tags, 1) series."""
    state = {name: np.full(series.shape[1:], fill) for name, fill in rule.fields.items()}
    flagged = judged = 0
    for values in series:
        mask, _ = rule.apply(values, state, ("norm",))
        flagged += int(mask.sum())
        judged += int((state["count"] >= rule.warmup).sum())
        learns = getattr(rule, "learns_from_verdicts", False)  # as the detector feeds it
        state = rule.update(values, state, mask) if learns else rule.update(values, state)
    return flagged / max(judged, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = ("lognormal s=0.1", "lognormal s=0.5", "log-t3 s=0.5")
    series = {kind: noise(kind, args.tags, args.steps, args.seed) for kind in kinds}
    print(f"false-positive rate, {args.tags} tags x {args.steps} steps, seed {args.seed}")
    print(f"{'rule':52s}" + "".join(f"{kind:>17s}" for kind in kinds))
    for label, make in CONFIGS:
        rates = [false_positive_rate(make(), series[kind]) for kind in kinds]
        print(f"{label:52s}" + "".join(f"{rate:17.2e}" for rate in rates))


if __name__ == "__main__":
    main()
