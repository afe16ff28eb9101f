"""``anomaly-analyse --cross-rank``: ranks whose statistics depart from their peers' (post hoc).

Reads the CSV (or live Parquet) files of every rank directory ``{time}-rank{R}-{id}/`` of one run
(rank_csv), flags the outliers (peers: a rank's value against the median of the other ranks holding
the same tensor, in units of median absolute deviations), prints them as a section after the
ranking of the detected anomalies, and writes ``OUT/cross_rank_outliers.json`` atomically.

Only like is compared with like. By default only ``grad_unreduced``: every data-parallel rank's own
gradient of the same parameter, from different data but the same distribution. ``--types`` picks
others (docs/anomalies.md says which are comparable); ``--ranks`` restricts the comparison to the ranks of
one data-parallel group when tensor parallelism gives other ranks other shards of the same name.
Pipeline stages name their own layers alike (each stage's ``layers.0``): ranks are peers only
within their stage, read from each rank's run-info file.
``--ops`` defaults to the statistics with a steady magnitude (not mean: see peers). The JSON holds
at most MAX_RECORDS outliers (earliest first), the STRONGEST farthest from their peers (a real
fault is often far stronger, and later, than a run's first outliers) and counts per rank; each
outlier has its value, the median of the other ranks (``peers_median``), the MAD unit used
(``scale``) and the deviation in those units (``deviation_mads``; ``"inf"`` for NaN/Inf values).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from monitor import memory_limit
from monitor.anomaly import analyse, peers, rank_csv, windows
from monitor.anomaly.analyse import UsageError
from monitor.anomaly.cross_rank_args import check_arguments
from monitor.files import TIME_FORMAT

OUTPUT_NAME = "cross_rank_outliers.json"
DEFAULT_TYPES = "grad_unreduced"
DEFAULT_K_MAD = 8.0
#: signed statistics near zero (mean, id) have no steady unit across a few ranks: opt-in only.
DEFAULT_OPS = "norm,min,max,zeros,nans"
#: every rank.
DEFAULT_RANKS = "[]"
#: the outliers farthest from their peers, written to the JSON file besides the earliest.
STRONGEST = 100
#: outliers written to the JSON file (earliest first); the rest are only counted.
MAX_RECORDS = 100_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cross-rank flags of ``anomaly-analyse``."""
    group = parser.add_argument_group("cross-rank outliers (with --cross-rank, -d is MONITOR_OUTPUT_DIR)")
    group.add_argument(
        "--cross-rank",
        action="store_true",
        help="also flag ranks whose CSV values depart from the other ranks' (-k caps the outliers printed)",
    )
    group.add_argument(
        "--k-mad",
        type=float,
        default=DEFAULT_K_MAD,
        metavar="K",
        help=f"median absolute deviations allowed (default {DEFAULT_K_MAD:g})",
    )
    group.add_argument(
        "--types",
        default=DEFAULT_TYPES,
        metavar="LIST",
        help=f"comma-separated data types (default {DEFAULT_TYPES})",
    )
    group.add_argument(
        "--ops",
        default=DEFAULT_OPS,
        metavar="LIST",
        help=f"comma-separated ops compared (default {DEFAULT_OPS})",
    )
    group.add_argument(
        "--ranks", default=DEFAULT_RANKS, metavar="LIST", help="Python list of ranks compared (default: all)"
    )
    example = TIME_FORMAT.replace("%", "%%")  # argparse %-formats help texts
    for flag, which in (("--start", "first"), ("--end", "last")):
        group.add_argument(
            flag,
            default=None,
            metavar="TIME",
            help=f"the {which} time tag of the run's rank directories to compare, e.g. Dec03_21-34-40 "
            f"({example}); to pick one run where -d holds several",
        )
    memory_limit.add_argument(group, memory_limit.CROSS_RANK_DEFAULT)


def flags_given(args: argparse.Namespace) -> list[str]:
    """The cross-rank flags set to other than their defaults (meaningless without --cross-rank)."""
    defaults = {
        "k_mad": DEFAULT_K_MAD,
        "types": DEFAULT_TYPES,
        "ops": DEFAULT_OPS,
        "ranks": DEFAULT_RANKS,
        "memory_limit": None,  # memory_limit.add_argument's: unset
        "start": None,
        "end": None,
    }
    return [
        "--" + name.replace("_", "-")
        for name, value in defaults.items()
        if getattr(args, name, value) != value
    ]


def _number(value: float) -> float | str:
    return float(value) if math.isfinite(value) else str(float(value))


_FIELDS = ("type", "step", "micro", "label", "op", "rank", "value", "peers", "scale", "score")


def records(
    out: peers.Outliers, limit: int | None = None, strongest: bool = False
) -> list[dict[str, object]]:
    """The outliers, earliest first: (step, micro_step, type, tensor, op, rank), at most ``limit``;
    or, with ``strongest``, farthest from their peers first."""
    c = {name: out[name] for name in _FIELDS}
    if strongest:
        keys = (c["rank"], c["op"], c["label"], c["type"], c["micro"], c["step"], -c["score"])
        order = np.lexsort(keys)[:limit]  # inf (NaN/Inf values) first; equal ones earliest first
    else:
        order = np.lexsort((c["rank"], c["op"], c["label"], c["type"], c["micro"], c["step"]))[:limit]
    c = {name: array[order].tolist() for name, array in c.items()}
    result = []
    for i in range(len(order)):
        vpp, name = out.labels[c["type"][i]][c["label"][i]]
        result.append(
            {
                "rank": c["rank"][i],
                "step": c["step"][i],
                "micro_step": None if c["micro"][i] < 0 else c["micro"][i],
                "type": out.types[c["type"][i]],
                "pp_stage": out.stages[c["type"][i]],
                "vpp_stage": vpp,
                "name": name,
                "op": out.ops[c["op"][i]],
                "value": _number(c["value"][i]),
                "peers_median": _number(c["peers"][i]),
                "scale": _number(c["scale"][i]),
                "deviation_mads": _number(c["score"][i]),
            }
        )
    return result


def by_rank(out: peers.Outliers) -> list[dict[str, int]]:
    """Per rank with outliers: how many, the first step, and the step with the most, earliest first."""
    rank, step = out["rank"], out["step"]
    pairs, counts = np.unique(np.column_stack([rank, step]).reshape(-1, 2), axis=0, return_counts=True)
    rows: dict[int, dict[str, int]] = {}
    for (r, s), n in zip(pairs.tolist(), counts.tolist()):  # sorted by rank, then step
        row = rows.setdefault(r, {"rank": r, "outliers": 0, "first_step": s, "most_step": s, "most": 0})
        row["outliers"] += n
        if n > row["most"]:
            row["most_step"], row["most"] = s, n
    return sorted(rows.values(), key=lambda row: (row["first_step"], -row["outliers"], row["rank"]))


def document(out: peers.Outliers, data_dir: str) -> dict[str, object]:
    """The JSON document of cross_rank_outliers.json."""
    total = len(out["rank"])
    return {
        "data_path": os.path.abspath(data_dir),
        "types": list(dict.fromkeys(out.types)),  # once each, though judged per pipeline stage
        "steps": None if out.only_steps is None else sorted(out.only_steps),
        "ranks": {
            t: sorted(r for ranks in by_stage.values() for r in ranks) for t, by_stage in out.ranks.items()
        },
        "pipeline_stages": {t: {str(s): r for s, r in by_stage.items()} for t, by_stage in out.ranks.items()},
        "ops": out.ops,
        "k_mad": out.k_mad,
        "min_ranks": peers.MIN_RANKS,
        "mad_floor_relative": peers.REL_FLOOR,
        "judged": out.judged,
        "outliers_total": total,
        "outliers_written": min(total, MAX_RECORDS),
        "by_rank": by_rank(out),
        "outliers": records(out, MAX_RECORDS),
        "strongest": records(out, STRONGEST, strongest=True),
    }


def format_outliers(rows: list[dict[str, object]]) -> str:
    """An aligned text table of outlier records."""
    header = ("#", "rank", "step", "micro_step", "type", "tensor", "op", "value", "peers", "MADs")
    lines = [header]
    for index, row in enumerate(rows, 1):
        micro = "-" if row["micro_step"] is None else str(row["micro_step"])
        numbers = [
            f"{row[k]:.6g}" if isinstance(row[k], float) else str(row[k]) for k in ("value", "peers_median")
        ]
        score = row["deviation_mads"]
        lines.append(
            (
                str(index),
                str(row["rank"]),
                str(row["step"]),
                micro,
                str(row["type"]),
                analyse._clean(f"{row['vpp_stage']}:{row['name']}"),
                str(row["op"]),
                *numbers,
                f"{score:.3g}" if isinstance(score, float) else str(score),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = []
    for line in lines:
        cells = [c.ljust(w) if i in (4, 5, 6) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        text.append("  ".join(cells).rstrip())
    return "\n".join(text)


def run(args: argparse.Namespace) -> int:
    """``anomaly-analyse --cross-rank``: the anomaly ranking (when anomaly files exist), then the outliers."""
    try:
        run_ = check_arguments(args)
    except UsageError as exc:
        print(f"anomaly-analyse: error: {exc}", file=sys.stderr)
        return 2
    status, ranking_status = 0, 0
    anomaly_dir = os.path.join(run_.data_dir, "anomaly_detected")
    paths = analyse.find_anomaly_files(anomaly_dir) if os.path.isdir(anomaly_dir) else []
    later = rank_csv.newer_run_than(run_.data_dir, run_.rank_dirs) if paths else None
    if later is not None:  # a later run that wrote anomaly files set the chosen run's aside
        with analyse.stdout_guard():
            print(
                f"Note: the anomaly files under {anomaly_dir} are likely a later run's "
                f"({os.path.basename(later)}) than the one chosen by --start/--end, whose own a new "
                "run keeps there as anomaly.json.earlier-<time>."
            )
    if paths:  # the ranking goes where the plain command writes it: beside the anomaly files
        ranking_dir = run_.out_dir if args.out_path else anomaly_dir
        ranking_status = analyse.report_anomalies(paths, run_.k, run_.steps, ranking_dir)
    else:
        with analyse.stdout_guard():
            print(
                f"No anomaly files under {anomaly_dir} (alert.dump off?): no ranking of detected anomalies."
            )
    out = windows.find_outliers(
        run_.rank_dirs, run_.types, args.k_mad, run_.steps, run_.ops, run_.memory, analyse._warn
    )
    doc = document(out, run_.data_dir)
    out_file = os.path.join(run_.out_dir, OUTPUT_NAME)
    try:
        analyse.write_atomic(out_file, json.dumps(doc, indent=1))
    except OSError as exc:
        print(f"anomaly-analyse: error: cannot write {out_file}: {exc}", file=sys.stderr)
        status = 1
    with analyse.stdout_guard():
        _print_section(doc, run_.k, out_file if status == 0 else None, len(run_.rank_dirs))
    return max(status, ranking_status)


def _compared(doc: dict) -> str:
    """Which ranks were compared, per data type, and per pipeline stage where there are several."""
    said = []
    for prefix, by_stage in doc["pipeline_stages"].items():
        text = f"{prefix} over ranks {_span(doc['ranks'][prefix])}"
        if len(by_stage) > 1:
            apart = "; ".join(f"stage {s}: {_span(r)}" for s, r in by_stage.items())
            text += f", each pipeline stage apart ({apart})"
        said.append(text)
    return "; ".join(said) or "nothing"


def _print_section(doc: dict, k: int, out_file: str | None, rank_count: int) -> None:
    compared = _compared(doc)
    print()
    total, judged = doc["outliers_total"], doc["judged"]
    if not judged:
        groups = [ranks for by_stage in doc["pipeline_stages"].values() for ranks in by_stage.values()]
        peers = max((len(ranks) for ranks in groups), default=rank_count)
        directories = f"{rank_count} rank director{'y' if rank_count == 1 else 'ies'}"
        stages = max((len(by_stage) for by_stage in doc["pipeline_stages"].values()), default=1)
        if stages > 1:  # each stage's layers are its own: its ranks are compared among themselves
            directories += f" in {stages} pipeline stages of at most {peers} rank(s) each"
        non_finite = (
            f"; NaN/Inf values are flagged wherever a peer's value is finite: {total:,} found"
            if peers > 1
            else " (nor on NaN/Inf values, which need a peer)"
        )
        print(
            f"No cross-rank verdict on sizes: a value is compared with its peers' only where at least "
            f"{doc['min_ranks']} ranks hold the same tensor, and {directories} with "
            f"{', '.join(doc['types'])} under {doc['data_path']} {'was' if rank_count == 1 else 'were'} "
            f"compared{non_finite}."
        )
        if not total:
            if out_file:
                print(f"written to {out_file}")
            return
    ranks = doc["by_rank"]
    heading = f"Cross-rank outliers ({compared}):"
    if judged:
        print(f"{heading} values beyond {doc['k_mad']:g} MADs of the other ranks' median")
        print(f"{judged:,} (tensor, step, op) values judged; {total:,} outliers on {len(ranks)} rank(s)")
    else:
        print(f"{heading} NaN/Inf where a peer is finite, on {len(ranks)} rank(s)")
    if ranks:
        for r in ranks[:10]:
            print(
                f"  rank {r['rank']}: {r['outliers']} outliers, first at step {r['first_step']}, "
                f"most at step {r['most_step']} ({r['most']})"
            )
        if len(ranks) > 10:
            print(f"  ... and {len(ranks) - 10} more ranks (see the JSON file)")
        print(f"First {min(k, len(doc['outliers']))}:")
        print(format_outliers(doc["outliers"][:k]))
        if total > k:  # a real fault is often far stronger than the first outliers of a run
            print(f"Farthest from their peers, {min(k, len(doc['strongest']))}:")
            print(format_outliers(doc["strongest"][:k]))
    if out_file:
        print(f"written to {out_file}")


def _span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
