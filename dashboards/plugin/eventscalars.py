"""Scalars of trainmon's TensorBoard Events, read without building a protobuf object per value.

The monitor writes one Event per data type and step whose Summary holds the same tags, in the
same order, at every step (monitor.writers.tensorboard reuses one template per row set). So the
bytes of two such Summaries differ only in the four bytes of each ``simple_value``. A ``Layout``
records where those floats lie in one Summary; any other Summary of the same length whose bytes
outside the floats are identical has the same tags, and its values are read with one numpy
gather. A Summary that matches no layout gets a new one (parsed here from the protobuf wire
format, field by field), so any writer's scalar Events are read correctly, only slower.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# protobuf wire types
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
# Event fields / Summary fields / Summary.Value fields
_EVENT_STEP, _EVENT_SUMMARY = 2, 5
_SUMMARY_VALUE = 1
_VALUE_TAG, _VALUE_SIMPLE = 1, 2


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes | memoryview, start: int, end: int, partial: bool = False):
    """(field number, wire type, value or (offset, length)) of each field of a message.

    With ``partial``, ``data`` may stop inside the message: a length-delimited field that runs past
    the end is still reported (its position is known) and the walk stops there.
    """
    pos = start
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == _FIXED64:
            pos += 8
            yield number, wire, pos - 8
        elif wire == _FIXED32:
            pos += 4
            yield number, wire, pos - 4
        elif wire == _LEN:
            length, pos = _varint(data, pos)
            pos += length
            if pos > end and partial:
                yield number, wire, (pos - length, length)
                return
            yield number, wire, (pos - length, length)
        else:
            raise WireError(f"unsupported wire type {wire}")
        if pos > end:
            raise WireError("field runs past the end of its message")


class EventHead(NamedTuple):
    """Step of an Event and where its Summary lies in the Event's bytes (length 0: none)."""

    step: int
    summary_offset: int
    summary_length: int


def event_head(data: bytes, partial: bool = False) -> EventHead:
    """Step and Summary position of one serialized Event (``partial``: only its first bytes)."""
    step, offset, length = 0, 0, 0
    for number, wire, value in _fields(data, 0, len(data), partial):
        if number == _EVENT_STEP and wire == _VARINT:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == _EVENT_SUMMARY and wire == _LEN:
            offset, length = value
    return EventHead(step, offset, length)


def first_scalar_tag(data: bytes, head: EventHead) -> str | None:
    """The tag of the Summary's first value when that value is a simple scalar, else None.

    ``data`` may be only the beginning of the Event (an index reads a record's head only).
    """
    if head.summary_length == 0:
        return None
    try:
        key, pos = _varint(data, head.summary_offset)
        if key != (_SUMMARY_VALUE << 3) | _LEN:
            return None
        length, pos = _varint(data, pos)
        tag, has_scalar = None, False
        for number, wire, value in _fields(data, pos, min(pos + length, len(data)), partial=True):
            if number == _VALUE_TAG and wire == _LEN:
                tag = bytes(data[value[0] : value[0] + value[1]]).decode("utf-8", errors="replace")
            elif number == _VALUE_SIMPLE and wire == _FIXED32:
                has_scalar = True
            elif number != _VALUE_TAG:
                return None
    except WireError:
        return None
    return tag if has_scalar else None


class Layout:
    """Where the simple scalar values lie in one Summary's bytes, and their tags.

    Attributes:
        length: the Summary's byte length.
        tags: tag of each simple scalar value, in order.
        float_bytes: byte index of every byte of every float (4 per value), for numpy gathers.
        derived: what a reader derives from the tags once per layout (keyed as it likes).
    """

    def __init__(self, summary: bytes) -> None:
        tags: list[str] = []
        offsets: list[int] = []
        for number, wire, value in _fields(summary, 0, len(summary)):
            if number != _SUMMARY_VALUE or wire != _LEN:
                continue
            start, length = value
            tag, float_at = None, None
            for inner, inner_wire, inner_value in _fields(summary, start, start + length):
                if inner == _VALUE_TAG and inner_wire == _LEN:
                    s, n = inner_value
                    tag = summary[s : s + n].decode("utf-8", errors="replace")
                elif inner == _VALUE_SIMPLE and inner_wire == _FIXED32:
                    float_at = inner_value
            if tag is not None and float_at is not None:
                tags.append(tag)
                offsets.append(float_at)
        self.length = len(summary)
        self.tags = tags
        starts = np.asarray(offsets, dtype=np.intp)
        self.float_bytes = (starts[:, None] + np.arange(4, dtype=np.intp)).ravel()
        masked = np.frombuffer(bytearray(summary), dtype=np.uint8)
        masked[self.float_bytes] = 0
        self._masked = masked.tobytes()
        self.derived: dict = {}

    def values(self, summary: bytes) -> np.ndarray | None:
        """The scalar values (float32) of a Summary with this layout; None when it does not match."""
        if len(summary) != self.length:
            return None
        buffer = np.frombuffer(bytearray(summary), dtype=np.uint8)
        numbers = buffer[self.float_bytes].view("<f4")
        buffer[self.float_bytes] = 0
        if buffer.tobytes() != self._masked:
            return None
        return numbers


class LayoutCache:
    """Layouts by Summary length; a Summary that matches none gets a new layout."""

    def __init__(self, limit: int = 64) -> None:
        self._by_length: dict[int, list[Layout]] = {}
        self._count = 0
        self._limit = limit

    def read(self, summary: bytes) -> tuple[Layout, np.ndarray]:
        """The layout of ``summary`` and its values."""
        for layout in self._by_length.get(len(summary), ()):
            values = layout.values(summary)
            if values is not None:
                return layout, values
        layout = Layout(summary)
        values = layout.values(summary)
        assert values is not None  # a layout always matches the Summary it was built from
        if self._count >= self._limit:  # a writer that never repeats a layout: keep memory bounded
            self._by_length.clear()
            self._count = 0
        self._by_length.setdefault(len(summary), []).append(layout)
        self._count += 1
        return layout, values
