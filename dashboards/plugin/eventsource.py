"""A rank directory of TensorBoard event files, read lazily (see dashboards.plugin.sources).

Each trainmon Event (one data type at one step) is a chunk. The index of a file holds, per record,
its step and data type (read from the record's first bytes); it grows as the file grows, and a file
that was replaced (new inode) or shrank is indexed again. Values are read with the layouts of
dashboards.plugin.eventscalars.
"""

from __future__ import annotations

import os

import numpy as np

from dashboards.plugin.cache import ByteLRU
from dashboards.plugin.eventscalars import Layout, LayoutCache, event_head, first_scalar_tag
from dashboards.plugin.sources import Block, Chunk, PrefixInfo, Source
from monitor.datatypes.tasks import parse_scalar_tag
from monitor.writers.custom_scalars import LAYOUT_SUFFIX
from monitor.writers.eventfile import RecordSpan, open_regular, read_head, read_record, scan_records

#: bytes of a record read to index it (step and first tag).
HEAD_BYTES = 1024


class _FileIndex:
    """The trainmon Events of one event file: (step, data type, span), extended as the file grows."""

    def __init__(self, identity: tuple[int, int]) -> None:
        self.identity = identity
        self.offset = 0
        self.entries: list[tuple[int, str, RecordSpan]] = []


class EventSource(Source):
    """A rank directory of TensorBoard event files written by the monitor (or any scalar writer)."""

    kind = "tensorboard"

    def __init__(self, path: str, cache: ByteLRU) -> None:
        super().__init__(path, cache)
        self._files: dict[str, _FileIndex] = {}
        self._layouts = LayoutCache()
        self._by_prefix: dict[str, list[Chunk]] = {}
        self._tag_prefix: dict[str, str | None] = {}

    @staticmethod
    def event_files(path: str) -> list[str]:
        """The event files of a directory (regular files; the layout file is not one of them)."""
        return sorted(
            entry.path
            for entry in os.scandir(path)
            if "tfevents" in entry.name
            and not entry.name.endswith(LAYOUT_SUFFIX)
            and entry.is_file(follow_symlinks=False)
        )

    def _scan(self) -> None:
        files = {}
        for path in self.event_files(self.path):
            try:
                fd = open_regular(path)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                index = self._files.get(path)
                if index is None or index.identity != (st.st_dev, st.st_ino) or st.st_size < index.offset:
                    index = _FileIndex((st.st_dev, st.st_ino))
                self._index(fd, index, st.st_size)
            finally:
                os.close(fd)
            files[path] = index
        self._files = files
        by_step: dict[str, dict[int, Chunk]] = {}
        for path, index in files.items():
            for step, prefix, span in index.entries:
                key = (path, *index.identity, span.offset, span.length)
                by_step.setdefault(prefix, {})[step] = Chunk(key, step, step, span.length)
        self._by_prefix = {prefix: [steps[s] for s in sorted(steps)] for prefix, steps in by_step.items()}

    def _index(self, fd: int, index: _FileIndex, size: int) -> None:
        spans, index.offset = scan_records(fd, index.offset, size)
        for span in spans:
            head = read_head(fd, span, HEAD_BYTES)
            try:
                parsed_head = event_head(head, partial=True)
            except ValueError:
                continue
            tag = first_scalar_tag(head, parsed_head)
            if tag is None:
                continue
            if tag not in self._tag_prefix:  # one data type's Events all start with the same tag
                if len(self._tag_prefix) > 100_000:
                    self._tag_prefix.clear()
                parsed = parse_scalar_tag(tag)
                self._tag_prefix[tag] = parsed[0].prefix if parsed else None
            prefix = self._tag_prefix[tag]
            if prefix is not None:
                index.entries.append((parsed_head.step, prefix, span))

    def chunks(self, prefix: str) -> list[Chunk]:
        with self._lock:
            return list(self._by_prefix.get(prefix, ()))

    def prefixes(self) -> dict[str, PrefixInfo]:
        found = {}
        with self._lock:
            listed = dict(self._by_prefix)
        for prefix, chunks in listed.items():
            ops = self.load(prefix, chunks[-1]).ops or self.load(prefix, chunks[0]).ops
            if ops:  # steps from the index; the ops from the newest (or first) readable Event
                found[prefix] = PrefixInfo(ops, chunks[0].first, chunks[-1].last, len(chunks))
        return found

    def version(self) -> str:
        with self._lock:
            return repr(sorted((p, i.offset) for p, i in self._files.items()))

    def _load(self, prefix: str, chunk: Chunk) -> Block:
        path, offset, length = chunk.key[0], chunk.key[3], chunk.key[4]
        fd = open_regular(path)
        try:
            data = read_record(fd, RecordSpan(offset, length))
        finally:
            os.close(fd)
        head = event_head(data)
        summary = data[head.summary_offset : head.summary_offset + head.summary_length]
        with self._lock:
            layout, values = self._layouts.read(summary)
            positions, unique, inverse, op_index, ops = self._mapping(layout, prefix)
        matrix = np.full((len(unique), len(ops)), np.nan)
        matrix[inverse, op_index] = values[positions]
        present = None
        if len(positions) != matrix.size:
            present = np.zeros(matrix.shape, dtype=bool)
            present[inverse, op_index] = True
        steps = np.full(len(unique), head.step, dtype=np.int64)
        return Block(ops, unique, steps, matrix, present)

    def _mapping(self, layout: Layout, prefix: str) -> tuple:
        """Per layout and data type: value positions, unique rows, each value's row and op, the ops."""
        cached = layout.derived.get(prefix)
        if cached is not None:
            return cached
        table = self.table(prefix)
        positions, rows, ops_of = [], [], []
        for position, tag in enumerate(layout.tags):
            parsed = parse_scalar_tag(tag)
            if parsed is None or parsed[0].prefix != prefix:
                continue
            positions.append(position)
            rows.append(table.number(parsed[0].row))
            ops_of.append(parsed[1])
        ops = tuple(dict.fromkeys(ops_of))
        op_number = {op: i for i, op in enumerate(ops)}
        unique, inverse = np.unique(np.asarray(rows, dtype=np.int32), return_inverse=True)
        mapping = (
            np.asarray(positions, dtype=np.intp),
            unique.astype(np.int32),
            inverse,
            np.asarray([op_number[o] for o in ops_of], dtype=np.intp),
            ops,
        )
        layout.derived[prefix] = mapping
        return mapping
