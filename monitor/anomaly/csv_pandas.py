"""Parsing the monitor's CSV text with pandas, where pyarrow (the dataset extra) is not installed.

The same result as pyarrow's reader in ``monitor.anomaly.rank_csv.parse_arrow``: every value
exactly as written (correctly rounded), a tensor called ``nan`` kept as a name; where a row does
not parse, the rows with a wrong field count, a label that is not an integer or a value that is
not a number are dropped and counted.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd

from monitor.anomaly.rank_csv import NAN_TEXT

#: parse floats as Python's float() does: pandas 2's default ("high") is off by an ulp on about
#: 4% of 6-digit values, so it is asked for "round_trip"; pandas 3 rounds correctly by default
#: and deprecates the choice (a warning in every reader's output)
_EXACT_FLOATS = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


def read_frame(data: bytes, labels: list[str], ops: tuple[str, ...]) -> tuple[Any, int]:
    """The label and op columns of CSV text (header first) as a DataFrame, and the count of rows
    dropped as malformed."""
    # every column read (no usecols), so that a row with too many fields is an error, not kept
    common = {"keep_default_na": False, "encoding_errors": "replace", **_EXACT_FLOATS}
    dtypes = {**dict.fromkeys(ops, np.float64), **dict.fromkeys(labels, np.int64), "name": "category"}
    na_values = dict.fromkeys(ops, NAN_TEXT)  # a tensor may be called "nan"
    try:
        frame = pd.read_csv(io.BytesIO(data), dtype=dtypes, na_values=na_values, **common)
        return frame[labels + list(ops)], 0
    except (ValueError, pd.errors.ParserError):
        return _read_leniently(data, labels, ops, common)


def _read_leniently(data: bytes, labels: list[str], ops: tuple[str, ...], common: dict) -> tuple[Any, int]:
    """Drop rows with a wrong field count, a non-integer label or a value cell that is not a number."""
    frame = pd.read_csv(io.BytesIO(data), dtype=str, on_bad_lines="skip", **common)[labels + list(ops)]
    good = np.ones(len(frame), dtype=bool)
    for column in [c for c in labels if c != "name"] + list(ops):
        text = frame[column].fillna("")
        number = pd.to_numeric(text, errors="coerce")
        if column in ops:
            good &= ~(number.isna() & ~text.isin(NAN_TEXT)).to_numpy()
            number = text.map(_exact_float)  # to_numeric's own parsing does not round-trip
        else:
            good &= (number.notna() & (number % 1 == 0)).to_numpy()
        frame[column] = number
    frame = frame[good].astype(dict.fromkeys((c for c in labels if c != "name"), np.int64))
    return frame, data.count(b"\n") - 1 - len(frame)


def _exact_float(text: str) -> float:
    """A cell's value, correctly rounded (NaN where it is not a number: its row is dropped)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")
