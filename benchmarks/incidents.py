"""Does anomaly detection find injected faults at their step, and how often do clean runs raise alarms?

Each case of a matrix (benchmarks/faults.py: the ``gpt`` and ``mlp`` families, AdamW and SGD,
clipping on and off, 1 and 2 micro-batches, a few seeds; every fault at a step between 50% and
70% of the run, and clean runs) is trained once per rule set of RULE_SETS with TrainerMon
attached (the same data types and ops each time; only the alert rules differ; training is
deterministic, so every rule set sees the same run). ``score`` reads the run's
``anomaly_detected/rank*/anomaly.json``: records in all, the first anomaly step, whether the
fault step has a record, records before the fault step (false alarms of a faulty run) and, for
clean runs, the records (false alarms). ``--ranks 4`` adds 4-rank gloo DDP cases of the
one-rank faults and a few others, in two settings (DDP_SETTINGS); ``--seeds 0`` leaves only
them. One-process cases run ``--jobs`` at a time; DDP cases one at a time (each spawns its ranks).

"msprobe-1.2.2" is AnomalyTurbulence with msprobe 1.2.2's semantics, which reproduce its verdicts
bit for bit: its false alarms stand for msprobe's own.

    python benchmarks/incidents.py --out results.json          # 2 seeds, 100 steps (~15 min)
    python benchmarks/incidents.py --ranks 4 --out results.json  # and the DDP cases (+~20 min)
    python benchmarks/incidents.py --quick                     # a handful of cases, ~2 min (CI)

The exit status is 1 when a run crashed or the recommended rules miss a target (every fault
detected at its step and first, the root named in 90% of targeted faults, no false incident, a NaN
that stays written once per tag). Tables and targets: benchmarks/incident_report.py.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from blocks import RECOMMENDED_RULES  # noqa: E402
from faults import FAULTS, ONE_RANK_FAULTS, Case, run_case  # noqa: E402
from incident_report import missed_targets, report, run_label  # noqa: E402

from monitor.anomaly import incident_files  # noqa: E402
from monitor.anomaly.detector import Detector  # noqa: E402

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
            "rules": RECOMMENDED_RULES,
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
#: (optimizer, clipping, micro-batches, seed) of the DDP part: a clean run of each per family, and
#: each fault under one of them, the other for the other family, so that both optimizers, clipping
#: on and off, accumulation and two seeds are seen under DDP without running every combination
DDP_SETTINGS = (("adamw", False, 2, 0), ("sgd", True, 1, 1))


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
        for turn, family in enumerate(("gpt", "mlp")):
            for setting in DDP_SETTINGS:
                cases.append(Case(family, *setting, None, 0, args.clean_steps, args.ranks))
            for number, fault in enumerate((*ONE_RANK_FAULTS, *DDP_OTHERS)):
                setting = DDP_SETTINGS[(number + turn) % len(DDP_SETTINGS)]
                cases.append(
                    Case(family, *setting, fault, fault_step(args.steps, setting[-1]), args.steps, args.ranks)
                )
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
    """Every rank's anomaly.json records."""
    records = []
    for path in glob.glob(os.path.join(anomaly_dir, "rank*", "anomaly.json")):
        with open(path) as handle:
            records += json.load(handle).values()
    return records


def load_merged(anomaly_dir: str) -> list:
    """The run's incidents, merged across ranks as anomaly-analyse merges them."""
    paths = sorted(glob.glob(os.path.join(anomaly_dir, "rank*", incident_files.INCIDENTS_NAME)))
    return incident_files.merge(incident_files.load_incidents(paths))


def score(case: Case, summary: dict, cells: int | None) -> dict:
    """Score one run from what the monitor wrote: its records and its incidents merged over ranks.

    Faulty runs: ``detected`` (a record at the fault step; an LR blow-up: at it or the next),
    ``first_incident`` (the first incident starts there), ``root_module`` / ``root_rank`` (the
    first incident's root names the injected module / rank; None where the fault has none),
    ``early_incidents`` (incidents before the fault), ``most_records_per_tag`` (a NaN that stays:
    one). Clean runs: ``false_incidents``. Both: ``records`` written and, for one-process runs,
    the abnormal ``cells`` the rules judged (what
    msprobe prints a line for, each step).
    """
    records = load_records(summary["anomaly_dir"])
    merged = load_merged(summary["anomaly_dir"])
    per_tag = collections.Counter((r["rank"], r["tag_name"]) for r in records)
    result: dict = {
        "records": len(records),
        "incidents": len(merged),
        "cells": cells,
        "most_records_per_tag": max(per_tag.values(), default=0),
    }
    if summary["expected"] is None:
        result["false_incidents"] = len(merged)
        return result
    expected = summary["expected"]
    onsets = {expected["step"], expected["step"] + 1} if case.fault == "lr_x100" else {expected["step"]}
    first = merged[0] if merged else None
    result["detected"] = any(r["step"] in onsets for r in records)
    result["first_incident"] = first is not None and first.onset_step in onsets
    result["early_incidents"] = sum(m.onset_step < expected["step"] for m in merged)
    root = first.root if first is not None and result["first_incident"] else {}
    tag = str(root.get("tag_name", ""))
    result["root_tag"] = tag or None
    result["root_module"] = (
        any(f":{module}" in tag or f".{module}" in tag for module in expected["modules"])
        if expected["modules"]
        else None
    )
    result["root_rank"] = root.get("rank") == expected["rank"] if expected["rank"] is not None else None
    return result


class _CellCounter:
    """Counts the abnormal cells the detector finds in this process (one-process runs only)."""

    def __init__(self) -> None:
        self.cells = 0
        self._judge = Detector.judge

    def __enter__(self) -> _CellCounter:
        judge = self._judge

        def counting(detector, record):
            verdicts = judge(detector, record)
            self.cells += len(verdicts)
            return verdicts

        Detector.judge = counting
        return self

    def __exit__(self, *exc: object) -> None:
        Detector.judge = self._judge


def run_one(case: Case, rule_set: str, keep: str | None) -> dict:
    """Train and score one (case, rule set); an exception is reported, not raised."""
    root = tempfile.mkdtemp(prefix="trainmon-incidents-", dir=keep)
    row: dict = {"case": dataclasses.asdict(case), "rule_set": rule_set, "error": None}
    try:
        counter = _CellCounter() if case.ranks == 1 else contextlib.nullcontext()
        with counter:
            summary = run_case(case, RULE_SETS[rule_set], root, quiet=True)
        cells = counter.cells if case.ranks == 1 else None
        row.update(score=score(case, summary, cells), seconds=summary["seconds"], log=summary["log"])
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
        print(f"  [{len(rows)}/{len(tasks)}] {mark} {row['rule_set']} {run_label(row['case'])}", flush=True)

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for future in concurrent.futures.as_completed([pool.submit(run_one, *t, keep) for t in single]):
            done(future.result())
    for task in multi:
        done(run_one(*task, keep))
    return rows


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
    parser.add_argument("--families", help="only these model families, comma-separated (gpt, mlp)")
    parser.add_argument("--faults", help="only these faults, comma-separated ('clean' for the clean runs)")
    args = parser.parse_args(argv)
    args.clean_steps = args.clean_steps or args.steps
    names = [n.strip() for n in args.rule_sets.split(",") if n.strip()]
    unknown = [n for n in names if n not in RULE_SETS]
    if unknown:
        parser.error(f"--rule-sets: unknown {unknown}; expected some of {', '.join(RULE_SETS)}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    cases = quick_matrix() if args.quick else matrix(args)
    if args.families:
        cases = [c for c in cases if c.family in args.families.split(",")]
    if args.faults:
        cases = [c for c in cases if (c.fault or "clean") in args.faults.split(",")]
    print(f"{len(cases)} cases x {len(names)} rule sets, {args.jobs} at a time", flush=True)
    started = time.perf_counter()
    rows = run_all(cases, names, args.jobs, args.keep)
    totals = report(rows, names)
    if "msprobe-1.2.2" in totals:
        # like with like: flagged (tensor, statistic, step) values, which msprobe 1.2.2 writes one
        # record each, against trainmon's flagged values (its records are fewer: one per tag
        # while it stays abnormal), on the same one-process clean runs
        reference = totals["msprobe-1.2.2"]["clean_cells"]
        for name, t in totals.items():
            if name != "msprobe-1.2.2" and reference:
                share = 100 * t["clean_cells"] / reference
                print(
                    f"{name}: {t['clean_cells']} flagged values ({share:.3f}% of "
                    f"msprobe 1.2.2's {reference} on the same one-process clean runs, "
                    f"{t['clean_one_process_steps']} steps), written as "
                    f"{t['clean_one_process_records']} records"
                )
    crashed = [row for row in rows if row["error"]]
    for row in crashed[:5]:
        print(f"\nCRASH {row['rule_set']} {run_label(row['case'])}:\n{row['error'][-2000:]}")
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; {len(crashed)} crashed")
    missed = missed_targets(totals.get("recommended"))
    for miss in missed:
        print(f"TARGET MISSED (recommended rules): {miss}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "totals": totals, "runs": rows}, indent=1))
        print(f"written to {args.out}")
    return 1 if crashed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
