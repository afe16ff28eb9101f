"""DuckDB connections for the readers of the monitor's outputs.

Each process opens one in-memory database, on first use, and every read takes a cursor of it:
a connection of its own for one thread, with its own temporary tables, so that the dashboard's
threads never share one. Its memory limit is TRAINMON_MEMORY_LIMIT where that is set
(``monitor.memory_limit``), else DuckDB's default; beyond it DuckDB spills to its temporary
directory (a read holds a window of steps that the cross-rank analysis sizes to its own limit,
so DuckDB's need stays far below it). DuckDB is not safe to fork while its threads run: the
database is closed before this process forks (a worker process of a pool then opens its own,
and so does this one on its next read).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from monitor.memory_limit import ENV, parse_size

logger = logging.getLogger("trainmon")

#: rows of an Arrow batch: each batch carries the whole dictionary of names, which joining the
#: batches then compares, so few large ones
_BATCH_ROWS = 1 << 22
#: labels the ENUM holds at most: beyond, new labels are coded from their text on each read, so
#: that a dashboard serving many runs for days does not grow it without end
MAX_LABELS = 1 << 16
#: the characters DuckDB expands in a path (a directory may be called ``runs[3]``)
_GLOB = re.compile(r"([\[*?])")
_lock = threading.Lock()
#: the text columns read as codes
_CODED = ("name", "op")
_database: tuple[int, Any] | None = None  # (pid, connection)
_threads: int | None = None
_names: tuple[str, tuple[str, ...]] | None = None  # the ENUM type of the labels read so far, its values
_types_made = 0


def quoted(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def quoted_path(path: str) -> str:
    """A file's path as an SQL string literal that DuckDB reads as that one file, not a pattern."""
    return quoted(_GLOB.sub(r"[\1]", path))


def connect(memory_limit: int | None = None, threads: int | None = None) -> Any:
    """A new in-memory DuckDB database (for a command that sets its own limit, as compact does)."""
    import duckdb

    con = duckdb.connect()
    if memory_limit is not None:
        con.execute(f"SET memory_limit = '{int(memory_limit)}B'")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    return con


def use_one_thread() -> None:
    """Read on one core in this process (a worker process of several, each on its own core)."""
    global _threads
    _threads = 1
    if _database is not None and _database[0] == os.getpid():
        _database[1].execute("SET threads = 1")


def cursor() -> Any:
    """A cursor of this process's reading database, for one read in one thread. A
    TRAINMON_MEMORY_LIMIT that is no size is said once and left aside (the commands refuse it at
    the door; the dashboard has none)."""
    global _database, _names
    with _lock:
        if _database is None or _database[0] != os.getpid():
            try:
                limit = parse_size(os.environ[ENV]) if os.environ.get(ENV) else None
            except ValueError as exc:
                logger.warning("trainmon: %s; reading with DuckDB's default memory limit", exc)
                limit = None
            _database = (os.getpid(), connect(limit, _threads))
            _names = None
        return _database[1].cursor()


def fetch_coded(con: Any, columns: list[str], source: str, where: str = "") -> Any:
    """``SELECT columns FROM source WHERE where`` as an Arrow table, its text columns ``name``
    and ``op`` dictionary-encoded: a run's rows repeat a few thousand names millions of times,
    which as text would cost more memory than every other column together and as codes cost one
    to four bytes. The labels are an ENUM type of this process's database; a read that meets
    labels it does not hold yet takes them as text (one pass over the source either way) and
    adds them, up to MAX_LABELS."""
    import duckdb
    import pyarrow.compute as pc

    condition = f" WHERE {where}" if where else ""
    coded = [c for c in columns if c in _CODED]
    table, names = None, _names
    if names is not None:
        listed = ", ".join(f"TRY_CAST({c} AS {names[0]}) AS {c}" if c in _CODED else c for c in columns)
        try:
            table = con.sql(f"SELECT {listed} FROM {source}{condition}").to_arrow_table(_BATCH_ROWS)
        except duckdb.CatalogException:  # another thread replaced the type meanwhile: as text
            table = None
        if table is not None and any(table[c].null_count for c in coded):
            table = None
    if table is None:
        table = con.sql(f"SELECT {', '.join(columns)} FROM {source}{condition}").to_arrow_table(_BATCH_ROWS)
        _add_names(con, [label for c in coded for label in pc.unique(table[c].drop_null()).to_pylist()])
    return table


def _add_names(con: Any, names: list[str]) -> None:
    """Make the ENUM of the labels read so far hold ``names`` too (the type it replaces is
    dropped where no other read uses it at the moment)."""
    import duckdb

    global _names, _types_made
    with _lock:
        held = _names[1] if _names is not None else ()
        known = set(held)
        fresh = [name for name in dict.fromkeys(names) if name not in known]
        if not fresh or len(held) + len(fresh) > MAX_LABELS:
            return
        _types_made += 1
        made, values = f"trainmon_names_{_types_made}", (*held, *fresh)
        con.execute(f"CREATE TYPE {made} AS ENUM ({', '.join(quoted(name) for name in values)})")
        if _names is not None:
            try:
                con.execute(f"DROP TYPE {_names[0]}")
            except duckdb.Error:  # a read of another thread binds it now: it stays
                pass
        _names = (made, values)


def _close_before_fork() -> None:
    global _database, _names
    if _database is not None and _database[0] == os.getpid() and _lock.acquire(blocking=False):
        try:
            _database[1].close()
            _database, _names = None, None
        finally:
            _lock.release()


def _reset_in_child() -> None:
    """A forked process starts with no database and a lock of its own (another thread of the
    parent may have held it at the fork)."""
    global _lock, _database, _names
    _lock, _database, _names = threading.Lock(), None, None


os.register_at_fork(before=_close_before_fork, after_in_child=_reset_in_child)
