"""A least-recently-used cache bounded by the bytes its values hold (parsed files of the plugin)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

#: environment variable: the cache's size in MiB (default DEFAULT_MB).
CACHE_ENV = "TRAINMON_DASHBOARD_CACHE_MB"
DEFAULT_MB = 1024


def cache_bytes_from_env() -> int:
    """The cache budget in bytes from TRAINMON_DASHBOARD_CACHE_MB (a positive integer)."""
    text = os.environ.get(CACHE_ENV, "")
    if not text:
        return DEFAULT_MB << 20
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CACHE_ENV}: expected an integer >= 1 (MiB), got {text!r}")
    return value << 20


class ByteLRU(Generic[V]):
    """``get_or_load(key, load)``: the cached value, or ``load()`` stored under ``key``.

    ``size(value)`` gives each value's bytes; the least recently used values are dropped while the
    total exceeds ``limit`` (the newest value is always kept). Keys carry whatever identifies the
    file version (path, mtime, size), so a changed file is simply a new key; its old entry ages out.
    """

    def __init__(self, limit: int, size: Callable[[V], int]) -> None:
        self.limit = limit
        self._size = size
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_load(self, key: Hashable, load: Callable[[], V]) -> V:
        value = self.get(key)
        if value is None:
            value = load()  # outside the lock: other requests go on meanwhile
            self.put(key, value)
        return value

    def get(self, key: Hashable) -> V | None:
        """The cached value, or None."""
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        """Store a value loaded elsewhere."""
        nbytes = self._size(value)
        with self._lock:
            self.misses += 1
            self._store(key, value, nbytes)

    def _store(self, key: Hashable, value: V, nbytes: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._total -= old[1]
        self._items[key] = (value, nbytes)
        self._total += nbytes
        while self._total > self.limit and len(self._items) > 1:
            _, (_, dropped) = self._items.popitem(last=False)
            self._total -= dropped

    @property
    def total(self) -> int:
        """Bytes held now."""
        return self._total

    def __len__(self) -> int:
        return len(self._items)


class FileVersions(Generic[V]):
    """Parsed files, each parsed again only when it changes (size, mtime or inode).

    ``read(paths, parse)`` gives the signature of the files' versions (equal signatures: nothing
    changed), the parsed value of each readable file in ``paths`` order, and how many could not be
    read or parsed (``parse`` raising OSError or ValueError): a bad file is counted, never fatal.
    """

    def __init__(self) -> None:
        self._files: dict[str, tuple[tuple, V]] = {}

    def read(self, paths: list[str], parse: Callable[[str], V]) -> tuple[tuple, list[V], int]:
        signature, values, skipped = [], [], 0
        for path in paths:
            try:
                st = os.stat(path, follow_symlinks=False)
                version = (st.st_size, st.st_mtime_ns, st.st_ino)
                cached = self._files.get(path)
                if cached is None or cached[0] != version:
                    cached = self._files[path] = (version, parse(path))
            except (OSError, ValueError):
                skipped += 1
                continue
            signature.append((path, version))
            values.append(cached[1])
        return tuple(signature), values, skipped
