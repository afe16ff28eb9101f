"""Does anomaly detection find injected faults at their step, and how often do clean runs raise alarms?

Each case of a matrix (benchmarks/faults.py: the ``gpt`` and ``mlp`` families, AdamW and SGD,
clipping on and off, 1 and 2 micro-batches, a few seeds; every fault at a step between 50% and
70% of the run, and clean runs) is trained once per rule set of RULE_SETS with TrainerMon
attached (the same data types and ops each time; only the alert rules differ; training is
deterministic, so every rule set sees the same run). ``score`` reads the run's
``anomaly_detected/rank*/anomaly.json``: records in all, the first anomaly step, whether the
fault step has a record, records before the fault step (false alarms of a faulty run) and, for
clean runs, the records (false alarms). ``--ranks 4`` adds 4-rank gloo DDP cases of the
one-rank faults and a few others. One-process cases run ``--jobs`` at a time; DDP cases one at a
time (each spawns its ranks).

"msprobe-1.2.2" is AnomalyTurbulence with msprobe 1.2.2's semantics, which reproduce its verdicts
bit for bit: its false alarms stand for msprobe's own.

    python benchmarks/incidents.py --out results.json          # 2 seeds, 100 steps (~15 min)
    python benchmarks/incidents.py --ranks 4 --out results.json  # and the DDP cases (+~20 min)
    python benchmarks/incidents.py --quick                     # a handful of cases, ~2 min (CI)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import glob
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from faults import FAULTS, ONE_RANK_FAULTS, Case, run_case  # noqa: E402

DATA = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"],
    "format": "csv",
}
RULE_SETS = {
    "recommended": {
        **DATA,
        "alert": {
            "rules": [
                {"rule_name": "AnomalyNan"},
                {
                    "rule_name": "AnomalyZScore",
                    "args": {"threshold": 6.0, "warmup": 10, "min_ratio": 5.0, "ops": ["norm"]},
                },
            ],
            "dump": True,
        },
    },
    "msprobe-doc": {
        **DATA,
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
    },
    "msprobe-1.2.2": {
        **DATA,
        "alert": {
            "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "semantics": "1.2.2"}}],
            "dump": True,
        },
    },
}
#: the faults of the DDP part besides the one-rank faults
DDP_OTHERS = ("loss_x100", "grad_after_backward", "dead_layer")


def fault_step(steps: int, seed: int) -> int:
    """50%, 60% or 70% of the run by seed: after the warm-up, with steps left to see the aftermath."""
    return steps * (5 + seed % 3) // 10


def matrix(args: argparse.Namespace) -> list[Case]:
    """The cases to run: every setting with every fault and a clean run; then the DDP part."""
    cases = []
    for family in ("gpt", "mlp"):
        for optimizer in ("adamw", "sgd"):
            for clip in (False, True):
                for grad_acc in (1, 2):
                    for seed in range(args.seeds):
                        at = fault_step(args.steps, seed)
                        setting = (family, optimizer, clip, grad_acc, seed)
                        cases.append(Case(*setting, None, 0, args.clean_steps))
                        cases += [Case(*setting, fault, at, args.steps) for fault in FAULTS]
    if args.ranks > 1:
        for family in ("gpt", "mlp"):
            at = fault_step(args.steps, 0)
            cases.append(Case(family, "adamw", False, 2, 0, None, 0, args.clean_steps, args.ranks))
            for fault in (*ONE_RANK_FAULTS, *DDP_OTHERS):
                cases.append(Case(family, "adamw", False, 2, 0, fault, at, args.steps, args.ranks))
    return cases


def quick_matrix() -> list[Case]:
    """A handful of short cases: each family, both optimizers, clipping, accumulation, one DDP case."""
    gpt = ("gpt", "adamw", False, 1, 0)
    mlp = ("mlp", "sgd", True, 2, 0)
    return [
        *(Case(*gpt, fault, 20, 30) for fault in (None, "loss_x1000", "nan_activation", "dead_layer")),
        *(Case(*mlp, fault, 20, 30) for fault in (None, "grad_after_backward", "lr_x100", "bad_batch")),
        Case("mlp", "adamw", False, 2, 0, "grad_before_reduce", 20, 30, ranks=4),
    ]


def load_records(anomaly_dir: str) -> list[dict]:
    """Every rank's anomaly.json records, ordered by step, rank and call_id."""
    records = []
    for path in glob.glob(os.path.join(anomaly_dir, "rank*", "anomaly.json")):
        with open(path) as handle:
            records += json.load(handle).values()
    return sorted(records, key=lambda r: (r["step"], r.get("rank", 0), r.get("call_id", 0)))


def score(case: Case, summary: dict) -> dict:
    """Record-based score of one run (to be replaced by incident-based scoring)."""
    records = load_records(summary["anomaly_dir"])
    steps = sorted({r["step"] for r in records})
    result = {"records": len(records), "first_step": steps[0] if steps else None}
    if summary["expected"] is None:
        result["false_alarms"] = len(records)
        result["alarm_steps"] = len(steps)
        return result
    at = summary["expected"]["step"]
    result["detected"] = at in steps
    result["first_is_fault_step"] = bool(steps) and steps[0] == at
    result["before_fault"] = sum(r["step"] < at for r in records)
    result["at_fault"] = sum(r["step"] == at for r in records)
    return result


def run_one(case: Case, rule_set: str, keep: str | None) -> dict:
    """Train and score one (case, rule set); an exception is reported, not raised."""
    root = tempfile.mkdtemp(prefix="trainmon-incidents-", dir=keep)
    row: dict = {"case": dataclasses.asdict(case), "rule_set": rule_set, "error": None}
    try:
        summary = run_case(case, RULE_SETS[rule_set], root, quiet=True)
        row.update(score=score(case, summary), seconds=summary["seconds"], log=summary["log"])
        if any(log["errors"] for log in summary["log"]):
            row["error"] = "the monitor logged errors: " + "; ".join(summary["log"][0]["messages"])
    except Exception:
        row["error"] = traceback.format_exc()
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
    else:
        row["output"] = root
    return row


def run_all(cases: list[Case], rule_sets: list[str], jobs: int, keep: str | None) -> list[dict]:
    """One-process cases ``jobs`` at a time, then the DDP cases one by one; prints progress."""
    tasks = [(case, name) for case in cases for name in rule_sets]
    single = [task for task in tasks if task[0].ranks == 1]
    multi = [task for task in tasks if task[0].ranks > 1]
    rows: list[dict] = []

    def done(row: dict) -> None:
        rows.append(row)
        mark = "CRASH" if row["error"] else "ok"
        print(f"  [{len(rows)}/{len(tasks)}] {mark} {row['rule_set']} {_label(row['case'])}", flush=True)

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for future in concurrent.futures.as_completed([pool.submit(run_one, *t, keep) for t in single]):
            done(future.result())
    for task in multi:
        done(run_one(*task, keep))
    return rows


def _label(case: dict) -> str:
    clip = "clip" if case["clip"] else "noclip"
    where = f" @{case['fault_step']}" if case["fault"] else ""
    return (
        f"{case['family']} {case['optimizer']} {clip} acc{case['grad_acc']} seed{case['seed']} "
        f"x{case['ranks']} {case['fault'] or 'clean'}{where} ({case['steps']} steps)"
    )


def report(rows: list[dict], rule_sets: list[str]) -> None:
    """One table per rule set: a line per (ranks, fault)."""
    for name in rule_sets:
        print(f"\nrule set {name}")
        print(
            f"  {'ranks':>5s} {'fault':20s} {'runs':>4s} {'crash':>5s} {'found@step':>10s} "
            f"{'first@step':>10s} {'early recs':>10s} {'recs@step':>9s} {'recs (median)':>13s}"
        )
        groups: dict[tuple[int, str], list[dict]] = {}
        for row in rows:
            if row["rule_set"] == name:
                groups.setdefault((row["case"]["ranks"], row["case"]["fault"] or ""), []).append(row)
        for (ranks, fault), group in sorted(groups.items()):
            scored = [row["score"] for row in group if "score" in row]
            crashes = sum(row["error"] is not None for row in group)
            line = f"  {ranks:5d} {fault or 'clean':20s} {len(group):4d} {crashes:5d} "
            if not scored:
                print(line)
                continue
            median = statistics.median(s["records"] for s in scored)
            if not fault:
                alarmed = sum(s["records"] > 0 for s in scored)
                steps = sum(row["case"]["steps"] for row in group if "score" in row)
                total = sum(s["false_alarms"] for s in scored)
                print(
                    line + f"false alarms: {alarmed}/{len(scored)} runs, {total} records "
                    f"({100 * total / steps:.2f} per 100 steps), median {median:g}"
                )
                continue
            found = sum(s["detected"] for s in scored)
            first = sum(s["first_is_fault_step"] for s in scored)
            early = statistics.mean(s["before_fault"] for s in scored)
            at = statistics.median(s["at_fault"] for s in scored)
            print(
                line + f"{f'{found}/{len(scored)}':>10s} {f'{first}/{len(scored)}':>10s} "
                f"{early:10.1f} {at:9g} {median:13g}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of a faulty run")
    parser.add_argument("--clean-steps", type=int, help="steps of a clean run (default: --steps)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1, help="above 1: add DDP cases with this many ranks")
    parser.add_argument("--rule-sets", default=",".join(RULE_SETS), help="comma-separated: %(default)s")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="one-process cases at a time")
    parser.add_argument("--keep", help="keep every run's output under this directory")
    parser.add_argument("--out", help="write every run's score as JSON here")
    parser.add_argument("--quick", action="store_true", help="9 short cases (one with 4 ranks), ~2 min (CI)")
    args = parser.parse_args(argv)
    args.clean_steps = args.clean_steps or args.steps
    names = [n.strip() for n in args.rule_sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in RULE_SETS]
    if unknown:
        parser.error(f"--rule-sets: unknown {unknown}; expected some of {', '.join(RULE_SETS)}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    cases = quick_matrix() if args.quick else matrix(args)
    print(f"{len(cases)} cases x {len(names)} rule sets, {args.jobs} at a time", flush=True)
    started = time.perf_counter()
    rows = run_all(cases, names, args.jobs, args.keep)
    report(rows, names)
    crashed = [row for row in rows if row["error"]]
    for row in crashed[:5]:
        print(f"\nCRASH {row['rule_set']} {_label(row['case'])}:\n{row['error'][-2000:]}")
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; {len(crashed)} crashed")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
        print(f"written to {args.out}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
