"""TensorBoard event files' TFRecord framing, and reading them record by record, safely and incrementally.

A record is ``length (u64) | masked crc32c(length) | data | masked crc32c(data)``. Files that are
still being written are read up to their last complete record; a record whose length CRC does not
match ends the scan (what follows cannot be trusted), a data CRC mismatch makes ``read_record``
raise.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from typing import NamedTuple

import google_crc32c

_MASK32 = 0xFFFFFFFF
_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")


def masked_crc32c(data: bytes) -> int:
    """The TFRecord "masked" CRC32C of ``data`` (google-crc32c's C implementation)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & _MASK32


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    header = struct.pack("<Q", len(data))
    crcs = (struct.pack("<I", masked_crc32c(header)), struct.pack("<I", masked_crc32c(data)))
    return b"".join((header, crcs[0], data, crcs[1]))


#: records longer than this are treated as corruption (TensorBoard events are far smaller).
MAX_RECORD_BYTES = 1 << 31


class CorruptRecord(ValueError):
    """A record whose data does not match its CRC."""


class RecordSpan(NamedTuple):
    """Where a record's data lies in its file."""

    offset: int
    length: int


def scan_records(fd: int, start: int = 0, end: int | None = None) -> tuple[list[RecordSpan], int]:
    """Spans of the complete records from byte ``start`` up to ``end`` (the file size by default).

    Returns the spans and the offset after the last complete record (where a later scan resumes).
    Only the 12-byte headers are read, so this is cheap even for large records.
    """
    if end is None:
        end = os.fstat(fd).st_size
    spans: list[RecordSpan] = []
    pos = start
    while pos + _HEADER.size <= end:
        header = os.pread(fd, _HEADER.size, pos)
        if len(header) < _HEADER.size:
            break
        length, length_crc = _HEADER.unpack(header)
        if length > MAX_RECORD_BYTES or masked_crc32c(header[:8]) != length_crc:
            break
        stop = pos + _HEADER.size + length + _CRC.size
        if stop > end:
            break
        spans.append(RecordSpan(pos + _HEADER.size, length))
        pos = stop
    return spans, pos


def read_record(fd: int, span: RecordSpan) -> bytes:
    """The data of one record, checked against its CRC."""
    blob = os.pread(fd, span.length + _CRC.size, span.offset)
    data = blob[: span.length]
    if len(blob) != span.length + _CRC.size or masked_crc32c(data) != _CRC.unpack(blob[span.length :])[0]:
        raise CorruptRecord(f"event record at byte {span.offset} does not match its checksum")
    return data


def read_head(fd: int, span: RecordSpan, size: int) -> bytes:
    """The first ``size`` bytes of a record's data (unchecked; for indexing only)."""
    return os.pread(fd, min(size, span.length), span.offset)


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor on a regular file; symlinks and other kinds of files are refused."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.fspath(path)!r} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def iter_records(path: str | os.PathLike) -> Iterator[bytes]:
    """Every complete, checked record of a file, in order."""
    fd = open_regular(path)
    try:
        spans, _ = scan_records(fd)
        for span in spans:
            yield read_record(fd, span)
    finally:
        os.close(fd)
