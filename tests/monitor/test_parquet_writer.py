"""ParquetWriter (monitor/writers/parquet.py): the dataset's long rows written live, one closed
file per data type and ended step, merged per window; read back with DuckDB and pyarrow."""

from __future__ import annotations

import os
import stat

import duckdb
import numpy as np
import pytest

from monitor.config.schema import load_config
from monitor.config.values import ConfigError
from monitor.writers.parquet import ParquetWriter
from monitor.writers.parquet_files import live_parts, live_prefixes

OPS = ("norm", "min", "max", "nans")
NAMES = ("layers.0.fc1.weight", "layers.0.fc2.weight", 'it\'s, "quoted"')


def _values(step: int) -> np.ndarray:
    rng = np.random.default_rng(step)
    values = rng.standard_normal((len(NAMES), len(OPS)))
    values[:, 3] = rng.integers(0, 5, len(NAMES))
    values[0, 0] = np.nan if step == 2 else values[0, 0]
    values[1, 2] = np.inf if step == 3 else values[1, 2]
    return values


def _read(directory) -> list[tuple]:
    """Every row under ``directory``'s values/, as DuckDB reads it with the documented pattern."""
    pattern = os.path.join(directory, "values", "*", "*.parquet")
    return duckdb.sql(
        f"SELECT rank, step, micro_step, vpp_stage, name, op, value, data_type "
        f"FROM read_parquet('{pattern}', hive_partitioning = true)"
    ).fetchall()


def _expected(steps, prefix="grad_reduced", rank=3, vpp=(0, 1, 0)) -> set[tuple]:
    return {
        (rank, step, None, vpp[row], NAMES[row], op, _values(step)[row, column], prefix)
        for step in steps
        for row in range(len(NAMES))
        for column, op in enumerate(OPS)
    }


def _same(rows: list[tuple], expected: set[tuple]) -> bool:
    """Equal as sets of rows, with NaN equal to NaN."""

    def key(row):
        return tuple("nan" if isinstance(v, float) and np.isnan(v) else v for v in row)

    return len(rows) == len(expected) and {key(r) for r in rows} == {key(r) for r in expected}


def _record(make_record, step):
    return make_record("grad_reduced", step, NAMES, _values(step), OPS, vpp_stages=[0, 1, 0])


def _write(tmp_path, make_record, steps, merge_steps=100, close=True):
    writer = ParquetWriter(tmp_path, rank=3, merge_steps=merge_steps)
    for step in steps:
        writer.write(_record(make_record, step))
        writer.end_step(step)
    if close:
        writer.close()
    return writer


def _files(tmp_path, prefix="grad_reduced") -> list[str]:
    return sorted(os.listdir(os.path.join(tmp_path, "values", f"data_type={prefix}")))


def test_every_value_reads_back_exactly_with_its_labels(tmp_path, make_record):
    _write(tmp_path, make_record, range(6))
    assert _same(_read(tmp_path), _expected(range(6)))


def test_an_ended_step_is_a_closed_file_before_the_writer_is_closed(tmp_path, make_record):
    _write(tmp_path, make_record, range(3), close=False)
    assert _files(tmp_path) == [f"step-{s:010d}.parquet" for s in range(3)]
    assert _same(_read(tmp_path), _expected(range(3)))


def test_a_record_not_yet_ended_is_not_in_any_file(tmp_path, make_record):
    writer = _write(tmp_path, make_record, range(2), close=False)
    writer.write(_record(make_record, 2))
    assert _same(_read(tmp_path), _expected(range(2)))


def test_finished_windows_are_merged_while_the_run_goes_on_and_the_rest_at_close(tmp_path, make_record):
    writer = _write(tmp_path, make_record, range(11), merge_steps=4, close=False)
    writer.write(_record(make_record, 11))
    while writer.idle():  # the writer thread's calls while nothing is queued
        pass
    files = _files(tmp_path)
    assert "steps-0000000000-0000000003.parquet" in files and "steps-0000000004-0000000007.parquet" in files
    assert "step-0000000008.parquet" in files and not any(
        f.startswith("step-000000000") and f < "step-0000000008" for f in files
    )
    writer.end_step(11)
    writer.close()
    assert _files(tmp_path) == [
        "steps-0000000000-0000000003.parquet",
        "steps-0000000004-0000000007.parquet",
        "steps-0000000008-0000000011.parquet",
    ]
    assert _same(_read(tmp_path), _expected(range(12)))


def test_a_merge_writes_row_groups_of_bounded_size(tmp_path, make_record, monkeypatch):
    import pyarrow.parquet as pq

    import monitor.writers.parquet as parquet_writer

    monkeypatch.setattr(parquet_writer, "MERGE_ROWS", 2 * len(NAMES) * len(OPS))
    _write(tmp_path, make_record, range(5), merge_steps=8)
    (name,) = _files(tmp_path)
    metadata = pq.ParquetFile(os.path.join(tmp_path, "values", "data_type=grad_reduced", name)).metadata
    rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert rows == [24, 24, 12]
    assert _same(_read(tmp_path), _expected(range(5)))


def test_micro_steps_and_several_data_types(tmp_path, make_record):
    writer = ParquetWriter(tmp_path, rank=0)
    for step in range(2):
        for micro in range(2):
            values = _values(10 * step + micro)
            writer.write(make_record("actv", step, NAMES, values, OPS, micro_steps=[micro] * 3))
        writer.write(make_record("exp_avg", step, NAMES, _values(step), OPS))
        writer.end_step(step)
    writer.close()
    rows = _read(tmp_path)
    actv = {(r[1], r[2], r[4], r[5]): r[6] for r in rows if r[7] == "actv"}
    assert len(actv) == 2 * 2 * len(NAMES) * len(OPS)
    assert actv[(1, 1, NAMES[2], "min")] == _values(11)[2, 1]
    assert {r[2] for r in rows if r[7] == "exp_avg"} == {None}
    assert set(live_prefixes(str(tmp_path))) == {"actv", "exp_avg"}


def test_files_are_private_and_no_temporary_file_is_left(tmp_path, make_record):
    old = os.umask(0o077)
    try:
        _write(tmp_path, make_record, range(3), merge_steps=2)
    finally:
        os.umask(old)
    directory = os.path.join(tmp_path, "values", "data_type=grad_reduced")
    for name in os.listdir(directory):
        assert name.endswith(".parquet"), name
        assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o640


def test_a_kill_between_merging_and_deleting_leaves_no_value_twice(tmp_path, make_record, monkeypatch):
    """The merged file is in place, the step files it covers are not yet deleted (the writer
    stands for a process killed there); a later writer on the directory deletes them."""
    with monkeypatch.context() as patch:
        patch.setattr(ParquetWriter, "_remove_merged", staticmethod(lambda paths: None))
        writer = _write(tmp_path, make_record, range(3), merge_steps=2, close=False)
        writer.write(_record(make_record, 3))
        while writer.idle():
            pass
    assert "step-0000000000.parquet" in _files(tmp_path)
    directory = os.path.join(tmp_path, "values", "data_type=grad_reduced")
    assert [os.path.basename(p) for p in live_parts(directory)] == [
        "steps-0000000000-0000000001.parquet",
        "step-0000000002.parquet",
    ]
    resumed = ParquetWriter(tmp_path, rank=3, merge_steps=2)
    resumed.write(_record(make_record, 3))
    resumed.end_step(3)
    assert _files(tmp_path) == [
        "step-0000000002.parquet",
        "step-0000000003.parquet",
        "steps-0000000000-0000000001.parquet",
    ]
    assert _same(_read(tmp_path), _expected(range(4)))


def test_a_resumed_run_does_not_write_a_step_again(tmp_path, make_record, caplog):
    _write(tmp_path, make_record, range(3))
    writer = ParquetWriter(tmp_path, rank=3)
    for step in range(2, 5):
        values = _values(step) + (100.0 if step == 2 else 0.0)  # the repeated step differs
        writer.write(make_record("grad_reduced", step, NAMES, values, OPS, vpp_stages=[0, 1, 0]))
        writer.end_step(step)
    writer.close()
    assert _same(_read(tmp_path), _expected(range(5)))
    assert "step 2 is already in" in caplog.text
    assert "1 step(s) from 2 to 2 were already written by an earlier run" in caplog.text


def test_a_record_arriving_after_its_step_ended_gets_a_file_of_its_own(tmp_path, make_record):
    writer = _write(tmp_path, make_record, range(2), close=False)
    writer.write(make_record("grad_reduced", 1, ("late",), [[1.0, 2.0, 3.0, 0.0]], OPS))
    writer.end_step(1)
    assert "step-0000000001.1.parquet" in _files(tmp_path)
    writer.close()
    rows = _read(tmp_path)
    assert sorted(r[6] for r in rows if r[4] == "late") == [0.0, 1.0, 2.0, 3.0]


def test_format_parquet_in_the_config():
    assert load_config({"format": "Parquet"}).format == "parquet"
    with pytest.raises(ConfigError, match=r"format.*'parquets'"):
        load_config({"format": "parquets"})


@pytest.mark.parametrize("ops", [("norm",), OPS], ids=["one-op", "four-ops"])
def test_read_wide_gives_one_entry_per_tensor_and_step(tmp_path, make_record, ops):
    from monitor.query.parquet_values import read_wide

    writer = ParquetWriter(tmp_path, rank=0, merge_steps=2)
    for step in range(3):
        values = _values(step)[:, : len(ops)]
        writer.write(make_record("grad_reduced", step, NAMES, values, ops, vpp_stages=[1, 1, 1]))
        writer.end_step(step)
    writer.close()
    wide = read_wide(live_prefixes(str(tmp_path))["grad_reduced"])
    assert wide.present is None and wide.micro is None and len(wide.steps) == 3 * len(NAMES)
    got = {}
    for entry, (row, step) in enumerate(zip(wide.row_of, wide.steps)):
        assert wide.vpp[row] == 1
        for column, op in enumerate(wide.ops):
            got[(wide.names[row], int(step), op)] = wide.values[entry, column]
    expected = {
        (name, step, op): _values(step)[row, column]
        for step in range(3)
        for row, name in enumerate(NAMES)
        for column, op in enumerate(ops)
    }
    assert got.keys() == expected.keys()
    assert all(got[k] == v or (np.isnan(got[k]) and np.isnan(v)) for k, v in expected.items())


def test_a_record_of_a_merged_window_gets_a_late_file_that_no_merge_hides(tmp_path, make_record):
    writer = _write(tmp_path, make_record, range(4), merge_steps=2, close=False)
    writer.write(_record(make_record, 4))
    writer.end_step(4)
    while writer.idle():  # merges windows 0 and 1
        pass
    late = [("late.a",), ("late.b",)]
    for names in late:  # two late records of step 1, each ended on its own
        writer.write(make_record("grad_reduced", 1, names, [[1.0, 2.0, 3.0, 0.0]], OPS))
        writer.end_step(4)
    files = _files(tmp_path)
    assert {"late-0000000001-0.parquet", "late-0000000001-1.parquet"} <= set(files)
    writer.close()
    resumed = ParquetWriter(tmp_path, rank=3, merge_steps=2)  # a restart on the directory
    resumed.write(_record(make_record, 5))
    resumed.close()
    rows = _read(tmp_path)
    assert sorted(r[4] for r in rows if r[4].startswith("late")) == ["late.a"] * 4 + ["late.b"] * 4
    assert _same([r for r in rows if not r[4].startswith("late")], _expected(range(6)))


def test_a_failed_write_never_writes_another_data_type_twice(tmp_path, make_record, monkeypatch):
    writer = ParquetWriter(tmp_path, rank=3)
    writer.write(_record(make_record, 0))
    writer.write(make_record("exp_avg", 0, NAMES, _values(0), OPS))
    write = ParquetWriter._write

    def fail_for_exp_avg(self, row_groups, path, level):
        if "exp_avg" in path:
            raise OSError(28, "No space left on device")
        write(self, row_groups, path, level)

    monkeypatch.setattr(ParquetWriter, "_write", fail_for_exp_avg)
    with pytest.raises(OSError):
        writer.end_step(0)
    writer.close()  # what the writer thread does after a failure
    assert _same([r for r in _read(tmp_path) if r[7] == "grad_reduced"], _expected([0]))


def test_an_unreadable_step_file_stays_and_the_run_goes_on(tmp_path, make_record, caplog):
    directory = os.path.join(tmp_path, "values", "data_type=grad_reduced")
    os.makedirs(directory)
    with open(os.path.join(directory, "step-0000000002.parquet"), "wb"):
        pass  # a file a power loss left empty
    writer = ParquetWriter(tmp_path, rank=3, merge_steps=2)
    for step in range(3, 7):
        writer.write(_record(make_record, step))
        writer.end_step(step)
    writer.close()
    assert "could not merge Parquet step files" in caplog.text
    files = _files(tmp_path)
    assert {"step-0000000002.parquet", "step-0000000003.parquet"} <= set(files)  # as they were
    assert "steps-0000000004-0000000005.parquet" in files  # the next window merged
    good = [os.path.join(directory, f) for f in files if f != "step-0000000002.parquet"]
    rows = duckdb.sql(
        f"SELECT rank, step, micro_step, vpp_stage, name, op, value, 'grad_reduced' FROM read_parquet({good})"
    ).fetchall()
    assert _same(rows, _expected(range(3, 7)))


def test_temporary_files_of_a_killed_run_are_removed_and_merged_files_never_replaced(tmp_path, make_record):
    directory = os.path.join(tmp_path, "values", "data_type=grad_reduced")
    os.makedirs(directory)
    stale = os.path.join(directory, ".tmp-abc.parquet.tmp")
    with open(stale, "wb") as handle:
        handle.write(b"half a merge")
    writer = ParquetWriter(tmp_path, rank=3, merge_steps=4)
    writer.write(_record(make_record, 0))
    assert not os.path.exists(stale)
    writer.end_step(0)
    writer.write(_record(make_record, 1))
    writer.end_step(1)
    taken = os.path.join(directory, "steps-0000000000-0000000001.parquet")
    with open(taken, "wb") as handle:
        handle.write(b"not ours to replace")
    writer.close()
    with open(taken, "rb") as handle:
        assert handle.read() == b"not ours to replace"
    assert "step-0000000000.parquet" in _files(tmp_path)


def test_a_window_of_one_step_file_is_not_rewritten(tmp_path, make_record):
    _write(tmp_path, make_record, [0, 4, 8], merge_steps=4)
    assert _files(tmp_path) == [f"step-{s:010d}.parquet" for s in (0, 4, 8)]
    assert _same(_read(tmp_path), _expected([0, 4, 8]))


@pytest.mark.parametrize("steps_per_row_group", [1, None], ids=["a step a row group", "one row group"])
def test_a_merge_advances_one_piece_per_idle_call(tmp_path, make_record, monkeypatch, steps_per_row_group):
    """A big window's merge never holds up a record for long: the writer thread advances it by
    one step file's reading or one row group's writing at a time, while nothing is queued (a
    window that makes one row group was read in one go: a hundred small files, 0.3 s)."""
    import monitor.writers.parquet as parquet_writer

    if steps_per_row_group is not None:
        monkeypatch.setattr(parquet_writer, "MERGE_ROWS", steps_per_row_group * len(NAMES) * len(OPS))
    writer = _write(tmp_path, make_record, range(5), merge_steps=4, close=False)
    writer.write(_record(make_record, 5))
    assert "steps-0000000000-0000000003.parquet" not in _files(tmp_path)  # records never merge
    for _ in range(3):  # the first three of four row groups
        assert writer.idle()
        assert "steps-0000000000-0000000003.parquet" not in _files(tmp_path)  # under way
    assert not writer.idle()
    assert "steps-0000000000-0000000003.parquet" in _files(tmp_path)
    assert not any(f.startswith("step-000000000") and f < "step-0000000004" for f in _files(tmp_path))
    writer.end_step(5)
    writer.close()
    assert _same(_read(tmp_path), _expected(range(6)))
