"""One rank directory's statistics, read lazily: the Source interface and CSV directories.

A source lists its data types and, per data type, its *chunks* (a CSV file, or one Event of an
event file) with the steps each holds and its size; ``load`` parses one chunk into a ``Block``
(rows x ops per step). Blocks are cached by a key that changes when the bytes change (path, size
and mtime for CSV files, which grow; path, inode and offset for Events, which are never rewritten).
Event files are read by dashboards.plugin.eventsource.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dashboards.csvfiles import CsvBounds, CsvTable, csv_bounds, list_csv_files, read_csv_file, read_csv_files
from dashboards.plugin.cache import ByteLRU
from monitor.datatypes.tasks import RowKey
from monitor.run_info import RUN_INFO_FILE, read_root_modules

logger = logging.getLogger("trainmon")
_tokens = itertools.count()

#: seconds during which a source does not look at its directory again.
REFRESH_SECONDS = 1.0
#: seconds after which every CSV file is looked at again, not only the newest of each data type.
FULL_SCAN_SECONDS = 30.0
#: the newest windows of a data type looked at on every refresh: the one being appended to and
#: the one before it (its last rows may land after the next window's file was made)
GROWING = 2


class Chunk(NamedTuple):
    """A unit of reading: ``key`` identifies its bytes, [first, last] its steps."""

    key: tuple
    first: int
    last: int
    nbytes: int


@dataclass
class Block:
    """A chunk's values of one data type.

    Attributes:
        ops: the statistics (columns of ``values``).
        rows: row of each entry, an index into the source's RowTable of the data type.
        steps: step of each entry.
        values: float64 (entries, ops).
        present: which values exist (None: all); a missing value is not a NaN.
        skipped: entries that could not be read.
    """

    ops: tuple[str, ...]
    rows: np.ndarray
    steps: np.ndarray
    values: np.ndarray
    present: np.ndarray | None = None
    skipped: int = 0

    def __post_init__(self) -> None:
        steps = self.steps
        if len(steps) > 1 and bool((steps[1:] >= steps[:-1]).all()):  # in order: no sort needed
            self.unique_steps = steps[np.concatenate(([True], steps[1:] != steps[:-1]))]
        else:
            self.unique_steps = np.unique(steps)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.present is None else self.present.nbytes
        return self.values.nbytes + self.rows.nbytes + 2 * self.steps.nbytes + extra + 200


class PrefixInfo(NamedTuple):
    """What a source holds of one data type."""

    ops: tuple[str, ...]
    first_step: int
    last_step: int
    chunks: int


class RowTable:
    """The rows of one data type on one rank, numbered in first-seen order (model order)."""

    def __init__(self) -> None:
        self.keys: list[RowKey] = []
        self.index: dict[RowKey, int] = {}
        self._last: tuple | None = None

    def number(self, key: RowKey) -> int:
        found = self.index.get(key)
        if found is None:
            found = self.index[key] = len(self.keys)
            self.keys.append(key)
        return found

    def numbers(self, vpp: np.ndarray, names: list[str], micro: np.ndarray | None) -> np.ndarray:
        """Row numbers of many rows; the same labels as the previous call (the common case: every
        file of a data type lists the same rows) reuse its answer."""
        last = self._last
        if (
            last is not None
            and last[1] == names
            and np.array_equal(last[0], vpp)
            and (micro is None if last[2] is None else micro is not None and np.array_equal(last[2], micro))
        ):
            return last[3]
        micro_list = [-1] * len(names) if micro is None else micro.tolist()
        numbers = np.fromiter(
            (self.number(RowKey(v, n, m)) for v, n, m in zip(vpp.tolist(), names, micro_list)),
            dtype=np.int32,
            count=len(names),
        )
        self._last = (vpp, names, micro, numbers)
        return numbers


class Source:
    """Base of the two kinds of rank directory: listing, row tables, cached loading."""

    kind = ""

    def __init__(self, path: str, cache: ByteLRU) -> None:
        self.path = path
        self.cache = cache
        self.tables: dict[str, RowTable] = {}
        self._lock = threading.RLock()
        self._checked = 0.0
        self._token = next(_tokens)  # blocks hold row numbers of this source's tables
        self._reported: set[str] = set()
        self._roots: tuple[int, dict[int, str]] | None = None

    def table(self, prefix: str) -> RowTable:
        return self.tables.setdefault(prefix, RowTable())

    def refresh(self, force: bool = False) -> None:
        """Look at the directory again (at most once per REFRESH_SECONDS unless forced)."""
        with self._lock:
            now = time.monotonic()
            if force or now - self._checked >= REFRESH_SECONDS:
                self._checked = now
                self._scan()

    def root_modules(self) -> dict[int, str]:
        """Chunk -> class name of its root module, from the run-info file ({} without one); read
        again only when the file changed."""
        try:
            changed = os.stat(os.path.join(self.path, RUN_INFO_FILE)).st_mtime_ns
        except OSError:
            return {}
        if self._roots is None or self._roots[0] != changed:
            self._roots = (changed, read_root_modules(self.path))
        return self._roots[1]

    def load(self, prefix: str, chunk: Chunk) -> Block:
        """The parsed chunk (cached); a chunk that cannot be read is an empty block, counted as skipped."""
        return self.cache.get_or_load(
            (self._token, prefix, *chunk.key), lambda: self._load_safely(prefix, chunk)
        )

    def _load_safely(self, prefix: str, chunk: Chunk) -> Block:
        try:
            return self._load(prefix, chunk)
        except (OSError, ValueError) as exc:  # vanished, unreadable, not a monitor file, corrupt
            if chunk.key[0] not in self._reported:
                self._reported.add(chunk.key[0])
                logger.warning("trainmon plugin: skipping %s: %s", chunk.key[0], exc)
            return unreadable()

    def load_many(self, prefix: str, chunks: Sequence[Chunk]) -> list[Block]:
        """The parsed chunks, in order; those not cached are parsed together where that is faster."""
        keys = [(self._token, prefix, *chunk.key) for chunk in chunks]
        blocks = [self.cache.get(key) for key in keys]
        missing = [i for i, block in enumerate(blocks) if block is None]
        try:
            loaded = self._load_many(prefix, [chunks[i] for i in missing])
        except (OSError, ValueError):  # one bad file: read them one by one
            loaded = [self._load_safely(prefix, chunks[i]) for i in missing]
        for i, block in zip(missing, loaded):
            self.cache.put(keys[i], block)
            blocks[i] = block
        return blocks

    def _load_many(self, prefix: str, chunks: Sequence[Chunk]) -> list[Block]:
        return [self._load_safely(prefix, chunk) for chunk in chunks]

    def _scan(self) -> None:
        raise NotImplementedError

    def _load(self, prefix: str, chunk: Chunk) -> Block:
        raise NotImplementedError

    def chunks(self, prefix: str) -> list[Chunk]:
        raise NotImplementedError

    def prefixes(self) -> dict[str, PrefixInfo]:
        """Data types with data, with their ops and step range."""
        raise NotImplementedError

    def version(self) -> str:
        """Changes whenever new data arrives."""
        raise NotImplementedError


class CsvSource(Source):
    """A rank directory of ``{prefix}_{a}-{b}.csv`` files."""

    kind = "csv"

    def __init__(self, path: str, cache: ByteLRU) -> None:
        super().__init__(path, cache)
        self._chunks: dict[str, list[Chunk]] = {}
        self._listing: dict[str, list] = {}
        self._dir_mtime = -1
        self._listed_at = 0.0
        self._full_scan = float("-inf")
        self._version = ""
        self._bound_cache: dict[tuple, CsvBounds | None] = {}

    def _scan(self) -> None:
        """List the files (only when the directory changed) and stat what may have grown.

        A file is re-examined when it is one of the two newest windows of its data type (the one
        being appended to, and the one before it, whose last rows may land after the next window's
        file was made) or at least every FULL_SCAN_SECONDS, so a directory of thousands of
        one-step files costs a few system calls per refresh, not thousands.
        """
        now = time.monotonic()
        full = now - self._full_scan >= FULL_SCAN_SECONDS
        mtime = os.stat(self.path).st_mtime_ns
        # mtimes are coarse: a listing taken within a moment of the last change may have missed a file
        relisted = full or mtime != self._dir_mtime or self._listed_at - mtime / 1e9 < 2.0
        if relisted:
            self._listed_at = time.time()
            self._listing = list_csv_files(self.path)
            self._dir_mtime = mtime
        if not relisted:  # only the newest windows of each data type can have grown
            chunks = {prefix: list(listed) for prefix, listed in self._chunks.items()}
            for listed in chunks.values():
                for index in range(max(len(listed) - GROWING, 0), len(listed)):
                    chunk = listed[index]
                    try:
                        st = os.stat(chunk.key[0], follow_symlinks=False)
                    except OSError:
                        continue
                    listed[index] = Chunk(
                        (chunk.key[0], st.st_size, st.st_mtime_ns), chunk.first, chunk.last, st.st_size
                    )
            self._finish(chunks)
            return
        known = {c.key[0]: c for chunks in self._chunks.values() for c in chunks}
        chunks: dict[str, list[Chunk]] = {}
        for prefix, listed in self._listing.items():
            for index, item in enumerate(listed):
                chunk = known.get(item.path)
                if chunk is None or full or index >= len(listed) - GROWING:
                    try:
                        st = os.stat(item.path, follow_symlinks=False)
                    except OSError:
                        continue
                    chunk = Chunk((item.path, st.st_size, st.st_mtime_ns), item.start, item.end, st.st_size)
                chunks.setdefault(prefix, []).append(chunk)
        if full:
            self._full_scan = now
        self._finish(chunks)

    def _finish(self, chunks: dict[str, list[Chunk]]) -> None:
        self._chunks = chunks
        self._version = repr(
            sorted((p, len(c), [chunk.key[1:] for chunk in c[-GROWING:]]) for p, c in chunks.items() if c)
        )

    def chunks(self, prefix: str) -> list[Chunk]:
        with self._lock:
            return [c for c in self._chunks.get(prefix, ()) if c.nbytes > 0]

    def prefixes(self) -> dict[str, PrefixInfo]:
        found = {}
        with self._lock:
            listed = {prefix: chunks for prefix, chunks in self._chunks.items()}
        for prefix, chunks in listed.items():
            chunks = [c for c in chunks if c.nbytes > 0]
            if not chunks:
                continue
            # the outermost files that can be read: a stray or damaged one does not hide the rest
            first = next((b for b in map(self._bounds, chunks) if b is not None), None)
            last = next((b for b in map(self._bounds, reversed(chunks)) if b is not None), None)
            if first is None or last is None:
                continue
            found[prefix] = PrefixInfo(last.ops, first.first_step, last.last_step, len(chunks))
        return found

    def version(self) -> str:
        with self._lock:
            return self._version

    def _bounds(self, chunk: Chunk) -> CsvBounds | None:
        with self._lock:
            if chunk.key not in self._bound_cache:
                if len(self._bound_cache) > 4096:
                    self._bound_cache.clear()
                try:
                    self._bound_cache[chunk.key] = csv_bounds(chunk.key[0])
                except OSError:
                    return None
            return self._bound_cache[chunk.key]

    def _load(self, prefix: str, chunk: Chunk) -> Block:
        return self._block(prefix, read_csv_file(chunk.key[0]))

    def _load_many(self, prefix: str, chunks: Sequence[Chunk]) -> list[Block]:
        return [self._block(prefix, table) for table in read_csv_files([c.key[0] for c in chunks])]

    def _block(self, prefix: str, table: CsvTable) -> Block:
        with self._lock:
            rows = self.table(prefix).numbers(table.vpp_stages, table.names, table.micro_steps)
        return Block(table.ops, rows, table.steps, table.values, None, table.skipped)


def unreadable() -> Block:
    """The block of a chunk that could not be read (counted as skipped)."""
    empty = np.zeros(0, dtype=np.int64)
    return Block((), empty.astype(np.int32), empty, np.zeros((0, 0)), None, skipped=1)
