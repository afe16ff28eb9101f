"""A rank directory written with ``format: parquet`` (monitor.writers.parquet_files), read lazily.

Each live file (one step's, or a merged window's) is a chunk, its steps taken from its name; it is
read back as one entry per tensor row and step with a column per op, ``present`` marking the
values the file has.
"""

from __future__ import annotations

import os

import numpy as np

from dashboards.plugin.cache import ByteLRU
from dashboards.plugin.sources import Block, Chunk, PrefixInfo, Source
from monitor.query.parquet_values import file_ops, read_wide
from monitor.writers.parquet_files import live_prefixes, part_steps

#: files whose ops are remembered, at most
OPS_CACHE = 4096


class ParquetSource(Source):
    """A rank directory of the monitor's live Parquet files."""

    kind = "parquet"

    def __init__(self, path: str, cache: ByteLRU) -> None:
        super().__init__(path, cache)
        self._chunks: dict[str, list[Chunk]] = {}
        self._ops: dict[tuple, tuple[str, ...]] = {}
        self._version = ""

    @staticmethod
    def holds(path: str) -> bool:
        """Whether a directory has live Parquet files."""
        return bool(live_prefixes(path))

    def _scan(self) -> None:
        """List the files; only new ones are looked at (a file is never rewritten under its name:
        new data comes in new files)."""
        known = {chunk.key[0]: chunk for found in self._chunks.values() for chunk in found}
        chunks: dict[str, list[Chunk]] = {}
        for prefix, paths in live_prefixes(self.path).items():
            for path in paths:
                chunk = known.get(path)
                if chunk is None:
                    first, last = part_steps(path)
                    try:
                        st = os.stat(path, follow_symlinks=False)
                    except OSError:  # merged away since it was listed
                        continue
                    chunk = Chunk((path, st.st_size, st.st_mtime_ns), first, last, st.st_size)
                chunks.setdefault(prefix, []).append(chunk)
        self._chunks = {prefix: sorted(found, key=lambda c: c.first) for prefix, found in chunks.items()}
        self._version = repr(sorted((p, len(c), c[-1].key) for p, c in self._chunks.items()))

    def chunks(self, prefix: str) -> list[Chunk]:
        with self._lock:
            return list(self._chunks.get(prefix, ()))

    def version(self) -> str:
        with self._lock:
            return self._version

    def prefixes(self) -> dict[str, PrefixInfo]:
        with self._lock:
            listed = dict(self._chunks)
        found = {}
        for prefix, chunks in listed.items():
            # the newest steps' readable file says the ops (a late file, of an older step, may
            # sort last; a file cut short by a disk fault says nothing)
            by_age = sorted(chunks, key=lambda c: (c.last, "late-" not in os.path.basename(c.key[0])))
            for newest in reversed(by_age):
                ops = self._chunk_ops(newest)
                if ops:
                    found[prefix] = PrefixInfo(ops, chunks[0].first, by_age[-1].last, len(chunks))
                    break
        return found

    def _chunk_ops(self, chunk: Chunk) -> tuple[str, ...]:
        """The ops a file holds (read once per file version; () when it cannot be read)."""
        ops = self._ops.get(chunk.key)
        if ops is None:
            try:
                ops = file_ops(chunk.key[0])
            except (OSError, ValueError):  # pyarrow's errors are ValueErrors or OSErrors
                ops = ()
            if len(self._ops) > OPS_CACHE:
                self._ops.clear()
            self._ops[chunk.key] = ops
        return ops

    def _load(self, prefix: str, chunk: Chunk) -> Block:
        wide = read_wide([chunk.key[0]])
        with self._lock:
            numbers = self.table(prefix).numbers(wide.vpp, wide.names, wide.micro)
        return Block(wide.ops, numbers[wide.row_of].astype(np.int32), wide.steps, wide.values, wide.present)
