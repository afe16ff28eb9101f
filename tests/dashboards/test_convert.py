"""csv2tb and csv2db: every CSV (or live Parquet) value comes back, msprobe's converter defects
stay fixed, arguments are checked."""

from __future__ import annotations

import argparse
import logging
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from dashboards.convert.commands import COMMANDS
from dashboards.convert.csv2db import csv2db
from dashboards.convert.csv2tb import csv2tensorboard_by_step
from dashboards.convert.runs import ConvertError
from tests.dashboards.conftest import NAMES, generated_value, rank_dir, read_csv_rows, same, write_run

PREFIXES = ("grad_reduced", "exp_avg")


def _restarted_run(root):
    """Two ranks; rank 1 restarted: a second directory repeats steps 3-4 with other values and goes on."""
    special = {(0, "grad_reduced", 2, 1, "norm"): float("nan"), (1, "exp_avg", 1, 0, "max"): float("-inf")}
    write_run(root, ranks=(0, 1), steps=range(5), prefixes=PREFIXES, window=2, special=special)
    later = {(1, "grad_reduced", s, 2, "min"): 7.0 + s for s in range(3, 7)}
    write_run(root, ranks=(1,), steps=range(3, 7), prefixes=PREFIXES, stamp="Jan02_03-05-00", special=later)


def _expected(root, rank: int, prefix: str) -> dict[tuple[str, int], dict]:
    """(name, step) -> values, reading every directory of the rank in time order (later wins)."""
    found = {}
    for directory in sorted(root.glob(f"*-rank{rank}-*")):
        for row in read_csv_rows(directory, prefix):
            found[(row["name"], row["step"])] = row["values"]
    return found


def test_csv2tb_round_trip_with_restarts_nan_and_inf(tmp_path, caplog):
    _restarted_run(tmp_path / "run")
    out = tmp_path / "tb"
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        result = csv2tensorboard_by_step(
            str(tmp_path / "run"), process_num=2, output_dirpath=str(out), progress=False
        )
    assert result == str(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("rank*/*")) == [
        f"rank{r}/{p}" for r in (0, 1) for p in sorted(PREFIXES)
    ]
    assert "rank1/grad_reduced: 8 rows written twice" in caplog.text  # 2 steps x 4 rows, later kept
    for rank in (0, 1):
        for prefix in PREFIXES:
            expected = _expected(tmp_path / "run", rank, prefix)
            accumulator = EventAccumulator(str(out / f"rank{rank}" / prefix), size_guidance={SCALARS: 0})
            accumulator.Reload()
            tags = set(accumulator.Tags()["scalars"])
            names = {name for name, _ in expected}
            assert tags == {f"vp0:{n}/{op}" for n in names for op in ("norm", "min", "max", "nans")}
            for tag in tags:
                name, op = tag[4:].rsplit("/", 1)
                events = accumulator.Scalars(tag)
                steps = sorted(step for n, step in expected if n == name)
                assert [e.step for e in events] == steps
                for event in events:
                    want = np.float32(expected[(name, event.step)][op])
                    assert same(np.float32(event.value), want), (tag, event.step)
            assert accumulator.Tensors("custom_scalars__config__")  # a layout per output directory
    accumulator = EventAccumulator(str(out / "rank1" / "grad_reduced"), size_guidance={SCALARS: 0})
    accumulator.Reload()
    repeated = {e.step: e.value for e in accumulator.Scalars("vp0:layers.0.fc2.weight/min")}
    assert (repeated[3], repeated[4], repeated[6]) == (10.0, 11.0, 13.0)  # the restarted directory's values


def test_csv2tb_names_micro_steps_like_the_reference(tmp_path):
    from monitor.record import RowSet, StepRecord
    from monitor.writers.csv import CsvWriter

    directory = tmp_path / "Jan02_03-04-05-rank0-00000000"
    directory.mkdir()
    writer = CsvWriter(directory)
    rows = RowSet.build([0, 0, 1], ["fc1.input", "fc1.input", "fc2.output"], 0, "actv", micro_steps=[0, 1, 0])
    writer.write(StepRecord("actv", 0, ("norm",), rows, np.array([[1.0], [2.0], [3.0]])))
    writer.close()
    csv2tensorboard_by_step(str(tmp_path), output_dirpath=str(tmp_path / "out"), progress=False)
    accumulator = EventAccumulator(str(tmp_path / "out" / "rank0" / "actv"))
    accumulator.Reload()
    got = {tag: accumulator.Scalars(tag)[0].value for tag in accumulator.Tags()["scalars"]}
    assert got == {
        "vp0:fc1.input:micro0/norm": 1.0,
        "vp0:fc1.input:micro1/norm": 2.0,
        "vp1:fc2.output:micro0/norm": 3.0,
    }


def test_csv2tb_skips_lookalike_directories_and_selects_by_time(tmp_path, caplog):
    write_run(tmp_path, stamp="Jan02_03-04-05")
    write_run(tmp_path, stamp="Jan03_03-04-05", ranks=(1,))
    (tmp_path / "Foo99_99-99-99-rank2-0000abcd").mkdir()  # matches the pattern, bad time tag
    (tmp_path / "Jan02_03-04-05-rank3-0000abcd").write_text("a file, not a directory")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        out = csv2tensorboard_by_step(str(tmp_path), time_end="Jan02_23-59-59", progress=False)
    assert "Foo99_99-99-99-rank2-0000abcd" in caplog.text and "rank3" in caplog.text
    assert out.startswith(str(tmp_path)) and out.endswith("-csv2tensorboard_by_step")
    assert sorted(p.name for p in (tmp_path / out).iterdir()) == ["rank0"]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"process_num": 0}, "process_num: expected an integer in [1, 128], got 0"),
        ({"process_num": "2"}, "process_num"),
        ({"process_num": True}, "process_num"),
        ({"data_type_list": "grad_reduced"}, "data_type_list: expected a non-empty list"),
        ({"data_type_list": ["grad_reduced", "weights"]}, "unknown data type(s) ['weights']"),
        ({"time_start": "yesterday"}, "time_start: expected a time like"),
        ({"time_start": "Feb02_00-00-00", "time_end": "Jan02_00-00-00"}, "is after time_end"),
        ({"time_start": "Dec31_00-00-00"}, "directory in range under"),
        ({"time_start": "Dec31_00-00-00"}, "(the time tags there: Jan02_03-04-05)"),
    ],
)
@pytest.mark.parametrize("convert", [csv2tensorboard_by_step, csv2db])
def test_bad_arguments_are_refused_up_front(tmp_path, convert, kwargs, words):
    write_run(tmp_path)
    with pytest.raises(ConvertError) as info:
        convert(str(tmp_path), progress=False, **kwargs)
    assert words in str(info.value)
    assert not any(p.name.endswith(("-csv2tensorboard_by_step", "-csv2db")) for p in tmp_path.iterdir())


@pytest.mark.parametrize("convert", [csv2tensorboard_by_step, csv2db])
def test_a_run_without_csv_or_parquet_files_is_refused_up_front(tmp_path, convert):
    write_run(tmp_path, fmt="tensorboard")
    with pytest.raises(ConvertError, match=r"no CSV or Parquet files in the 1 rank directory .* tensorboard"):
        convert(str(tmp_path), progress=False)
    assert not any(p.name.endswith(("-csv2tensorboard_by_step", "-csv2db")) for p in tmp_path.iterdir())


@pytest.mark.parametrize("convert", [csv2tensorboard_by_step, csv2db])
def test_a_data_type_without_files_is_refused_naming_those_there(tmp_path, convert):
    write_run(tmp_path, prefixes=("grad_reduced", "exp_avg"))
    with pytest.raises(
        ConvertError, match=r"no CSV or Parquet files of param_origin .*; they hold exp_avg, "
    ):
        convert(str(tmp_path), data_type_list=["param_origin"], progress=False)


def test_missing_monitor_path_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="monitor_path: expected an existing directory"):
        csv2db(str(tmp_path / "nowhere"))


def _assert_db_row(row: tuple, want: dict, ops: dict, key) -> None:
    """One stats row ``(nan_mask, values in ops order)`` holds ``want``: NaN as NULL with its
    op's bit in the mask, every other value exactly, its bit clear."""
    mask, values = row
    for position, (op, op_id) in enumerate(ops.items()):
        if np.isnan(want[op]):
            assert values[position] is None and mask >> op_id & 1, key
        else:
            assert values[position] == want[op] and not mask >> op_id & 1, key


def test_csv2db_round_trip(tmp_path):
    _restarted_run(tmp_path / "run")
    path = csv2db(str(tmp_path / "run"), process_num=2, output_path=str(tmp_path / "m.db"), progress=False)
    db = sqlite3.connect(path)
    ops = dict(db.execute("SELECT name, op_id FROM ops"))
    assert set(ops) == {"norm", "min", "max", "nans"}
    assert dict(db.execute("SELECT key, value FROM meta"))["schema_version"] == "1"
    assert sorted(db.execute("SELECT rank, dir FROM rank_dirs")) == sorted(
        (int(p.name.split("-rank")[1].split("-")[0]), p.name) for p in (tmp_path / "run").glob("*-rank*")
    )
    query = (
        "SELECT t.name, s.step, s.nan_mask, " + ", ".join(f's."{op}"' for op in ops) + " FROM stats s "
        "JOIN targets t USING (target_id) JOIN data_types d USING (data_type_id) WHERE d.name=? AND s.rank=?"
    )
    for rank in (0, 1):
        for prefix in PREFIXES:
            expected = _expected(tmp_path / "run", rank, prefix)
            got = {
                (name, step): (mask, values)
                for name, step, mask, *values in db.execute(query, (prefix, rank))
            }
            assert set(got) == set(expected)
            for key, want in expected.items():
                _assert_db_row(got[key], want, ops, key)
    order = db.execute(
        "SELECT t.name FROM target_order o JOIN targets t USING (target_id) "
        "JOIN data_types d USING (data_type_id) WHERE d.name='grad_reduced' AND o.rank=0 ORDER BY o.position"
    ).fetchall()
    assert [n for (n,) in order] == list(
        dict.fromkeys(r["name"] for r in read_csv_rows(rank_dir(tmp_path / "run"), "grad_reduced"))
    )


def test_a_file_that_is_not_a_monitor_csv_is_skipped_and_named(tmp_path, caplog):
    """A stray file named like the monitor's, but with another first line, does not stop the
    conversion: it is skipped with a warning naming it, and the other files are converted."""
    dirs = write_run(tmp_path / "run", ranks=(0,), steps=range(4), window=2)
    stray = dirs[0] / "grad_reduced_4-5.csv"
    stray.write_text("garbage,header\n1,2\n")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        path = csv2db(str(tmp_path / "run"), output_path=str(tmp_path / "m.db"), progress=False)
    assert f"skipping {stray}: not a monitor CSV header" in caplog.text
    steps = sqlite3.connect(path).execute("SELECT DISTINCT step FROM stats ORDER BY step").fetchall()
    assert [step for (step,) in steps] == [0, 1, 2, 3]


def test_a_row_that_does_not_parse_is_skipped_and_counted(tmp_path, caplog):
    """As csv2tb, compact and anomaly-analyse say: a row the conversion could not read is not
    left out of the database in silence."""
    dirs = write_run(tmp_path / "run", ranks=(0,), steps=range(4), window=2)
    part = dirs[0] / "grad_reduced_0-1.csv"
    lines = part.read_text().splitlines()
    fields = lines[1].split(",")
    fields[-1] = "garbage"
    part.write_text("\n".join([lines[0], ",".join(fields), *lines[2:]]) + "\n")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        path = csv2db(str(tmp_path / "run"), output_path=str(tmp_path / "m.db"), progress=False)
    assert "rank0/grad_reduced: skipped 1 rows that did not parse" in caplog.text
    (rows,) = sqlite3.connect(path).execute("SELECT count(*) FROM stats").fetchone()
    assert rows == sum(len(p.read_text().splitlines()) - 1 for p in dirs[0].glob("*.csv")) - 1


def test_csv2db_on_the_demo_output(demo_runs, tmp_path):
    path = csv2db(str(demo_runs["csv"]), output_path=str(tmp_path / "demo.db"), progress=False)
    db = sqlite3.connect(path)
    rows = read_csv_rows(rank_dir(demo_runs["csv"]), "exp_avg_sq")
    got = dict(
        db.execute(
            "SELECT t.name || '@' || s.step, s.norm FROM stats s JOIN targets t USING (target_id) "
            "JOIN data_types d USING (data_type_id) WHERE d.name='exp_avg_sq'"
        )
    )
    assert got == {f"{r['name']}@{r['step']}": r["values"]["norm"] for r in rows}


@pytest.mark.parametrize("name", ["csv2tb", "csv2db"])
def test_command_lines(tmp_path, capsys, name):
    write_run(tmp_path)
    description, add_arguments, run = COMMANDS[name]
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    assert "--monitor-path" in parser.format_help() and "%b%d_%H-%M-%S" in parser.format_help()
    target = str(tmp_path / ("out.db" if name == "csv2db" else "out"))
    args = parser.parse_args(["-d", str(tmp_path), "--types", "grad_reduced", "-j", "1", "-o", target])
    assert run(args) == 0
    captured = capsys.readouterr()
    assert f"Written:     {target}" in captured.out
    assert "1/1" in captured.err and "rank0/grad_reduced" in captured.err  # the progress line (tqdm or plain)
    assert run(parser.parse_args(["-d", str(tmp_path / "nowhere")])) == 2
    assert f"trainmon {name}: DIR: expected an existing directory" in capsys.readouterr().err
    assert run(parser.parse_args([str(tmp_path), "--start", "yesterday"])) == 2  # the option's name
    assert f"trainmon {name}: --start: expected a time like" in capsys.readouterr().err
    assert run(parser.parse_args([str(tmp_path / "nowhere")])) == 2  # DIR, as compact takes it
    assert "expected an existing directory" in capsys.readouterr().err
    assert run(parser.parse_args([])) == 2
    assert f"trainmon {name}: DIR or -d DIR: expected the monitor's output directory, got no directory" in (
        capsys.readouterr().err
    )
    for bad in (["-d", "x", "-j", "0"], ["-d", "x", "--types", "grad,exp_avg"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["-d", "x", "--types", "exp_avg,grad_reducd"])
    assert "got 'exp_avg,grad_reducd'; did you mean 'grad_reduced'?" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["csv2tb", "csv2db", "compact"])
def test_an_output_of_the_wrong_kind_is_refused_before_any_work(tmp_path, capsys, name):
    """-o naming a file where a directory is written (csv2tb, compact), or a directory where the
    database file is (csv2db): a one-line error, nothing converted, nothing replaced."""
    write_run(tmp_path / "run")
    wrong = tmp_path / "wrong"
    wrong.mkdir() if name == "csv2db" else wrong.write_text("keep me")
    description, add_arguments, run = COMMANDS[name]
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "run"), "-o", str(wrong)])) == 2
    kind, expected = ("a directory", "a file") if name == "csv2db" else ("a file", "a directory")
    assert (
        f"trainmon {name}: -o {str(wrong)!r} is {kind}: expected {expected} to write"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "wrong"]
    if name == "csv2db":
        assert not list(wrong.iterdir())
    else:
        assert wrong.read_text() == "keep me"
    assert all("rank" in p.name for p in (tmp_path / "run").iterdir())  # no default output either


def test_the_command_module_does_not_import_the_converters():
    heavy = ("pandas", "dashboards.convert.csv2tb", "dashboards.convert.runs")
    code = f"import sys, dashboards.convert.commands; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _parquet_run(root) -> dict:
    """Two ranks written with format parquet (merged windows of 2 steps and a last step file),
    a NaN, an Inf and a cell left out; returns (rank, prefix, name, step) -> op -> value written."""
    special = {(0, "grad_reduced", 2, 1, "norm"): float("nan"), (1, "exp_avg", 3, 2, "max"): float("inf")}
    skip = {(1, "grad_reduced", 4): [3]}
    write_run(
        root,
        fmt="parquet",
        ranks=(0, 1),
        steps=range(5),
        prefixes=PREFIXES,
        window=2,
        special=special,
        skip=skip,
    )
    return {
        (rank, prefix, name, step): {
            op: special.get((rank, prefix, step, row, op), generated_value(rank, p_index, step, row, op))
            for op in ("norm", "min", "max", "nans")
        }
        for rank in (0, 1)
        for p_index, prefix in enumerate(PREFIXES)
        for step in range(5)
        for row, name in enumerate(NAMES)
        if row not in skip.get((rank, prefix, step), [])
    }


def test_csv2tb_converts_a_parquet_run(tmp_path):
    written = _parquet_run(tmp_path / "run")
    out = tmp_path / "tb"
    csv2tensorboard_by_step(str(tmp_path / "run"), output_dirpath=str(out), progress=False)
    got = {}
    for rank in (0, 1):
        for prefix in PREFIXES:
            accumulator = EventAccumulator(str(out / f"rank{rank}" / prefix), size_guidance={SCALARS: 0})
            accumulator.Reload()
            for tag in accumulator.Tags()["scalars"]:
                name, op = tag.removeprefix("vp0:").rsplit("/", 1)
                for event in accumulator.Scalars(tag):
                    got.setdefault((rank, prefix, name, event.step), {})[op] = np.float32(event.value)
    assert set(got) == set(written)
    for key, values in written.items():
        assert set(got[key]) == set(values)
        assert all(same(got[key][op], np.float32(value)) for op, value in values.items()), key


def test_csv2db_converts_a_parquet_run(tmp_path):
    written = _parquet_run(tmp_path / "run")
    db = sqlite3.connect(csv2db(str(tmp_path / "run"), output_path=str(tmp_path / "m.db"), progress=False))
    ops = dict(db.execute("SELECT name, op_id FROM ops"))
    assert set(ops) == {"norm", "min", "max", "nans"}
    columns = ", ".join(f's."{op}"' for op in ops)
    got = {
        (rank, prefix, name, step): (mask, values)
        for prefix, name, rank, step, mask, *values in db.execute(
            f"SELECT d.name, t.name, s.rank, s.step, s.nan_mask, {columns} FROM stats s "
            "JOIN targets t USING (target_id) JOIN data_types d USING (data_type_id)"
        )
    }
    assert set(got) == set(written)
    for key, want in written.items():
        _assert_db_row(got[key], want, ops, key)


@pytest.mark.parametrize("with_tqdm", [False, True], ids=["own line", "tqdm"])
def test_a_message_logged_under_a_progress_bar_starts_a_line_of_its_own(monkeypatch, with_tqdm):
    """On a terminal the bar is redrawn in place; a warning logged between two jobs must not be
    glued to the end of the bar's line."""
    import io
    import logging

    from dashboards.convert import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    if not with_tqdm:
        monkeypatch.setattr(progress, "_Tqdm", lambda total, desc: (_ for _ in ()).throw(ImportError))
    handler = logging.StreamHandler(screen)
    logger = logging.getLogger("trainmon")
    logger.addHandler(handler)
    try:
        for job, _ in progress.run_jobs(str, ["a", "b", "c"], 1, "csv2tb"):
            if job == "a":
                logger.warning("rows written twice")
    finally:
        logger.removeHandler(handler)
    said = [line for line in screen.getvalue().replace("\r", "\n").splitlines() if "rows written" in line]
    assert said and all(line.startswith(("[trainmon]", "rows")) for line in said), said
    assert not logger.filters  # the bar took its filter away


def test_csv2tb_says_where_the_trainmon_tab_is_and_names_earlier_conversions(tmp_path, capsys):
    """Each csv2tb writes a new conversion into the monitor directory: a second one says that
    TensorBoard pointed there shows the first as runs too."""
    write_run(tmp_path)
    description, add_arguments, run = COMMANDS["csv2tb"]
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    args = ["-d", str(tmp_path), "--types", "grad_reduced", "-j", "1", "--no-progress"]
    assert run(parser.parse_args(args)) == 0
    first = capsys.readouterr().out
    assert f"tensorboard --logdir {tmp_path}   (the trainmon tab as well)" in first and "Note:" not in first
    (converted,) = [p.name for p in tmp_path.iterdir() if p.name.endswith("-csv2tensorboard_by_step")]
    (tmp_path / converted).rename(tmp_path / f"Jan01_00-00-00-{converted.rpartition('-')[2]}")  # made earlier
    assert run(parser.parse_args(args)) == 0
    assert "Note:        1 earlier conversion(s)" in capsys.readouterr().out
