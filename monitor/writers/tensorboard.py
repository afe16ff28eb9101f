"""TensorBoard event files without torch or TensorFlow, with msprobe's tags.

One Event per StepRecord: ``step`` = monitor step, one scalar ``"{tag}_{op}"`` per (row, op), the
msprobe's tag spelling. Two things make it fast: the Event is built once per RowSet and only its
values are set per step, and the record checksum (CRC32C, which tensorboard computes byte by byte
in Python) comes from google-crc32c's C code. Histograms (``write_histogram``) are HistogramProto
values, which TensorBoard's Histograms and Distributions tabs read.

Records are framed by tensorboard's RecordWriter into an in-memory buffer that goes to the file
with ``os.write`` only between records (at ``end_step``, on close, or past a size limit), so a
process that dies between steps never leaves a partial record behind.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.summary.writer.record_writer import RecordWriter

from monitor.files import FILE_MODE, create_exclusive
from monitor.record import RowSet, StepRecord
from monitor.writers.eventfile import frame_record

#: buffered bytes past which whole records are written out before the step ends.
FLUSH_BYTES = 8 << 20
#: RowSets whose prebuilt Event is kept (least recently used ones are dropped) ...
TEMPLATE_CACHE_SIZE = 32
#: ... and the scalars they may hold together (~170 bytes each; the newest is always kept).
TEMPLATE_CACHE_SCALARS = 1_000_000

_file_counter = itertools.count()


class _WholeRecordFile:
    """File-like target for RecordWriter: keeps whole records in memory, writes them with os.write.

    RecordWriter hands over each framed record in one ``write`` call, so anything written to the
    descriptor ends on a record boundary.
    """

    def __init__(self, fd: int, flush_bytes: int = FLUSH_BYTES) -> None:
        self._fd = fd
        self._parts: list[bytes] = []
        self._size = 0
        self._flush_bytes = flush_bytes
        self.closed = False

    def write(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._parts:
            return
        view = memoryview(b"".join(self._parts))
        self._parts.clear()
        self._size = 0
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.flush()
        finally:
            os.close(self._fd)


class _FastRecordWriter(RecordWriter):
    """RecordWriter with a C CRC32C; same framing, one write call per record."""

    def write(self, data: bytes) -> None:
        self._writer.write(frame_record(data))


class TensorBoardWriter:
    """Writes StepRecords as TensorBoard scalars into a new event file in ``log_dir``.

    ``log_dir`` must exist. Not meant for several threads at once (a lock keeps them apart anyway).
    """

    def __init__(self, log_dir: str | os.PathLike, file_mode: int = FILE_MODE) -> None:
        self.log_dir = os.fspath(log_dir)
        origin = f"{socket.gethostname()}.{os.getpid()}.{next(_file_counter)}"
        name = f"events.out.tfevents.{int(time.time())}.{origin}"
        self.path = os.path.join(self.log_dir, name)
        self._file = _WholeRecordFile(create_exclusive(self.path, file_mode))
        self._records = _FastRecordWriter(self._file)
        self._templates: OrderedDict[tuple[int, tuple[str, ...]], tuple[RowSet, Event]] = OrderedDict()
        self._template_scalars = 0
        self.template_scalars_limit = TEMPLATE_CACHE_SCALARS
        self._lock = threading.Lock()
        self._closed = False
        try:
            first = Event(wall_time=time.time(), file_version="brain.Event:2")
            self._records.write(first.SerializeToString())
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    def write(self, record: StepRecord) -> None:
        """Append one Event with every (row, op) value of ``record``; NaN/Inf are kept."""
        values = record.resolve()
        if values.shape != (len(record.rows), len(record.ops)):
            raise ValueError(
                f"{record.prefix} step {record.step}: values of shape {values.shape}, "
                f"expected ({len(record.rows)}, {len(record.ops)})"
            )
        if values.size == 0:
            return
        flat = values.ravel().tolist()
        with self._lock:
            self._check_open()
            event = self._template(record.rows, record.ops)
            event.step = record.step
            event.wall_time = time.time()
            for value, number in zip(event.summary.value, flat):
                value.simple_value = number
            self._records.write(event.SerializeToString())

    def write_scalars(self, step: int, tags: Sequence[str], values: Sequence[float] | np.ndarray) -> None:
        """Append one Event with the given scalar tags and values at ``step`` (for other callers)."""
        numbers = np.asarray(values, dtype=np.float64).ravel().tolist()
        if len(numbers) != len(tags):
            raise ValueError(f"{len(tags)} tags but {len(numbers)} values")
        event = Event(wall_time=time.time(), step=step)
        add = event.summary.value.add
        for tag, number in zip(tags, numbers):
            add(tag=tag, simple_value=number)
        with self._lock:
            self._check_open()
            self._records.write(event.SerializeToString())

    def write_histogram(
        self,
        step: int,
        tag: str,
        bucket_limits: Sequence[float] | np.ndarray,
        counts: Sequence[float] | np.ndarray,
        *,
        value_sum: float = 0.0,
        value_sum_squares: float = 0.0,
        nan_count: float | None = None,
        inf_count: float | None = None,
    ) -> None:
        """Append one Event with a histogram at ``step`` (TensorBoard's Histograms/Distributions tabs).

        Args:
            step: the monitor step.
            tag: the histogram's tag, e.g. ``"0:layers.0.fc1.weight/rank0/adam_update"``.
            bucket_limits: the k + 1 increasing, finite bucket edges (numpy.histogram's ``bins``):
                bucket i holds the values in [edges[i], edges[i + 1]).
            counts: the k finite, non-negative bucket counts.
            value_sum, value_sum_squares: sum and sum of squares of the counted values, when known.
            nan_count, inf_count: when given, written in the same Event as the scalars
                ``"{tag}_nans"`` and ``"{tag}_infs"`` (values no bucket can hold).

        Raises:
            ValueError: edges or counts of the wrong length, non-finite, decreasing or negative.
        """
        edges = np.asarray(bucket_limits, dtype=np.float64).ravel()
        numbers = np.asarray(counts, dtype=np.float64).ravel()
        if numbers.size == 0 or edges.size != numbers.size + 1:
            raise ValueError(
                f"histogram {tag!r}: expected k >= 1 counts and k + 1 bucket edges, "
                f"got {numbers.size} counts and {edges.size} edges"
            )
        if not (np.all(np.isfinite(edges)) and np.all(np.diff(edges) > 0)):
            raise ValueError(f"histogram {tag!r}: bucket edges must be finite and increasing, got {edges}")
        if not (np.all(np.isfinite(numbers)) and np.all(numbers >= 0)):
            raise ValueError(f"histogram {tag!r}: counts must be finite and >= 0, got {numbers}")
        histogram = HistogramProto(
            min=float(edges[0]),
            max=float(edges[-1]),
            num=float(numbers.sum()),
            sum=float(value_sum),
            sum_squares=float(value_sum_squares),
            bucket_limit=edges[1:].tolist(),
            bucket=numbers.tolist(),
        )
        event = Event(wall_time=time.time(), step=step)
        event.summary.value.add(tag=tag, histo=histogram)
        for suffix, count in (("nans", nan_count), ("infs", inf_count)):
            if count is not None:
                event.summary.value.add(tag=f"{tag}_{suffix}", simple_value=float(count))
        with self._lock:
            self._check_open()
            self._records.write(event.SerializeToString())

    def end_step(self, step: int) -> None:
        """Hand the step's whole records to the operating system."""
        with self._lock:
            if not self._closed:
                self._file.flush()

    def flush(self) -> None:
        """Same as ``end_step``, without a step."""
        self.end_step(-1)

    def close(self) -> None:
        """Write what is buffered and close the file. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._templates.clear()
            self._template_scalars = 0
            self._records.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TensorBoardWriter on {self.path} is closed")

    def _template(self, rows: RowSet, ops: tuple[str, ...]) -> Event:
        """The Event with this RowSet's scalar tags, built once per RowSet object (by identity)."""
        key = (id(rows), ops)
        entry = self._templates.get(key)
        if entry is not None and entry[0] is rows:
            self._templates.move_to_end(key)
            return entry[1]
        event = Event()
        add = event.summary.value.add
        for tag in rows.tags:
            for op in ops:
                add(tag=f"{tag}_{op}")
        # The entry holds ``rows`` itself, so its id cannot be reused while the entry lives.
        self._templates[key] = (rows, event)
        self._template_scalars += len(rows) * len(ops)
        while len(self._templates) > 1 and (
            len(self._templates) > TEMPLATE_CACHE_SIZE or self._template_scalars > self.template_scalars_limit
        ):
            _, (_, old_event) = self._templates.popitem(last=False)
            self._template_scalars -= len(old_event.summary.value)
        return event
