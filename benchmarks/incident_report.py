"""The incidents benchmark's tables and targets: one table per rule set from the scored runs,
and the recommended rules' targets those runs miss (benchmarks/incidents.py)."""

from __future__ import annotations

import statistics

#: faults whose NaN stays in the weights for the rest of the run (each tag: one record)
STAYING = ("nan_activation",)


def run_label(case: dict) -> str:
    """One run in words: its setting, fault and length."""
    clip = "clip" if case["clip"] else "noclip"
    where = f" @{case['fault_step']}" if case["fault"] else ""
    return (
        f"{case['family']} {case['optimizer']} {clip} acc{case['grad_acc']} seed{case['seed']} "
        f"x{case['ranks']} {case['fault'] or 'clean'}{where} ({case['steps']} steps)"
    )


def _share(flags: list) -> str:
    judged = [f for f in flags if f is not None]
    return f"{sum(judged)}/{len(judged)}" if judged else "-"


def report(rows: list[dict], rule_sets: list[str]) -> dict:
    """One table per rule set, a line per (ranks, fault); returns the totals per rule set."""
    totals = {}
    for name in rule_sets:
        mine = [row for row in rows if row["rule_set"] == name and "score" in row]
        print(f"\nrule set {name}")
        print(
            f"  {'ranks':>5s} {'fault':20s} {'runs':>4s} {'detected':>8s} {'first inc':>9s} "
            f"{'module':>7s} {'rank':>5s} {'early inc':>9s} {'records':>8s}"
        )
        groups: dict[tuple[int, str], list[dict]] = {}
        for row in mine:
            groups.setdefault((row["case"]["ranks"], row["case"]["fault"] or ""), []).append(row)
        for (ranks, fault), group in sorted(groups.items()):
            scores = [row["score"] for row in group]
            records = statistics.median(s["records"] for s in scores)
            line = f"  {ranks:5d} {fault or 'clean':20s} {len(group):4d} "
            if not fault:
                steps = sum(row["case"]["steps"] for row in group)
                false = sum(s["false_incidents"] for s in scores)
                cells = sum(s["cells"] or 0 for s in scores)
                print(
                    line + f"false incidents {false} in {steps} steps ({1000 * false / steps:.2f} per 1,000 "
                    f"steps); records {sum(s['records'] for s in scores)}; abnormal cells {cells}"
                )
                continue
            shares = [_share([s[key] for s in scores]) for key in ("detected", "first_incident")]
            roots = [_share([s[key] for s in scores]) for key in ("root_module", "root_rank")]
            early = statistics.mean(s["early_incidents"] for s in scores)
            cells = f"{shares[0]:>8s} {shares[1]:>9s} {roots[0]:>7s} {roots[1]:>5s}"
            print(line + f"{cells} {early:9.2f} {records:8g}")
        faulty = [row["score"] for row in mine if row["case"]["fault"]]
        clean = [row for row in mine if not row["case"]["fault"]]
        targeted = [
            s["root_module"] is not False and s["root_rank"] is not False
            for s in faulty
            if s["root_module"] is not None or s["root_rank"] is not None
        ]
        totals[name] = {
            "faulty_runs": len(faulty),
            "detected": sum(s["detected"] for s in faulty),
            "first_incident": sum(s["first_incident"] for s in faulty),
            "targeted": len(targeted),
            "root_named": sum(targeted),
            "clean_steps": sum(row["case"]["steps"] for row in clean),
            "clean_one_process_steps": sum(
                row["case"]["steps"] for row in clean if row["case"]["ranks"] == 1
            ),
            "false_incidents": sum(row["score"]["false_incidents"] for row in clean),
            "clean_records": sum(row["score"]["records"] for row in clean),
            "clean_one_process_records": sum(
                row["score"]["records"] for row in clean if row["case"]["ranks"] == 1
            ),
            "clean_cells": sum(row["score"]["cells"] or 0 for row in clean),
            "nan_stays_records_per_tag": max(
                (row["score"]["most_records_per_tag"] for row in mine if row["case"]["fault"] in STAYING),
                default=0,
            ),
        }
        t = totals[name]
        print(
            f"  total: detected at the fault step {t['detected']}/{t['faulty_runs']}, first incident there "
            f"{t['first_incident']}/{t['faulty_runs']}, root named {t['root_named']}/{t['targeted']} "
            f"targeted; clean: {t['false_incidents']} false incidents in {t['clean_steps']} steps, "
            f"{t['clean_records']} records; a NaN that stays: at most {t['nan_stays_records_per_tag']} "
            "record(s) per tag"
        )
    return totals


def missed_targets(totals: dict | None) -> list[str]:
    """The recommended rules' targets that these runs miss: every fault detected at its step and
    its incident the run's first, the root named in at least 90% of targeted faults, no false
    incident in a clean run, a NaN that stays written once per tag."""
    if not totals:
        return []
    runs = totals["faulty_runs"]
    missed = [
        f"{what} in {totals[key]} of {runs} faulty runs"
        for key, what in (("detected", "detected at the fault step"), ("first_incident", "first incident"))
        if totals[key] < runs
    ]
    if totals["targeted"] and totals["root_named"] < 0.9 * totals["targeted"]:
        missed.append(f"root named in {totals['root_named']} of {totals['targeted']} targeted faults")
    if totals["nan_stays_records_per_tag"] > 1:
        missed.append(f"a NaN that stays wrote {totals['nan_stays_records_per_tag']} records for one tag")
    if totals["false_incidents"]:
        missed.append(f"{totals['false_incidents']} false incidents in {totals['clean_steps']} clean steps")
    return missed
