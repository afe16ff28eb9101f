"""monitor.writers._csv_rows: the CSV text of statistics rows is exactly Python's ``%g``."""

from __future__ import annotations

import numpy as np
import pytest

import monitor.writers.csv as csv_writer
from monitor.writers.csv import CsvWriter

_csv_rows = csv_writer._csv_rows


def test_the_extension_is_built():
    assert _csv_rows is not None, "monitor.writers._csv_rows was not built (pip install -e .)"


def _python_g(x: float, digits: int) -> str:
    """What the writer's Python path writes: %-formatting."""
    return "%.*g" % (digits, x)  # noqa: UP031 (the %-operator is the reference)


def _hard_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random bit patterns (NaNs, infinities, subnormals included), values across 60 decades,
    ties at 1 to 8 significant digits, integers, float32 values, and their neighbours."""
    ties = (rng.integers(0, 10**8, n) + 0.5) * 10.0 ** rng.integers(-12, 12, n)
    values = np.concatenate(
        [
            np.frombuffer(rng.bytes(8 * n), dtype=np.float64),
            rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n),
            ties,
            np.nextafter(ties, np.inf),
            np.nextafter(ties, -np.inf),
            rng.integers(-(10**12), 10**12, n).astype(np.float64),
            rng.standard_normal(n).astype(np.float32).astype(np.float64),
            10.0 ** np.arange(-320, 309, dtype=np.float64)[: n // 10],
            [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 5e-324, np.finfo(np.float64).max],
        ]
    )
    return values


@pytest.mark.parametrize("digits", [1, 2, 3, 6, 8, 12, 15, 16, 17])
def test_every_value_is_written_as_python_writes_it(digits):
    assert _csv_rows is not None
    values = _hard_values(np.random.default_rng(digits), 20000)
    wrong = [
        (x, text, _python_g(x, digits))
        for x in values.tolist()
        if (text := _csv_rows.format_value(x, digits)) != _python_g(x, digits)
    ]
    assert not wrong, wrong[:5]


def test_rows_are_heads_step_tails_and_values():
    assert _csv_rows is not None
    values = np.array([[1.5, np.nan, 3.0], [-0.0, 1e-7, 123456789.0]])
    text = _csv_rows.format_rows(
        ["0,a,", '1,"b,c",'], "12", [",", ",3,"], values, np.array([6, 6, 17], dtype=np.int32)
    )
    assert text == "0,a,12,1.5,nan,3\n" + '1,"b,c",12,3,-0,1e-07,123456789\n'


@pytest.mark.parametrize(
    ("values", "digits", "message"),
    [
        (np.zeros((2, 2), dtype=np.float32), [6, 6], "float64"),
        (np.zeros((2, 2)), [6], "digits per column"),
        (np.zeros((2, 2)), [6, 18], "digits must be 1 to 17, got 18"),
    ],
)
def test_bad_input_is_refused_with_what_was_expected(values, digits, message):
    assert _csv_rows is not None
    with pytest.raises(ValueError, match=message):
        _csv_rows.format_rows(["a,", "b,"], "0", [",", ","], values, np.array(digits, dtype=np.int32))
    with pytest.raises(ValueError, match="heads must be a list of 2 str"):
        _csv_rows.format_rows(["a,"], "0", [",", ","], np.zeros((2, 1)), np.array([6], dtype=np.int32))


def test_the_writer_writes_the_same_bytes_with_and_without_the_extension(tmp_path, make_record, monkeypatch):
    """Names to quote, a NUL, micro-steps, exact counts beyond 2^53, non-finite values: the file
    made with the extension equals the one made by Python's formatting."""
    rng = np.random.default_rng(0)
    names = ['all_reduce,group "tp"', "nul\x00inside", "100%_sparse.w", "layers.0.w"]
    ops = ("min", "max", "norm", "mean", "nans", "numel")
    values = rng.standard_normal((4, 6)) * 10.0 ** rng.integers(-20, 20, (4, 6))
    values[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    values[:, 4:] = [[3, 2.0**60], [0, 7], [1, 1e17], [2, 12345678901234567]]
    written = []
    for module in (_csv_rows, None):
        monkeypatch.setattr(csv_writer, "_csv_rows", module)
        out = tmp_path / ("c" if module else "python")
        out.mkdir()
        writer = CsvWriter(out, ndigits=7, step_count_per_record=10)
        for step in (3, 4):
            record = make_record("other", step, names, values + step, ops, micro_steps=[0, 1, 0, 1])
            writer.write(record)
        writer.close()
        written.append((out / "other_0-9.csv").read_bytes())
    assert written[0] == written[1]
    assert written[0].count(b"\n") == 1 + 2 * len(names)
