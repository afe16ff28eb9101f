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

import os
import threading
from typing import Any

from monitor.memory_limit import ENV, parse_size

#: rows of an Arrow batch: each batch carries the whole dictionary of names, which joining the
#: batches then compares, so few large ones
_BATCH_ROWS = 1 << 22
_lock = threading.Lock()
#: the text columns read as codes
_CODED = ("name", "op")
_database: tuple[int, Any] | None = None  # (pid, connection)
_threads: int | None = None
_names: tuple[str, tuple[str, ...]] | None = None  # the ENUM type of the names read so far, its values
_types_made = 0


def quoted(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


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
    """A cursor of this process's reading database, for one read in one thread.

    Raises:
        ValueError: TRAINMON_MEMORY_LIMIT is set but is not a size.
    """
    global _database, _names
    with _lock:
        if _database is None or _database[0] != os.getpid():
            limit = os.environ.get(ENV)
            _database = (os.getpid(), connect(parse_size(limit) if limit else None, _threads))
            _names = None
        return _database[1].cursor()


def fetch_coded(con: Any, columns: list[str], source: str, where: str = "") -> Any:
    """``SELECT columns FROM source WHERE where`` as an Arrow table, its text columns ``name``
    and ``op`` dictionary-encoded: a run's rows repeat a few thousand names millions of times,
    which as text would cost more memory than every other column together and as codes cost two
    bytes. The labels are an ENUM type of this process's database; a read that meets labels it
    does not hold yet takes them as text (one pass over the source either way) and adds them."""
    import pyarrow.compute as pc

    condition = f" WHERE {where}" if where else ""
    coded = [c for c in columns if c in _CODED]
    table = None
    if _names is not None:
        listed = ", ".join(f"TRY_CAST({c} AS {_names[0]}) AS {c}" if c in _CODED else c for c in columns)
        table = con.sql(f"SELECT {listed} FROM {source}{condition}").to_arrow_table(_BATCH_ROWS)
        if any(table[c].null_count for c in coded):
            table = None
    if table is None:
        table = con.sql(f"SELECT {', '.join(columns)} FROM {source}{condition}").to_arrow_table(_BATCH_ROWS)
        _add_names(con, [label for c in coded for label in pc.unique(table[c]).to_pylist()])
    return table


def _add_names(con: Any, names: list[str]) -> None:
    """Make the ENUM of the names read so far hold ``names`` too."""
    global _names, _types_made
    with _lock:
        held = _names[1] if _names is not None else ()
        known = set(held)
        fresh = [name for name in names if name not in known]
        if not fresh:
            return
        _types_made += 1
        made, values = f"trainmon_names_{_types_made}", (*held, *fresh)
        con.execute(f"CREATE TYPE {made} AS ENUM ({', '.join(quoted(name) for name in values)})")
        _names = (made, values)


def _close_before_fork() -> None:
    global _database, _names
    if _database is not None and _database[0] == os.getpid() and _lock.acquire(blocking=False):
        try:
            _database[1].close()
            _database, _names = None, None
        finally:
            _lock.release()


os.register_at_fork(before=_close_before_fork)
