"""CsvWriter (monitor/writers/csv.py): names, header, rows, number format, file safety."""

from __future__ import annotations

import csv
import math
import os
import stat

import numpy as np
import pandas as pd
import pytest

import monitor.writers.csv as csv_writer
from monitor.writers.csv import CsvWriter

OPS = ("norm", "min", "max", "nans")
NAMES = ("layers.0.fc1.weight", "layers.0.fc2.weight", "layers.1.fc1.weight")


def _values(step: int) -> np.ndarray:
    rng = np.random.default_rng(step)
    values = rng.standard_normal((len(NAMES), len(OPS)))
    values[:, 3] = rng.integers(0, 5, len(NAMES))
    return values


def _write_steps(tmp_path, make_record, steps, window=1, ndigits=6, prefix="grad_reduced"):
    writer = CsvWriter(tmp_path, ndigits=ndigits, step_count_per_record=window)
    for step in steps:
        writer.write(make_record(prefix, step, NAMES, _values(step), OPS, task="post_grad"))
        writer.end_step(step)
    writer.close()


def _csv_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".csv"))


# --------------------------------------------------------------------------------------------- file names


def test_one_file_per_step_with_step_count_per_record_1(tmp_path, make_record):
    _write_steps(tmp_path, make_record, [0, 1, 7], window=1)
    assert _csv_files(tmp_path) == ["grad_reduced_0-0.csv", "grad_reduced_1-1.csv", "grad_reduced_7-7.csv"]


def test_files_are_aligned_to_absolute_step_windows(tmp_path, make_record):
    _write_steps(tmp_path, make_record, [3, 4, 5, 6, 9, 10, 12], window=5)
    assert _csv_files(tmp_path) == ["grad_reduced_0-4.csv", "grad_reduced_10-14.csv", "grad_reduced_5-9.csv"]
    assert pd.read_csv(tmp_path / "grad_reduced_0-4.csv")["step"].unique().tolist() == [3, 4]
    assert pd.read_csv(tmp_path / "grad_reduced_5-9.csv")["step"].unique().tolist() == [5, 6, 9]
    assert pd.read_csv(tmp_path / "grad_reduced_10-14.csv")["step"].unique().tolist() == [10, 12]


def test_file_name_method_matches_the_reference_pattern():
    writer = CsvWriter("unused", step_count_per_record=5)
    assert writer.file_name("exp_avg_sq", 0) == "exp_avg_sq_0-4.csv"
    assert writer.file_name("exp_avg_sq", 4) == "exp_avg_sq_0-4.csv"
    assert writer.file_name("exp_avg_sq", 5) == "exp_avg_sq_5-9.csv"
    assert writer.file_name("exp_avg_sq", 123) == "exp_avg_sq_120-124.csv"


def test_each_prefix_gets_its_own_file(tmp_path, make_record):
    writer = CsvWriter(tmp_path)
    writer.write(make_record("exp_avg", 2, NAMES, _values(2), OPS))
    writer.write(make_record("exp_avg_sq", 2, NAMES, _values(3), OPS))
    writer.close()
    assert _csv_files(tmp_path) == ["exp_avg_2-2.csv", "exp_avg_sq_2-2.csv"]


# --------------------------------------------------------------------------------------------- header, rows


def test_header_without_micro_step(tmp_path, make_record):
    _write_steps(tmp_path, make_record, [0])
    header = (tmp_path / "grad_reduced_0-0.csv").read_text().splitlines()[0]
    assert header == "vpp_stage,name,step,norm,min,max,nans"


def test_header_and_rows_with_micro_step(tmp_path, make_record):
    writer = CsvWriter(tmp_path)
    names = ["layers.0.fc1.input", "layers.0.fc1.output", "layers.0.fc1.input"]
    values = [[1.5, -2.0], [3.25, 0.5], [4.0, -1.0]]
    record = make_record(
        "actv", 3, names, values, ("norm", "min"), vpp_stages=[1, 1, 1], micro_steps=[0, 0, 1]
    )
    writer.write(record)
    writer.close()
    lines = (tmp_path / "actv_3-3.csv").read_text().splitlines()
    assert lines == [
        "vpp_stage,name,step,micro_step,norm,min",
        "1,layers.0.fc1.input,3,0,1.5,-2",
        "1,layers.0.fc1.output,3,0,3.25,0.5",
        "1,layers.0.fc1.input,3,1,4,-1",
    ]


def test_one_line_per_row_per_step_and_one_header(tmp_path, make_record):
    steps = [0, 1, 2, 3, 4]
    _write_steps(tmp_path, make_record, steps, window=5)
    text = (tmp_path / "grad_reduced_0-4.csv").read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 1 + len(steps) * len(NAMES)
    assert sum(line.startswith("vpp_stage,") for line in lines) == 1
    frame = pd.read_csv(tmp_path / "grad_reduced_0-4.csv")
    assert frame["step"].tolist() == [s for s in steps for _ in NAMES]
    assert frame["name"].tolist() == list(NAMES) * len(steps)
    assert (frame["vpp_stage"] == 0).all()


def test_values_read_back_within_ndigits(tmp_path, make_record):
    _write_steps(tmp_path, make_record, [0, 1], window=2)
    frame = pd.read_csv(tmp_path / "grad_reduced_0-1.csv")
    expected = np.vstack([_values(0), _values(1)])
    np.testing.assert_allclose(frame[list(OPS)].to_numpy(), expected, rtol=5e-6, atol=0)


def test_empty_record_writes_nothing(tmp_path, make_record):
    writer = CsvWriter(tmp_path)
    writer.write(make_record("grad_reduced", 0, [], np.zeros((0, 2)), ("norm", "min")))
    writer.close()
    assert _csv_files(tmp_path) == []


# --------------------------------------------------------------------------------------------- numbers


def _single_value_line(tmp_path, make_record, value, op="norm", ndigits=6) -> str:
    writer = CsvWriter(tmp_path, ndigits=ndigits)
    writer.write(make_record("exp_avg_sq", 0, ["w"], [[value]], (op,)))
    writer.close()
    return (tmp_path / "exp_avg_sq_0-0.csv").read_text().splitlines()[1]


def test_small_value_keeps_significant_digits(tmp_path, make_record):
    # msprobe rounds to decimal places and writes 0.0 here
    assert _single_value_line(tmp_path, make_record, 1.23456789e-12) == "0,w,0,1.23457e-12"


def test_large_value_keeps_significant_digits(tmp_path, make_record):
    assert _single_value_line(tmp_path, make_record, 98765432.1) == "0,w,0,9.87654e+07"


def test_ndigits_sets_the_number_of_significant_digits(tmp_path, make_record):
    assert _single_value_line(tmp_path, make_record, math.pi, ndigits=3) == "0,w,0,3.14"


def test_nans_count_is_written_as_an_exact_integer(tmp_path, make_record):
    # 123456789 has 9 significant digits, more than ndigits=6
    assert _single_value_line(tmp_path, make_record, 123456789.0, op="nans") == "0,w,0,123456789"


def test_zero_nans_count_is_written_as_0(tmp_path, make_record):
    assert _single_value_line(tmp_path, make_record, 0.0, op="nans") == "0,w,0,0"


def test_nan_and_inf_are_written_as_text_and_read_back_by_pandas(tmp_path, make_record):
    writer = CsvWriter(tmp_path)
    values = [[np.nan, np.inf, -np.inf, np.nan]]
    writer.write(make_record("grad_reduced", 0, ["w"], values, OPS))
    writer.close()
    path = tmp_path / "grad_reduced_0-0.csv"
    assert path.read_text().splitlines()[1] == "0,w,0,nan,inf,-inf,nan"
    row = pd.read_csv(path).iloc[0]
    assert np.isnan(row["norm"])
    assert row["min"] == np.inf
    assert row["max"] == -np.inf
    assert np.isnan(row["nans"])
    assert pd.read_csv(path)[list(OPS)].dtypes.map(lambda d: d.kind).tolist() == ["f"] * 4


# --------------------------------------------------------------------------------------------- files


def test_new_file_mode_is_0640_under_umask_077(tmp_path, make_record):
    previous = os.umask(0o077)
    try:
        _write_steps(tmp_path, make_record, [0])
    finally:
        os.umask(previous)
    mode = stat.S_IMODE(os.stat(tmp_path / "grad_reduced_0-0.csv").st_mode)
    assert mode == 0o640


def test_symlink_at_the_file_path_is_refused_and_not_followed(tmp_path, make_record):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "grad_reduced_0-0.csv")
    writer = CsvWriter(out)
    with pytest.raises(OSError, match="symlink"):
        writer.write(make_record("grad_reduced", 0, NAMES, _values(0), OPS))
    writer.close()
    assert victim.read_text() == "keep me\n"
    assert os.path.islink(out / "grad_reduced_0-0.csv")


def test_dangling_symlink_at_the_file_path_is_refused_and_target_not_created(tmp_path, make_record):
    target = tmp_path / "elsewhere.csv"
    os.symlink(target, tmp_path / "grad_reduced_0-0.csv")
    writer = CsvWriter(tmp_path)
    with pytest.raises(OSError):
        writer.write(make_record("grad_reduced", 0, NAMES, _values(0), OPS))
    writer.close()
    assert not target.exists()


def test_existing_file_is_appended_without_a_second_header(tmp_path, make_record):
    _write_steps(tmp_path, make_record, [0], window=5)
    _write_steps(tmp_path, make_record, [1], window=5)  # a new writer (append_output)
    lines = (tmp_path / "grad_reduced_0-4.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * len(NAMES)
    assert sum(line.startswith("vpp_stage,") for line in lines) == 1


def test_a_resumed_run_writes_no_step_again_and_says_every_one_it_left_out(tmp_path, make_record, caplog):
    """The earlier run's files span three windows; each window's file says which steps it holds,
    so steps left out are found file by file: the warnings name the first and, at close, all."""
    _write_steps(tmp_path, make_record, range(10), window=4)
    before = {name: (tmp_path / name).read_text() for name in _csv_files(tmp_path)}
    _write_steps(tmp_path, make_record, range(12), window=4)
    for name, text in before.items():  # the earlier rows first, as they were
        assert (tmp_path / name).read_text().startswith(text)
    steps = pd.concat(pd.read_csv(tmp_path / name) for name in _csv_files(tmp_path))["step"]
    assert sorted(steps.unique()) == list(range(12)) and len(steps) == 12 * len(NAMES)
    said = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(said) == 2 and "step 0 is already in" in said[0], said
    assert "10 step(s) from 0 to 9 were already written" in said[1], said


def test_names_with_commas_and_quotes_are_quoted(tmp_path, make_record):
    names = ['all_reduce,group "tp"', "plain", "line\nbreak"]
    writer = CsvWriter(tmp_path)
    writer.write(make_record("other", 0, names, [[1.0], [2.0], [3.0]], ("norm",)))
    writer.close()
    frame = pd.read_csv(tmp_path / "other_0-0.csv")
    assert frame["name"].tolist() == names
    assert frame["norm"].tolist() == [1.0, 2.0, 3.0]
    assert frame["step"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("extension", [True, False], ids=["C rows", "templates"])
@pytest.mark.parametrize("odd", ["100%_sparse.weight", "nul\x00inside"])
def test_names_with_format_characters_are_written_as_they_are_at_every_step(
    tmp_path, make_record, odd, extension, monkeypatch
):
    if not extension:  # Python's formatting, where the extension was not built
        monkeypatch.setattr(csv_writer, "_csv_rows", None)
    monkeypatch.setattr(csv_writer, "TEMPLATE_ROWS", 2)  # pieces of 2 rows: 3 rows make two
    names = [odd, "plain%s", "layers.0.w"]
    writer = CsvWriter(tmp_path, step_count_per_record=10)
    for step in (3, 4):  # the second write reuses what the first built
        writer.write(make_record("other", step, names, [[1.5, 0], [2.5, 1], [-3.5, 2]], ("norm", "nans")))
    writer.close()
    with open(tmp_path / "other_0-9.csv", newline="", encoding="utf-8") as handle:
        header, *rows = list(csv.reader(handle))  # Python's reader keeps a NUL; pandas' cuts there
    assert header == ["vpp_stage", "name", "step", "norm", "nans"]
    assert [row[1] for row in rows] == names * 2
    assert [int(row[2]) for row in rows] == [3, 3, 3, 4, 4, 4]
    assert [float(row[3]) for row in rows] == [1.5, 2.5, -3.5] * 2
    assert [row[4] for row in rows] == ["0", "1", "2"] * 2


def test_rows_are_flushed_after_each_write(tmp_path, make_record):
    writer = CsvWriter(tmp_path)
    writer.write(make_record("grad_reduced", 0, NAMES, _values(0), OPS))
    # not closed: a reader (or a crash right now) sees every row of the record
    assert len((tmp_path / "grad_reduced_0-0.csv").read_text().splitlines()) == 1 + len(NAMES)
    writer.close()


def test_rows_are_never_written_under_a_header_with_other_ops(tmp_path, make_record):
    first = CsvWriter(tmp_path, step_count_per_record=5)
    first.write(make_record("grad_reduced", 0, ["w"], [[1.0, -2.0]], ("norm", "min")))
    first.close()
    second = CsvWriter(tmp_path, step_count_per_record=5)  # a resumed run whose config asks for max
    second.write(make_record("grad_reduced", 1, ["w"], [[3.0, 7.0]], ("norm", "max")))
    second.close()
    found = {}
    for name in _csv_files(tmp_path):
        frame = pd.read_csv(tmp_path / name)
        for _, row in frame.iterrows():
            for op in ("norm", "min", "max"):
                if op in frame.columns and not pd.isna(row[op]):
                    found[(int(row["step"]), op)] = row[op]
    assert found == {(0, "norm"): 1.0, (0, "min"): -2.0, (1, "norm"): 3.0, (1, "max"): 7.0}
