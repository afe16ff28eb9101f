"""Promise 3: a crash loses nothing that was complete.

A training process (tests.reliability.crash_child, forked from a server that has torch imported,
so each run costs a fraction of a second) is killed with SIGKILL at ten different steps, for CSV,
TensorBoard and Parquet output. Afterwards every output file must be parseable: CSV files have
their header and only complete lines and complete steps; anomaly.json is valid JSON; TensorBoard
files consist of whole records with valid checksums (checked with TensorBoard's own CRC) and are
read by EventAccumulator; Parquet files are whole files that pyarrow reads, each value once.
They hold every collected step before the one the process died in.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import random
import re
import signal
import struct
from collections import Counter

import pytest

from tests.extras import OUTPUT_FORMATS
from tests.reliability import crash_child
from tests.reliability.training import read_csv_rows

#: ten different kill steps, drawn once (seeded, so a failure can be replayed).
KILL_STEPS = sorted(random.Random(2024).sample(range(1, 15), 10))
PREFIXES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
PREFIXES += ("other", "actv", "actv_grad")

_context = None


def _forkserver():
    """A forkserver with torch and trainmon imported once; each child is a fork of it."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(
            [
                "torch",
                "torch._dynamo",
                "torch.optim",
                "monitor",
                "pyarrow.parquet",
                "adapters.torch.session",
                crash_child.__name__,
            ]
        )
    return _context


def _killed_run(tmp_path, fmt: str, kill_step: int, where: str) -> str:
    out = str(tmp_path / "out")
    child = _forkserver().Process(target=crash_child.run, args=(out, fmt, kill_step, where))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL, f"child ended with {child.exitcode}, not SIGKILL"
    return out


def _rank_dir(out: str) -> str:
    (directory,) = glob.glob(os.path.join(out, "*-rank0-*"))
    return directory


# -- CSV ----------------------------------------------------------------------------------------


def _csv_steps(directory: str) -> dict[str, Counter]:
    """Per prefix, rows per step over all its files; every file has a header and whole lines."""
    steps: dict[str, Counter] = {}
    for path in glob.glob(os.path.join(directory, "*.csv")):
        if os.path.basename(path) == "stack_info.csv":
            continue
        prefix = os.path.basename(path).rsplit("_", 1)[0]
        header, rows = read_csv_rows(path)
        assert header[:3] == ["vpp_stage", "name", "step"], f"{path}: header {header}"
        for row in rows:
            assert len(row) == len(header), f"{path}: incomplete row {row}"
            for value in row[len(header) - len(crash_child.config("csv")["ops"]) :]:
                float(value)  # every statistic parses as a number
        steps.setdefault(prefix, Counter()).update(int(row[2]) for row in rows)
    return steps


def _check_csv(directory: str, complete_before: int, partial_at: int | None = None) -> None:
    steps = _csv_steps(directory)
    assert set(steps) == set(PREFIXES), sorted(steps)
    for prefix, counts in steps.items():
        rows_per_step = counts[0]
        assert rows_per_step > 0, prefix
        for step in range(complete_before):
            assert counts[step] == rows_per_step, f"{prefix}: step {step} has {counts[step]} rows"
        later = {s: n for s, n in counts.items() if s >= complete_before}
        if partial_at is None:
            assert not later, f"{prefix}: rows of steps after the kill: {later}"
        else:  # the step being written when the writer died: whole records only
            assert set(later) <= {partial_at} and later.get(partial_at, rows_per_step) == rows_per_step, (
                prefix,
                later,
            )


# -- TensorBoard ---------------------------------------------------------------------------------


def _tfrecords(path: str) -> list[bytes]:
    """The records of a TFRecord file; asserts whole records with valid checksums, nothing after them."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    with open(path, "rb") as handle:
        data = handle.read()
    records, offset = [], 0
    while offset < len(data):
        assert offset + 12 <= len(data), f"{path}: truncated record header at byte {offset}"
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        assert header_crc == masked_crc32c(header), f"{path}: bad length checksum at byte {offset}"
        end = offset + 12 + length + 4
        assert end <= len(data), f"{path}: truncated record at byte {offset}"
        body = data[offset + 12 : offset + 12 + length]
        (body_crc,) = struct.unpack("<I", data[end - 4 : end])
        assert body_crc == masked_crc32c(body), f"{path}: bad data checksum at byte {offset}"
        records.append(body)
        offset = end
    return records


def _check_tensorboard(directory: str, complete_before: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    paths = glob.glob(os.path.join(directory, "events.out.tfevents.*"))  # scalars, and a layout file
    assert max(len(_tfrecords(path)) for path in paths) > 1
    events = EventAccumulator(directory, size_guidance={SCALARS: 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    tasks = {tag.rsplit("/", 1)[-1].rsplit("_", 1)[0] for tag in tags}
    assert {"acc_grad", "post_grad", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"} <= tasks
    assert {"mg_direction", "actv", "actv_grad"} <= tasks
    for tag in tags:
        steps = sorted(e.step for e in events.Scalars(tag))
        assert steps == list(range(complete_before)), f"{tag}: steps {steps}"


# -- Parquet -------------------------------------------------------------------------------------


#: the live files' names as the documentation gives them
STEP_FILE = re.compile(r"step-(\d{10})(\.\d+)?\.parquet")
MERGED_FILE = re.compile(r"steps-(\d+)-(\d+)\.parquet")
LATE_FILE = re.compile(r"late-(\d+)-(\d+)\.parquet")


def _documented_parts(type_dir: str) -> list[str]:
    """The files of one data type a reader of the documented layout reads: merged and late
    files, and the step files no merged file covers (a kill between a merge's rename and its
    deletions leaves covered ones). Any other ``*.parquet`` name fails."""
    names = sorted(os.listdir(type_dir))
    merged = [tuple(map(int, m.groups())) for name in names if (m := MERGED_FILE.fullmatch(name))]
    parts = []
    for name in names:
        if MERGED_FILE.fullmatch(name) or LATE_FILE.fullmatch(name):
            parts.append(name)
        elif m := STEP_FILE.fullmatch(name):
            if not any(first <= int(m.group(1)) <= last for first, last in merged):
                parts.append(name)
        else:
            assert not name.endswith(".parquet"), f"{type_dir}: a file outside the layout: {name}"
    return [os.path.join(type_dir, name) for name in parts]


def _check_parquet(directory: str, complete_before: int, merge_cut: bool = False) -> None:
    """Every file under values/ is a whole Parquet file (temporary ones are never named
    ``*.parquet``); the files the documented layout says to read hold every step before the
    kill, each value once, and trainmon's own listing (``live_prefixes``) reads the same files."""
    import pyarrow.parquet as pq

    from monitor.writers.parquet_files import live_prefixes

    for path in glob.glob(os.path.join(directory, "values", "*", "*.parquet")):
        pq.read_table(path)
    type_dirs = glob.glob(os.path.join(directory, "values", "data_type=*"))
    found = {os.path.basename(d).removeprefix("data_type="): _documented_parts(d) for d in type_dirs}
    assert set(found) == set(PREFIXES), sorted(found)
    assert {k: sorted(v) for k, v in live_prefixes(directory).items()} == found
    for prefix, paths in found.items():
        table = pq.read_table(paths).to_pydict()
        keys = Counter(
            zip(table["step"], table["micro_step"], table["vpp_stage"], table["name"], table["op"])
        )
        assert max(keys.values()) == 1, f"{prefix}: a value twice"
        counts = Counter(table["step"])
        ended = len(counts) if merge_cut else complete_before  # a merge runs between records
        assert ended >= complete_before and sorted(counts) == list(range(ended)), (prefix, sorted(counts))
        assert len(set(counts.values())) == 1, f"{prefix}: rows per step {counts}"


def _check(
    out: str, fmt: str, complete_before: int, partial_at: int | None = None, merge_cut: bool = False
) -> None:
    directory = _rank_dir(out)
    if fmt == "csv":
        _check_csv(directory, complete_before, partial_at)
    elif fmt == "parquet":  # records reach a file at the end of their step: none of a cut one
        _check_parquet(directory, complete_before, merge_cut)
    else:
        _check_tensorboard(directory, complete_before)


# -- anomaly.json --------------------------------------------------------------------------------


def _check_anomalies(out: str, complete_before: int) -> None:
    with open(os.path.join(out, "anomaly_detected", "rank0", "anomaly.json"), encoding="utf-8") as handle:
        records = json.load(handle)  # a complete JSON document
    assert isinstance(records, dict)
    steps = {record["step"] for record in records.values()}
    assert steps <= set(range(complete_before)), sorted(steps)
    spikes = {s for s in crash_child.SPIKES if s < complete_before}
    assert spikes <= steps, f"spikes {sorted(spikes)} not all in anomaly.json steps {sorted(steps)}"


# -- the tests -----------------------------------------------------------------------------------


FORMATS = OUTPUT_FORMATS


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kill_step", KILL_STEPS)
def test_sigkill_in_a_training_step_keeps_every_step_before_it(tmp_path, fmt, kill_step):
    out = _killed_run(tmp_path, fmt, kill_step, "training")
    _check(out, fmt, complete_before=kill_step)
    _check_anomalies(out, complete_before=kill_step)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kill_step", KILL_STEPS[::4])
def test_sigkill_while_the_writer_writes_leaves_only_whole_records(tmp_path, fmt, kill_step):
    out = _killed_run(tmp_path, fmt, kill_step, "writer")
    _check(out, fmt, complete_before=kill_step, partial_at=kill_step)
    _check_anomalies(out, complete_before=kill_step)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_completed_step_is_on_disk_even_when_the_disk_is_slow(tmp_path, fmt):
    kill_step = 4
    out = _killed_run(tmp_path, fmt, kill_step, "slow_disk")
    _check(out, fmt, complete_before=kill_step)


def test_sigkill_between_a_parquet_merge_and_its_deletions_loses_and_repeats_nothing(tmp_path):
    """The first merge (steps 0-3) runs when the writer thread has nothing queued after step 4
    ended: every step up to 4 at least, and none twice, must be readable."""
    out = _killed_run(tmp_path, "parquet", 12, "merge")
    covered = glob.glob(os.path.join(_rank_dir(out), "values", "*", "step-000000000[0-3].parquet"))
    assert covered, "the kill came after the step files were deleted"
    _check(out, "parquet", complete_before=5, merge_cut=True)
