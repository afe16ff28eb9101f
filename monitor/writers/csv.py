"""msprobe-compatible CSV output: ``{prefix}_{a}-{b}.csv`` per data type and step window.

Header ``vpp_stage,name,step[,micro_step],<ops>``; one row per tag. Values keep ``ndigits``
significant digits (not decimal places, so small values such as exp_avg_sq stay visible);
counts are written exactly. A record's rows are written with one write call and flushed, so a
crash leaves only whole lines.

The text of a record is made by the C extension monitor.writers._csv_rows (the same characters
as Python's ``%g``, four times faster, without the interpreter lock) where it was built, else
by %-formatting cached row templates.
"""

from __future__ import annotations

import csv
import itertools
import logging
import os
import weakref
from typing import TextIO

import numpy as np

from monitor.files import FILE_MODE, open_append
from monitor.record import RowSet, StepRecord
from monitor.writers.base import RepeatedSteps

try:
    from monitor.writers import _csv_rows
except ImportError:  # built without a C compiler: rows are %-formatted from templates
    _csv_rows = None

logger = logging.getLogger("trainmon")

#: ops written as exact integers.
EXACT_OPS = ("nans", "calls", "numel", "partial")
#: stands for the step in a cached row template
_STEP = "\x00"
#: rows per piece of a template (one piece is formatted while holding the interpreter lock)
TEMPLATE_ROWS = 256


def _csv_field(text: str) -> str:
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _last_step(path: str) -> int:
    """The largest step in an existing CSV of ours (-1 when it has no rows)."""
    last = -1
    with open(path, encoding="utf-8", newline="") as handle:
        for row in csv.reader(handle):
            if len(row) > 2 and row[2].isdigit():
                last = max(last, int(row[2]))
    return last


def _first_line(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as handle:
        return handle.readline()


class CsvWriter:
    """Writes StepRecords into per-prefix, per-window CSV files in ``out_dir``."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        ndigits: int = 6,
        step_count_per_record: int = 1,
        file_mode: int = FILE_MODE,
    ) -> None:
        self.out_dir = os.fspath(out_dir)
        self.ndigits = ndigits
        self.window = step_count_per_record
        self.file_mode = file_mode
        self._files: dict[str, tuple[int, TextIO]] = {}
        self._templates: weakref.WeakKeyDictionary[RowSet, dict[tuple[str, ...], list[str]]] = (
            weakref.WeakKeyDictionary()
        )
        self._formats: dict[tuple[str, ...], str] = {}
        #: per RowSet, the text of each row before and after its step (for _csv_rows)
        self._row_texts: weakref.WeakKeyDictionary[RowSet, tuple[list[str], list[str]]] = (
            weakref.WeakKeyDictionary()
        )
        self._digits: dict[tuple[str, ...], np.ndarray] = {}
        #: per prefix, the last step already in a file this writer continues (a resumed run).
        self._resumed_last: dict[str, int] = {}
        self._repeated = RepeatedSteps()

    def file_name(self, prefix: str, step: int) -> str:
        start = (step // self.window) * self.window
        return f"{prefix}_{start}-{start + self.window - 1}.csv"

    def _file(self, record: StepRecord) -> TextIO:
        start = (record.step // self.window) * self.window
        current = self._files.get(record.prefix)
        if current is not None and current[0] == start:
            return current[1]
        if current is not None:
            current[1].close()
        micro = ["micro_step"] if record.has_micro_step else []
        header = ",".join(["vpp_stage", "name", "step", *micro, *record.ops]) + "\n"
        name = self.file_name(record.prefix, record.step)
        for attempt in itertools.count(1):
            path = os.path.join(self.out_dir, name)
            handle, created = open_append(path, self.file_mode)
            if created:
                handle.write(header)
                break
            if _first_line(path) == header:
                self._resumed_last[record.prefix] = _last_step(path)
                break
            # An earlier run (append_output) wrote other columns: never mix them (labels would drift
            # from values).
            handle.close()
            name = f"{name.removesuffix('.csv').rsplit('.', 1)[0]}.{attempt}.csv"
        self._files[record.prefix] = (start, handle)
        return handle

    @staticmethod
    def _heads(rows: RowSet) -> list[tuple[str, str]]:
        """Per row, the text before and after the step column."""
        micro = rows.micro_steps if rows.micro_steps is not None else (None,) * len(rows)
        return [
            (f"{v},{_csv_field(n)},", "," if m is None else f",{m},")
            for v, n, m in zip(rows.vpp_stages, rows.names, micro)
        ]

    def _template(self, rows: RowSet, ops: tuple[str, ...]) -> list[str] | None:
        """Every row of a RowSet as %-format strings of ``TEMPLATE_ROWS`` rows each, with ``_STEP``
        where the step goes, built once per RowSet: a record is then written by string operations
        in C, not by Python work per row; in pieces, so the training thread never waits long for
        the interpreter lock. None where a name itself holds ``_STEP``."""
        by_ops = self._templates.get(rows)
        if by_ops is None:
            by_ops = self._templates[rows] = {}
        template = by_ops.get(ops)
        if template is None:
            values = self._value_format(ops)
            lines = [
                before.replace("%", "%%") + _STEP + after.replace("%", "%%") + values
                for before, after in self._heads(rows)
            ]
            pieces = ["".join(lines[i : i + TEMPLATE_ROWS]) for i in range(0, len(lines), TEMPLATE_ROWS)]
            template = by_ops[ops] = pieces if sum(p.count(_STEP) for p in pieces) == len(rows) else []
        return template or None

    def _texts(self, rows: RowSet) -> tuple[list[str], list[str]]:
        """Per row, the text before and after its step, built once per RowSet."""
        found = self._row_texts.get(rows)
        if found is None:
            heads = self._heads(rows)
            found = self._row_texts[rows] = ([h for h, _ in heads], [t for _, t in heads])
        return found

    def _column_digits(self, ops: tuple[str, ...]) -> np.ndarray:
        """Significant digits per column: exact for counts, ``ndigits`` for the rest."""
        digits = self._digits.get(ops)
        if digits is None:
            digits = self._digits[ops] = np.array(
                [17 if op in EXACT_OPS else self.ndigits for op in ops], dtype=np.int32
            )
        return digits

    def _value_format(self, ops: tuple[str, ...]) -> str:
        fmt = self._formats.get(ops)
        if fmt is None:
            fmt = ",".join("%.17g" if op in EXACT_OPS else f"%.{self.ndigits}g" for op in ops) + "\n"
            self._formats[ops] = fmt
        return fmt

    def write(self, record: StepRecord) -> None:
        if len(record.rows) == 0:
            return
        handle = self._file(record)
        if record.step <= self._resumed_last.get(record.prefix, -1):  # a resumed run repeats steps
            where = handle.name if isinstance(handle.name, str) else self.out_dir
            self._repeated.leave_out(record.prefix, record.step, where)
            return
        values = record.resolve()
        step = str(record.step)
        if _csv_rows is not None:
            heads, tails = self._texts(record.rows)
            handle.write(
                _csv_rows.format_rows(
                    heads,
                    step,
                    tails,
                    np.ascontiguousarray(values, dtype=np.float64),
                    self._column_digits(record.ops),
                )
            )
            handle.flush()
            return
        template = self._template(record.rows, record.ops)
        if template is not None:
            flat = values.ravel().tolist()
            width = TEMPLATE_ROWS * len(record.ops)
            text = "".join(
                piece.replace(_STEP, step) % tuple(flat[k * width : (k + 1) * width])
                for k, piece in enumerate(template)
            )
        else:
            fmt = self._value_format(record.ops)
            text = "".join(
                before + step + after + fmt % tuple(row)
                for (before, after), row in zip(self._heads(record.rows), values.tolist())
            )
        handle.write(text)
        handle.flush()

    def end_step(self, step: int) -> None:
        for _, handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        self._repeated.close()
        files, self._files = self._files, {}
        for _, handle in files.values():
            handle.close()
