"""``trainmon compact``: every CSV value in the Parquet dataset, read back with DuckDB and checked
against the csv module's reading of the files (32-bit floats where every value has at most six
significant digits, else doubles); resumable, and the later of two writes wins."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from dashboards.convert.compact import FARTHEST_RANK_SQL, STEPS_PER_FILE, compact
from dashboards.convert.runs import ConvertError
from monitor.record import RowSet, StepRecord
from monitor.writers.csv import CsvWriter
from tests.dashboards.conftest import NAMES, OPS, generated_value, read_csv_rows, write_run

COLUMNS = {"rank", "step", "micro_step", "vpp_stage", "data_type", "name", "op", "value"}


def _value_types(out) -> set[str]:
    """The physical type of ``value`` in each part file, read file by file (no engine unifying them)."""
    schema = f"parquet_schema('{out}/values/**/*.parquet')"
    return {t for (t,) in duckdb.sql(f"SELECT DISTINCT type FROM {schema} WHERE name = 'value'").fetchall()}


def _dataset(out) -> dict[tuple, float]:
    rows = duckdb.sql(f"SELECT * FROM read_parquet('{out}/values/**/*.parquet', hive_partitioning = true)")
    assert set(rows.columns) == COLUMNS
    found = {}
    for record in rows.fetchall():
        r = dict(zip(rows.columns, record))
        key = (int(r["rank"]), r["data_type"], r["vpp_stage"], r["name"], r["micro_step"], r["step"], r["op"])
        assert key not in found
        found[key] = r["value"]
    return found


def _same(got: dict, expected: dict, digits: int | None = 6) -> None:
    """Every value as the csv module read it: exactly, or with ``digits`` the stored 32-bit float
    rounded to that many significant digits (what the CSV writer wrote)."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        stored = got[key]
        if digits is not None and math.isfinite(stored):
            stored = float(f"{stored:.{digits}g}")
        assert (math.isnan(value) and math.isnan(stored)) or stored == value, key


def test_every_value_round_trips_and_a_second_run_writes_nothing(tmp_path):
    special = {(1, "exp_avg", 3, 0, "norm"): float("nan"), (0, "grad_reduced", 2, 1, "max"): float("inf")}
    dirs = write_run(
        tmp_path,
        ranks=(0, 1),
        steps=range(6),
        window=2,
        prefixes=("grad_reduced", "exp_avg"),
        special=special,
    )
    # a restart of rank 0 that wrote steps 4-7 again, step 4 with other values: the later wins
    later = write_run(
        tmp_path,
        ranks=(0,),
        steps=range(4, 8),
        prefixes=("grad_reduced",),
        stamp="Jan02_03-04-09",
        special={(0, "grad_reduced", 4, 0, "norm"): -1.5},
    )
    expected = {}
    for rank, directories in {0: [dirs[0], later[0]], 1: [dirs[1]]}.items():
        for directory in directories:
            for prefix in ("grad_reduced", "exp_avg"):
                for row in read_csv_rows(directory, prefix):
                    micro = None if row["micro"] < 0 else row["micro"]
                    for op, value in row["values"].items():
                        expected[(rank, prefix, row["vpp"], row["name"], micro, row["step"], op)] = value
    assert compact(str(tmp_path)) == {"written": 4, "kept": 0}
    got = _dataset(tmp_path / "dataset")
    assert _value_types(tmp_path / "dataset") == {"FLOAT"}
    _same(got, expected)
    assert (
        got[(0, "grad_reduced", 0, expected and next(iter(k[3] for k in expected)), None, 4, "norm")] == -1.5
    )
    assert compact(str(tmp_path)) == {"written": 0, "kept": 4}  # nothing changed: nothing written
    changed = next(dirs[1].glob("exp_avg_*.csv"))
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    assert compact(str(tmp_path)) == {"written": 1, "kept": 3}  # only the part of the changed file
    runs = duckdb.sql(
        f"SELECT rank, directory FROM read_parquet('{tmp_path}/dataset/runs.parquet')"
    ).fetchall()
    assert sorted(runs) == sorted([(0, dirs[0].name), (0, later[0].name), (1, dirs[1].name)])


def test_a_line_cut_short_and_a_file_without_a_header_are_left_out(tmp_path):
    """A run killed while writing leaves a last line cut short: it is not a row (its first
    value would be read wrong and the rest lost), as no reader takes it for one; an empty CSV
    file beside the others holds nothing to read."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(4), window=2)
    last = sorted(dirs[0].glob("grad_reduced_*.csv"))[-1]
    text = last.read_bytes()
    cut = text[:-6]  # ",0.0412,0\n" cut to ",0.0": a wrong value, the next one lost
    last.write_bytes(cut)
    (dirs[0] / "grad_reduced_4-5.csv").write_bytes(b"")
    compact(str(tmp_path))
    got = _dataset(tmp_path / "dataset")
    name = cut.splitlines()[-1].split(b",")[1].decode()
    assert not [key for key in got if key[5] == 3 and key[3] == name]  # the cut row
    for key, value in got.items():
        _, _, _, row_name, _, step, op = key
        assert value == pytest.approx(generated_value(0, 0, step, NAMES.index(row_name), op), rel=1e-6)
    assert len(got) == (4 * len(NAMES) - 1) * len(OPS)


def _write_values(directory, values: np.ndarray, ndigits: int, step: int = 0) -> Path:
    directory.mkdir(exist_ok=True)
    writer = CsvWriter(directory, ndigits, 10)
    rows = RowSet.build([0] * len(values), [f"w{i}.weight" for i in range(len(values))], 0, "post_grad")
    writer.write(StepRecord("grad_reduced", step, ("norm", "nans"), rows, values))
    writer.end_step(step)
    writer.close()
    return directory


@pytest.mark.parametrize(
    "values, ndigits",
    [
        (np.array([[1.234567891, 0.0], [2.5, 1.0]]), 10),  # a larger ndigits
        (np.array([[0.5, 2.0**24 + 1], [2.5, 1.0]]), 6),  # a count a 32-bit float cannot hold
        (np.array([[3.0e39, 0.0], [1.0e-42, 1.0]]), 6),  # beyond a 32-bit float's range
    ],
    ids=["ndigits-10", "huge-count", "out-of-range"],
)
def test_values_a_float_cannot_hold_make_the_dataset_doubles_and_exact(tmp_path, values, ndigits):
    _write_values(tmp_path / "Jan02_03-04-05-rank0-00000000", values, ndigits)
    compact(str(tmp_path))
    assert _value_types(tmp_path / "dataset") == {"DOUBLE"}
    expected = {
        (0, "grad_reduced", row["vpp"], row["name"], None, row["step"], op): value
        for row in read_csv_rows(tmp_path / "Jan02_03-04-05-rank0-00000000", "grad_reduced")
        for op, value in row["values"].items()
    }
    _same(_dataset(tmp_path / "dataset"), expected, digits=None)


def test_exact_counts_and_six_digit_values_stay_32_bit_floats(tmp_path):
    values = np.array([[1.5, 1048576.0], [2.25, 16777216.0], [0.333333, 0.0]])  # counts a float holds
    _write_values(tmp_path / "Jan02_03-04-05-rank0-00000000", values, 6)
    compact(str(tmp_path))
    assert _value_types(tmp_path / "dataset") == {"FLOAT"}
    got = _dataset(tmp_path / "dataset")
    assert got[(0, "grad_reduced", 0, "w0.weight", None, 0, "nans")] == 1048576.0
    assert got[(0, "grad_reduced", 0, "w1.weight", None, 0, "nans")] == 16777216.0


def test_the_dataset_keeps_the_values_of_sources_deleted_since(tmp_path):
    """A rank directory deleted, or a rank's early CSV files removed to save space: the values
    compacted from them stay (in the dataset's value type), the rest is brought up to date."""
    dirs = write_run(tmp_path, ranks=(0, 1), steps=range(3), window=2)
    six_digits = _csv_values(dirs.values())
    compact(str(tmp_path))
    shutil.rmtree(dirs[1])
    for early in dirs[0].glob("*_0-1.csv"):
        early.unlink()
    exact = _csv_values(
        [_write_values(tmp_path / "Jan02_03-04-05-rank2-00000002", np.array([[1.234567891, 0.0]]), 10)]
    )
    assert compact(str(tmp_path)) == {"written": 3, "kept": 0}  # kept values too: doubles now
    assert _value_types(tmp_path / "dataset") == {"DOUBLE"}
    got = _dataset(tmp_path / "dataset")
    _same({key: got[key] for key in six_digits}, six_digits)
    _same({key: got[key] for key in got if key not in six_digits}, exact, digits=None)
    assert compact(str(tmp_path)) == {"written": 0, "kept": 3}
    runs = duckdb.connect().execute(
        f"SELECT rank, directory FROM read_parquet('{tmp_path / 'dataset' / 'runs.parquet'}') ORDER BY rank"
    )
    assert runs.fetchall() == [(0, dirs[0].name), (1, dirs[1].name), (2, "Jan02_03-04-05-rank2-00000002")]


def _csv_values(directories) -> dict[tuple, float]:
    """Every value of these rank directories' CSV files, keyed as ``_dataset`` keys them."""
    found = {}
    for directory in directories:
        rank = int(re.search(r"-rank(\d+)-", directory.name)[1])
        for prefix in {path.name.rsplit("_", 1)[0] for path in directory.glob("*.csv")}:
            for row in read_csv_rows(directory, prefix):
                micro = None if row["micro"] < 0 else row["micro"]
                for op, value in row["values"].items():
                    found[(rank, prefix, row["vpp"], row["name"], micro, row["step"], op)] = value
    return found


def test_a_later_value_a_float_cannot_hold_rewrites_every_part_as_doubles(tmp_path):
    write_run(tmp_path, ranks=(0, 1), steps=range(3))
    assert compact(str(tmp_path)) == {"written": 2, "kept": 0}
    assert _value_types(tmp_path / "dataset") == {"FLOAT"}
    _write_values(tmp_path / "Jan02_03-04-05-rank2-00000002", np.array([[1.234567891, 0.0]]), 10)
    assert compact(str(tmp_path)) == {"written": 3, "kept": 0}  # one schema: every part again
    assert _value_types(tmp_path / "dataset") == {"DOUBLE"}
    assert compact(str(tmp_path)) == {"written": 0, "kept": 3}
    manifest = tmp_path / "dataset" / "compact.json"
    manifest.write_text(manifest.read_text().replace('"DOUBLE"', '"INT); DROP TABLE x; --"'))
    assert compact(str(tmp_path)) == {"written": 3, "kept": 0}  # an unknown type is not trusted
    assert _value_types(tmp_path / "dataset") == {"DOUBLE"}


def test_micro_steps_anomalies_and_the_command(tmp_path):
    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    directory.mkdir()
    writer = CsvWriter(directory, 6, 10)
    rows = RowSet.build([0, 0], ["a.weight", "b.weight"], 0, "acc_grad", [0, 1])
    writer.write(StepRecord("grad_unreduced", 0, ("norm", "nans"), rows, np.array([[0.25, 0.0], [3.5, 2.0]])))
    writer.end_step(0)
    writer.close()
    write_run(tmp_path, ranks=(1,), steps=range(3), anomalies=[(1, "grad_reduced", 2, 0, "norm")])
    command = ["compact", str(tmp_path), "-o", str(tmp_path / "ds"), "--memory-limit", "300MB"]
    done = subprocess.run(
        [sys.executable, "-m", "monitor.cli", *command],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    got = _dataset(tmp_path / "ds")
    assert got[(0, "grad_unreduced", 0, "b.weight", 1, 0, "norm")] == 3.5
    assert got[(0, "grad_unreduced", 0, "a.weight", 0, 0, "nans")] == 0.0
    assert all(key[4] is None for key in got if key[1] == "grad_reduced")  # no micro-step: NULL
    (anomaly,) = duckdb.sql(
        "SELECT rank, step, op, pp_stage, vpp_stage, call_id, group_mates "
        f"FROM read_parquet('{tmp_path}/ds/anomalies.parquet')"
    ).fetchall()
    (record,) = json.loads((tmp_path / "anomaly_detected" / "rank1" / "anomaly.json").read_text()).values()
    fields = (record["pp_stage"], record["vpp_stage"], record["call_id"], json.dumps(record["group_mates"]))
    assert anomaly == (1, 2, "norm", *fields)  # all that anomaly-analyse orders records by
    assert "Written:" in done.stdout


@pytest.mark.parametrize("how", [["-d"], []])
def test_no_run_is_a_clear_error(tmp_path, how):
    done = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "compact", *how, str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "no {time}-rank{R}-{id} directory" in done.stderr


def test_output_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """``trainmon compact DIR | head -1``: the reader closes the pipe before the summary lines are
    written; the command ends with the shell's SIGPIPE code, without a traceback."""
    write_run(tmp_path, ranks=(0,), steps=range(2))
    command = [sys.executable, "-m", "monitor.cli", "compact", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before anything is written
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141 and "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    ("argv", "what"), [([], "no directory"), (["a", "-d", "b"], "two different directories")]
)
def test_the_directory_is_asked_for_once(tmp_path, argv, what):
    done = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "compact", *argv], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 2
    assert f"DIR or -d DIR: expected the monitor's output directory, got {what}" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("much", "--memory-limit: expected a size such as '512MB', '4GB' or '2GiB', got 'much'"),
        ("10", "--memory-limit: a bare number is bytes: expected a size with a unit such as '10GB'"),
    ],
)
def test_a_memory_limit_that_is_not_a_usable_size_is_refused_before_anything_is_written(
    tmp_path, setting, says
):
    write_run(tmp_path, ranks=(0,), steps=range(2))
    done = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "compact", "-d", str(tmp_path), "--memory-limit", setting],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and says in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "dataset").exists()


def test_the_documented_cross_rank_query_is_the_one_the_tests_run():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "dashboards.md").read_text(encoding="utf-8")
    assert " ".join(FARTHEST_RANK_SQL.split()) in " ".join(docs.split())


def test_tensorboard_outputs_are_compacted_as_tensorboard_reads_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    prefixes = ("grad_reduced", "grad_unreduced")
    dirs = write_run(tmp_path, ranks=(0, 1), steps=range(4), fmt="tensorboard", prefixes=prefixes)
    task_of = {"post_grad": "grad_reduced", "acc_grad": "grad_unreduced"}
    tag = re.compile(r"^(\d+):(.+)/rank(\d+)/(post_grad|acc_grad)_(\w+)$")
    expected = {}
    for rank, directory in dirs.items():
        events = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
        events.Reload()
        for name in events.Tags()["scalars"]:
            vpp, tensor, tag_rank, task, op = tag.match(name).groups()
            assert int(tag_rank) == rank
            for event in events.Scalars(name):
                expected[(rank, task_of[task], int(vpp), tensor, None, event.step, op)] = event.value
    assert compact(str(tmp_path)) == {"written": 4, "kept": 0}
    _same(_dataset(tmp_path / "dataset"), expected, digits=None)
    assert _value_types(tmp_path / "dataset") == {"FLOAT"}  # TensorBoard keeps 32-bit floats
    assert compact(str(tmp_path)) == {"written": 0, "kept": 4}


def test_live_parquet_outputs_are_compacted_and_a_later_directory_wins(tmp_path):
    csv_dirs = write_run(tmp_path, ranks=(0,), steps=range(6), prefixes=("grad_reduced",))
    later = write_run(  # rank 0 restarted with format parquet and wrote steps 4-7, step 4 anew
        tmp_path,
        ranks=(0, 1),
        steps=range(4, 8),
        window=3,
        fmt="parquet",
        prefixes=("grad_reduced", "exp_avg"),
        stamp="Jan02_03-04-09",
        special={(0, "grad_reduced", 4, 0, "norm"): -1.5, (1, "exp_avg", 5, 2, "max"): float("nan")},
    )
    expected = {
        (0, "grad_reduced", row["vpp"], row["name"], None, row["step"], op): value
        for row in read_csv_rows(csv_dirs[0], "grad_reduced")
        for op, value in row["values"].items()
    }
    for rank in later:  # what write_run wrote into the Parquet directories
        for p_index, prefix in enumerate(("grad_reduced", "exp_avg")):
            for step in range(4, 8):
                for row, name in enumerate(NAMES):
                    for op in OPS:
                        value = generated_value(rank, p_index, step, row, op)
                        expected[(rank, prefix, 0, name, None, step, op)] = value
    expected[(0, "grad_reduced", 0, NAMES[0], None, 4, "norm")] = -1.5
    expected[(1, "exp_avg", 0, NAMES[2], None, 5, "max")] = float("nan")
    assert compact(str(tmp_path)) == {"written": 4, "kept": 0}
    assert _value_types(tmp_path / "dataset") == {"DOUBLE"}  # live values are exact doubles
    _same(_dataset(tmp_path / "dataset"), expected, digits=None)
    assert compact(str(tmp_path)) == {"written": 0, "kept": 4}


def test_a_killed_compaction_leaves_a_readable_dataset_and_the_next_one_goes_on_from_there(
    tmp_path, monkeypatch
):
    """Killed while it writes its third part: the parts written so far are whole and listed in
    compact.json, the file being written is not named ``*.parquet`` (the documented query reads
    the dataset as it is), and the next compaction writes only the parts that are left."""
    import dashboards.convert.compact as compact_module
    import dashboards.convert.compact_manifest as manifest_module
    from dashboards.convert.compact_tables import TEMPORARY_PREFIX, TEMPORARY_SUFFIX

    write_run(tmp_path, ranks=(0, 1), steps=range(3), prefixes=("grad_reduced", "exp_avg"))
    expected = _csv_values(sorted(tmp_path.glob("*-rank*")))
    monkeypatch.setattr(manifest_module, "SAVE_EVERY_S", 0.0)
    write_part, calls = compact_module._write_part, []

    def killed_in_the_third(con, query, directory, value_type, block=None):
        calls.append(directory)
        if len(calls) == 3:
            compact_module.copy_to_parquet(con, query, os.path.join(directory, "x.parquet"))  # whole
            temporary = os.path.join(directory, f"{TEMPORARY_PREFIX}cut{TEMPORARY_SUFFIX}")
            Path(temporary).write_bytes(b"PAR1 cut short")  # what a kill in the COPY leaves
            raise KeyboardInterrupt
        return write_part(con, query, directory, value_type, block)

    monkeypatch.setattr(compact_module, "_write_part", killed_in_the_third)
    with pytest.raises(KeyboardInterrupt):
        compact(str(tmp_path))
    os.unlink(next((tmp_path / "dataset").rglob("x.parquet")))
    got = _dataset(tmp_path / "dataset")  # the documented glob: nothing half-written in its way
    assert got and set(got) < set(expected)
    _same(got, {key: expected[key] for key in got})
    monkeypatch.setattr(compact_module, "_write_part", write_part)
    assert compact(str(tmp_path)) == {"written": 2, "kept": 2}
    _same(_dataset(tmp_path / "dataset"), expected)
    assert not list((tmp_path / "dataset").rglob(".tmp-*"))
    monkeypatch.chdir(tmp_path)  # the run named by another path: still the same sources
    assert compact(".", str(tmp_path / "dataset")) == {"written": 0, "kept": 4}


def test_compacting_into_another_runs_dataset_or_a_users_directory_is_refused(tmp_path):
    """-o naming the dataset of another run: its parts of the ranks both runs have would be
    replaced; a directory of the user's files: the dataset would be mixed in among them; one
    that cannot be made: named at once, not retried as a file that changed. Each is a one-line
    error naming the directory, with nothing changed there."""
    write_run(tmp_path / "a", ranks=(0,), steps=range(2))
    write_run(tmp_path / "b", ranks=(0,), steps=range(2), stamp="Jan03_03-04-05")
    compact(str(tmp_path / "a"), str(tmp_path / "ds"))
    before = _dataset(tmp_path / "ds")
    compact(str(tmp_path / "a"), str(tmp_path / "ds"))  # the same run again: fine
    with pytest.raises(
        ConvertError, match=r"holds the dataset of other rank directories \(Jan02_03-04-05-rank0"
    ):
        compact(str(tmp_path / "b"), str(tmp_path / "ds"))
    assert _dataset(tmp_path / "ds") == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConvertError, match=r"holds files that are not a trainmon dataset's \(notes.txt\)"):
        compact(str(tmp_path / "a"), str(mine))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConvertError, match=r"afile/ds' cannot be made \(Not a directory\)"):
        compact(str(tmp_path / "a"), str(tmp_path / "afile" / "ds"))


def test_values_written_twice_keep_the_later_and_are_said_once(tmp_path, caplog):
    """A second, different run into the same output root overwrote steps 0-1 of rank 0: the
    dataset holds the later run's values there and the earlier run's after, and says so."""
    write_run(tmp_path, ranks=(0,), steps=range(4))
    overwritten = [
        (0, "grad_reduced", step, row, op) for step in range(2) for row in range(len(NAMES)) for op in OPS
    ]
    write_run(
        tmp_path, ranks=(0,), steps=range(2), stamp="Jan03_03-04-05", special=dict.fromkeys(overwritten, -7.0)
    )
    compact(str(tmp_path))
    got = _dataset(tmp_path / "dataset")
    assert {v for k, v in got.items() if k[5] < 2} == {-7.0}
    assert -7.0 not in {v for k, v in got.items() if k[5] >= 2}
    said = [r.getMessage() for r in caplog.records if "written more than once" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"trainmon compact: {2 * len(NAMES) * len(OPS)} value(s)")


def test_a_damaged_header_and_a_short_row_are_left_out_and_said(tmp_path, caplog):
    """A file whose header was overwritten is not a monitor file: skipped, named. A row cut
    short mid-file (its last values gone, its line still ended) is left out whole, not kept
    with the values it still has, and said as a row that did not parse."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(4), window=2)
    first, second = sorted(dirs[0].glob("grad_reduced_*.csv"))
    first.write_bytes(b"\0" * 10 + first.read_bytes()[10:])
    lines = second.read_text().splitlines(keepends=True)
    short_name = lines[2].split(",")[1]
    lines[2] = ",".join(lines[2].split(",")[:5]) + "\n"
    second.write_text("".join(lines))
    compact(str(tmp_path))
    got = _dataset(tmp_path / "dataset")
    assert {key[5] for key in got} == {2, 3}
    assert not [key for key in got if key[3] == short_name and key[5] == int(lines[2].split(",")[2])]
    assert len(got) == (2 * len(NAMES) - 1) * len(OPS)
    assert f"skipping {first}: not a monitor CSV header" in caplog.text
    assert f"{second}: skipped 1 row(s) that did not parse" in caplog.text


def test_a_row_that_does_not_parse_is_left_out_and_said(tmp_path, caplog):
    """A value that is no number: the row is left out, as every reader leaves it, and the file
    is named with the count, once: an older window's file (read by DuckDB from disk) and the
    newest (read from a copy of its complete lines) alike."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(4), window=2)
    paths = sorted(dirs[0].glob("grad_reduced_*.csv"))
    assert len(paths) == 2
    for path in paths:
        lines = path.read_text().splitlines(keepends=True)
        lines[1] = ",".join([*lines[1].split(",")[:3], "abc", *lines[1].split(",")[4:]])
        path.write_text("".join(lines))
    compact(str(tmp_path))
    for path in paths:
        assert caplog.text.count(f"{path}: skipped 1 row(s) that did not parse") == 1
    assert len(_dataset(tmp_path / "dataset")) == (4 * len(NAMES) - 2) * len(OPS)


def test_a_file_spanning_two_dataset_files_says_its_bad_rows_once(tmp_path, caplog):
    """A CSV file whose steps fall into two of the dataset's step files is read for each: its
    row that does not parse is still said once, and left out of both."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(STEPS_PER_FILE - 2, STEPS_PER_FILE + 6), window=3)
    path = dirs[0] / f"grad_reduced_{STEPS_PER_FILE - 1}-{STEPS_PER_FILE + 1}.csv"  # not the newest
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = ",".join([*lines[1].split(",")[:3], "abc", *lines[1].split(",")[4:]])
    path.write_text("".join(lines))
    compact(str(tmp_path))
    assert caplog.text.count("did not parse") == 1
    assert f"{path}: skipped 1 row(s) that did not parse" in caplog.text
    assert len(_dataset(tmp_path / "dataset")) == (8 * len(NAMES) - 1) * len(OPS)


def test_an_anomaly_file_that_cannot_be_read_is_named(tmp_path, caplog):
    """A kill while anomaly.json was replaced may leave it unreadable: its records are left out
    of the dataset's table, and the file is named, as anomaly-analyse names it."""
    write_run(tmp_path, ranks=(0,), steps=range(2), anomalies=[(0, "grad_reduced", 1, 0, "norm")])
    (bad,) = tmp_path.glob("anomaly_detected/rank0/anomaly.json")
    bad.write_text('{"cut short')
    compact(str(tmp_path))
    assert f"skipping {bad}" in caplog.text


def test_the_dataset_has_the_outputs_modes(tmp_path):
    """Files 0640 and directories 0750, as the monitor's own outputs: a group reader (a Spark
    account) reads the dataset as it reads the run."""
    write_run(tmp_path, ranks=(0,), steps=range(2))
    compact(str(tmp_path))
    modes = {
        path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
        for path in (tmp_path / "dataset").rglob("*")
    }
    assert modes and all(
        mode == (0o750 if (tmp_path / p).is_dir() else 0o640) for p, mode in modes.items()
    ), modes


def test_an_output_inside_a_rank_directory_is_refused(tmp_path):
    """The dataset would be read as the rank's own files by the next compaction and the readers."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(2))
    with pytest.raises(ConvertError, match=r"is inside the rank directory .*: expected one outside"):
        compact(str(tmp_path), str(dirs[0] / "ds"))
    assert not (dirs[0] / "ds").exists()


def test_temporary_files_a_killed_compaction_left_beside_the_tables_are_removed(tmp_path):
    """A kill while compact.json or a table is written leaves its temporary file in the
    dataset's directory; the next compaction removes it, and nothing else there."""
    write_run(tmp_path, ranks=(0,), steps=range(2))
    dataset = tmp_path / "dataset"
    compact(str(tmp_path))
    for name in (".tmp-k3j2h1g0", ".tmp-9abc.parquet.tmp", "notes.txt"):
        (dataset / name).write_text("left")
    compact(str(tmp_path))
    assert not list(dataset.glob(".tmp-*")) and (dataset / "notes.txt").read_text() == "left"


def test_a_merge_during_compaction_makes_it_start_again(tmp_path, monkeypatch):
    """format parquet merges a window while compact has already listed its step files: the
    files it listed are gone when it reads them, so it lists again."""
    import dashboards.convert.compact as compact_module
    from monitor.writers.parquet import ParquetWriter

    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    writer = ParquetWriter(directory, 0, merge_steps=2)
    rows = RowSet.build([0, 0], ["a.weight", "b.weight"], 0, "post_grad")
    expected = {}
    for step in range(4):
        values = np.array([[1.0 + step, 0.0], [2.5 * step, 1.0]])
        writer.write(StepRecord("grad_reduced", step, ("norm", "nans"), rows, values))
        writer.end_step(step)
        for row, name in enumerate(("a.weight", "b.weight")):
            for column, op in enumerate(("norm", "nans")):
                expected[(0, "grad_reduced", 0, name, None, step, op)] = values[row, column]
    listing = compact_module._files_by_type
    calls = []

    def list_then_merge(dirs, events):
        found = listing(dirs, events)
        if not calls:
            writer.close()  # the training's writer merges its windows meanwhile
        calls.append(found)
        return found

    monkeypatch.setattr(compact_module, "_files_by_type", list_then_merge)
    assert compact(str(tmp_path)) == {"written": 1, "kept": 0}
    assert len(calls) == 2 and calls[0] != calls[1]
    _same(_dataset(tmp_path / "dataset"), expected, digits=None)


def test_a_file_merged_away_while_its_footer_is_checked_is_not_taken_for_one_cut_short(tmp_path, monkeypatch):
    """The merge may also take a listed file away just before compact checks that it is whole:
    a missing file starts the compaction again, where a skipped one would lose its steps."""
    import dashboards.convert.compact_sources as sources
    from monitor.writers.parquet import ParquetWriter

    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    writer = ParquetWriter(directory, 0, merge_steps=2)
    rows = RowSet.build([0], ["a.weight"], 0, "post_grad")
    for step in range(4):
        writer.write(StepRecord("grad_reduced", step, ("norm",), rows, np.array([[1.0 + step]])))
        writer.end_step(step)
    checked = sources.layout_problem

    def merge_then_check(path):
        writer.close()  # the training's writer merges its windows meanwhile (once: then a no-op)
        return checked(path)

    monkeypatch.setattr(sources, "layout_problem", merge_then_check)
    compact(str(tmp_path))
    got = _dataset(tmp_path / "dataset")
    assert {key[5]: value for key, value in got.items()} == {step: 1.0 + step for step in range(4)}


@pytest.mark.parametrize("fault", ["empty", "other columns"])
def test_an_unreadable_live_parquet_file_is_skipped_and_the_rest_compacted(tmp_path, caplog, fault):
    """A file a power loss left empty, or a stray one of other columns (said with why, not with
    DuckDB's error and its hint to try union_by_name)."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(4), window=2, fmt="parquet")
    (bad,) = dirs[0].glob("values/*/steps-0000000000-0000000001.parquet")
    if fault == "empty":
        bad.write_bytes(b"")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"a": [1.0]}), bad)
    assert compact(str(tmp_path)) == {"written": 1, "kept": 0}
    got = _dataset(tmp_path / "dataset")
    assert {key[5] for key in got} == {2, 3}
    for key, value in got.items():
        _, _, _, name, _, step, op = key
        assert value == generated_value(0, 0, step, NAMES.index(name), op)
    why = "not a whole Parquet file" if fault == "empty" else "none of the layout's columns"
    assert f"skipping {bad}: {why}" in caplog.text and "union_by_name" not in caplog.text


def test_a_live_parquet_file_whose_data_is_damaged_is_skipped_naming_it(tmp_path, caplog):
    """Its footer reads fine, its data does not decode: the file is named and left out, the
    others compacted, where DuckDB's own error ended the whole compaction."""
    dirs = write_run(tmp_path, ranks=(0,), steps=range(4), window=2, fmt="parquet")
    (bad,) = dirs[0].glob("values/*/steps-0000000000-0000000001.parquet")
    data = bytearray(bad.read_bytes())
    for i in range(4, min(len(data) - 200, 600)):  # the column chunks, before the footer
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    compact(str(tmp_path))
    assert {key[5] for key in _dataset(tmp_path / "dataset")} == {2, 3}
    assert f"skipping {bad}: its data cannot be read" in caplog.text


def test_a_real_runs_incidents_topology_and_config_are_tables_of_the_dataset(tmp_path):
    """The demo (a spike at step 31) compacted: incidents.parquet holds the incident of the
    rank's incidents.json, runs.parquet the topology and config of its trainmon_run.json (both
    read here with the json module)."""
    import json

    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor.cli",
            "demo",
            "--steps",
            "36",
            "--spike-step",
            "31",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    compact(str(out), str(tmp_path / "ds"))
    (written,) = json.loads((out / "anomaly_detected" / "rank0" / "incidents.json").read_text())["incidents"]
    rows = duckdb.sql(f"SELECT * FROM read_parquet('{tmp_path}/ds/incidents.parquet')")
    (row,) = [dict(zip(rows.columns, values)) for values in rows.fetchall()]
    assert (row["rank"], row["id"], row["onset_step"], row["state"]) == (0, 1, 31, written["state"])
    assert (row["root_tag"], row["root_op"], row["root_rule"]) == tuple(
        written["root"][key] for key in ("tag_name", "op", "rule")
    )
    assert row["root_value"] == written["root"]["value"] and row["tensors"] == written["tensors"]
    assert json.loads(row["evidence"]) == written["evidence"]
    (rank_dir,) = [d for d in out.iterdir() if "-rank0-" in d.name]
    info = json.loads((rank_dir / "trainmon_run.json").read_text())
    runs = f"read_parquet('{tmp_path}/ds/runs.parquet')"
    (run,) = duckdb.sql(f"SELECT rank, world_size, pp_stage, group_mates, config FROM {runs}").fetchall()
    assert run[:3] == (0, 1, 0) and json.loads(run[3]) == [0]
    assert json.loads(run[4]) == info["config"] and info["config"]["alert"]["dump"] is True


def test_a_part_is_a_file_per_step_range_and_a_run_that_goes_on_rewrites_only_its_last(tmp_path, monkeypatch):
    """Files of 10 steps: each holds only its range, a reader that opens the files whose names
    overlap a range gets every value of it, and the run going on rewrites only the files its new
    steps reach, under the same names (no value twice), while an earlier layout's whole-part
    file goes."""
    monkeypatch.setattr("dashboards.convert.compact.STEPS_PER_FILE", 10)
    dirs = write_run(tmp_path, ranks=(0,), steps=range(25), window=25)
    part = tmp_path / "dataset" / "values" / "data_type=grad_reduced" / "rank=0"
    part.mkdir(parents=True)
    (part / "part.parquet").write_bytes(b"a dataset written before step ranges")
    assert compact(str(tmp_path)) == {"written": 1, "kept": 0}
    assert sorted(p.name for p in part.iterdir()) == [f"steps-{a}-{a + 9}.parquet" for a in (0, 10, 20)]
    ranges = {
        path: tuple(map(int, path.name[len("steps-") : -len(".parquet")].split("-")))
        for path in part.iterdir()
    }
    for path, (first, last) in ranges.items():
        ((low, high),) = duckdb.sql(f"SELECT min(step), max(step) FROM read_parquet('{path}')").fetchall()
        assert first <= low <= high <= last
    expected = {
        (row["name"], row["step"], op): value
        for row in read_csv_rows(dirs[0], "grad_reduced")
        for op, value in row["values"].items()
    }
    overlapping = [str(path) for path, (first, last) in ranges.items() if first <= 16 and last >= 12]
    got = duckdb.sql(
        f"SELECT name, step, op, value FROM read_parquet({overlapping}) WHERE step BETWEEN 12 AND 16"
    )
    wanted = {key: value for key, value in expected.items() if 12 <= key[1] <= 16}
    _same({(n, s, o): v for n, s, o, v in got.fetchall()}, wanted)

    before = {path.name: path.stat().st_ino for path in part.iterdir()}
    write_run(tmp_path, ranks=(0,), steps=range(25, 32), window=25, stamp="Jan02_03-04-09")
    assert compact(str(tmp_path)) == {"written": 1, "kept": 0}
    assert sorted(p.name for p in part.iterdir()) == [f"steps-{a}-{a + 9}.parquet" for a in (0, 10, 20, 30)]
    after = {path.name: path.stat().st_ino for path in part.iterdir()}
    rewritten = sorted(name for name in after if after[name] != before.get(name))
    assert rewritten == ["steps-20-29.parquet", "steps-30-39.parquet"]  # the files the new steps reach
    steps = {key[5] for key in _dataset(tmp_path / "dataset")}  # _dataset: no value twice
    assert steps == set(range(32))


def test_commands_that_read_a_run_say_when_given_its_dataset(tmp_path):
    """The dataset is not a run: anomaly-analyse (both modes) and csv2tb given it say so and what
    to give instead, rather than only that no rank directory is there."""
    write_run(tmp_path, ranks=(0,), steps=range(2))
    compact(str(tmp_path))
    dataset = str(tmp_path / "dataset")
    hint = f"{dataset!r} is a dataset written by trainmon compact: give the run's output directory"
    for argv in (
        ["anomaly-analyse", "-d", dataset],
        ["anomaly-analyse", "--cross-rank", "-d", dataset],
        ["csv2tb", dataset],
        ["compact", dataset],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "monitor.cli", *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2 and hint in done.stderr, (argv, done.stderr)


def test_commands_that_read_a_run_say_when_given_one_ranks_directory(tmp_path):
    (rank_dir,) = write_run(tmp_path, ranks=(0,), steps=range(2)).values()
    hint = f"{str(rank_dir)!r} is one rank's directory: give the run's output directory that holds it"
    for argv in (
        ["compact", str(rank_dir)],
        ["csv2db", str(rank_dir)],
        ["anomaly-analyse", "--cross-rank", "-d", str(rank_dir)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "monitor.cli", *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2 and hint in done.stderr and str(tmp_path) in done.stderr, (
            argv,
            done.stderr,
        )


def test_a_resumed_job_adds_to_the_dataset_in_its_own_root(tmp_path, caplog):
    """The root's own dataset (the default -o) was made from rank directories deleted since, and
    the job resumed into new ones: it goes on, keeping the earlier values and saying so."""
    (first,) = write_run(tmp_path, ranks=(0,), steps=range(2)).values()
    compact(str(tmp_path))
    shutil.rmtree(first)
    write_run(tmp_path, ranks=(0,), steps=range(2, 4), stamp="Jan03_03-04-05")
    compact(str(tmp_path))
    assert {key[5] for key in _dataset(tmp_path / "dataset")} == {0, 1, 2, 3}
    assert "no longer under" in caplog.text


def test_the_farthest_rank_query_keeps_chunks_and_micro_steps_apart():
    """Two model chunks and two micro-steps of one tensor: each (chunk, micro-step) has its own
    median and its own farthest rank, as numpy finds them; rows without micro-steps (NULL) too."""
    rng = np.random.default_rng(4)
    rows, expected = [], set()
    for vpp in (0, 1):
        for micro in (0, 1, None):
            values = rng.permutation([1.0, 2.0, 3.0, 40.0 + 10 * vpp + (micro or 0)])
            for rank, value in enumerate(values):
                rows.append((rank, "actv", vpp, "w", micro, "norm", 5, float(value)))
            farthest = int(np.argmax(np.abs(values - np.median(values))))
            expected.add(("actv", vpp, "w", micro, "norm", 5, farthest))
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE v (rank BIGINT, data_type VARCHAR, vpp_stage BIGINT, name VARCHAR, "
        "micro_step BIGINT, op VARCHAR, step BIGINT, value DOUBLE)"
    )
    con.executemany("INSERT INTO v VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    assert set(con.execute(FARTHEST_RANK_SQL).fetchall()) == expected
