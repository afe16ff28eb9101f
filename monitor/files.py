"""Output files and directories: the per-rank directory, safe modes, atomic replacement.

Directories are created 0750 and files 0640 (msprobe's modes). Symlinks planted at an
output path are refused, never followed. JSON documents are replaced atomically.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import tempfile
import uuid
from typing import TextIO

DIR_MODE = 0o750
FILE_MODE = 0o640
#: time tag of per-rank directories, as msprobe (host-local time, no year).
TIME_FORMAT = "%b%d_%H-%M-%S"
#: per-rank directory names: "{time}-rank{R}-{uuid8}"; msprobe's converters match this.
RANK_DIR_PATTERN = re.compile(r"^([\w-]{0,20})-rank(\d{1,5})-([0-9a-f]{8})$")
OUTPUT_ENV = "MONITOR_OUTPUT_DIR"
#: what a file an earlier run left in an output directory is renamed with, before its time
#: (``anomaly.json.earlier-<time>``): kept, not overwritten, and not read as the new run's
EARLIER_RUN = ".earlier-"


def output_root() -> str:
    """MONITOR_OUTPUT_DIR or ./monitor_output, as an absolute path."""
    return os.path.abspath(os.environ.get(OUTPUT_ENV) or "monitor_output")


def make_private_dir(path: str | os.PathLike, under: str | os.PathLike | None = None) -> str:
    """Create a directory and its missing parents, each with exactly mode 0750; return the path.

    A symlink is refused, never followed: at ``path`` and, when ``under`` is given, at every level
    between ``under`` (the output root, which the user may place anywhere) and ``path``.
    """
    path = os.path.abspath(os.fspath(path))
    levels = [path]
    if under is not None:
        root = os.path.abspath(os.fspath(under))
        parts = os.path.relpath(path, root).split(os.sep)
        if parts[0] == os.pardir:
            raise OSError(f"trainmon: {path!r} is not inside {root!r}")
        levels = [os.path.join(root, *parts[: i + 1]) for i in range(len(parts)) if parts[i] != os.curdir]
    for level in levels:
        if os.path.islink(level):
            raise OSError(f"trainmon: refusing to use {level!r}: it is a symbolic link")
    missing = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    for level in reversed(missing):
        try:
            os.mkdir(level, DIR_MODE)
        except FileExistsError:  # another rank made it meanwhile
            continue
        os.chmod(level, DIR_MODE)  # exact, whatever the umask
    if os.path.islink(path) or not os.path.isdir(path):
        raise OSError(f"trainmon: {path!r} exists and is not a directory")
    return path


def create_exclusive(path: str | os.PathLike, file_mode: int = FILE_MODE) -> int:
    """Create a new file for writing and return its descriptor.

    Never reuses an existing entry or follows a symlink (O_EXCL fails on both, a dangling link
    included); the mode is set exactly, whatever the umask.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, file_mode)
    except FileExistsError as exc:
        kind = "a symlink" if os.path.islink(path) else "a file"
        raise FileExistsError(
            exc.errno, f"trainmon: refusing to write through existing {kind}", os.fspath(path)
        ) from None
    try:
        os.fchmod(fd, file_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike, file_mode: int = FILE_MODE) -> tuple[TextIO, bool]:
    """Open a text file for appending without following symlinks: ``(file, created)``.

    A new file gets exactly ``file_mode``; an existing regular file (append_output) is appended to.
    """
    path = os.fspath(path)
    try:
        fd, created = create_exclusive(path, file_mode), True
    except FileExistsError:
        if os.path.islink(path):
            raise
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        created = os.fstat(fd).st_size == 0
    else:
        os.lseek(fd, 0, os.SEEK_END)
    handle = os.fdopen(fd, "a", encoding="utf-8", newline="")
    return handle, created


def atomic_write_text(path: str | os.PathLike, text: str, file_mode: int = FILE_MODE) -> None:
    """Replace ``path`` with ``text``: temporary file in the same directory, fsync, rename, then
    fsync the directory where the platform allows it (so the rename itself survives a crash)."""
    path = os.fspath(path)
    if os.path.islink(path):
        raise OSError(f"trainmon: refusing to replace {path!r}: it is a symbolic link")
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, file_mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_directory(directory)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the renames in ``directory`` durable, where the platform allows it (a no-op where a
    directory cannot be opened or synced)."""
    try:
        directory_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory_fd)
    except OSError:
        pass
    finally:
        os.close(directory_fd)


def parse_time_tag(text: str) -> _dt.datetime | None:
    """A ``%b%d_%H-%M-%S`` time tag as a datetime in a leap year (so Feb29 parses), else None."""
    try:
        return _dt.datetime.strptime(f"2000{text}", f"%Y{TIME_FORMAT}")
    except (TypeError, ValueError):
        return None


def time_bounds(
    start: str | None, end: str | None, names: tuple[str, str] = ("start", "end")
) -> tuple[_dt.datetime | None, _dt.datetime | None]:
    """``start`` and ``end`` time tags (as in rank directory names) as datetimes, None where not
    given; the readers' choice of one run among several under a root.

    Raises:
        ValueError: a tag that is not one, or a start after the end; ``names`` say which was given how.
    """
    bounds = []
    for name, text in zip(names, (start, end)):
        stamp = None if text is None else parse_time_tag(text) if isinstance(text, str) else None
        if text is not None and stamp is None:
            raise ValueError(f"{name}: expected a time like 'Dec03_21-34-40' ({TIME_FORMAT}), got {text!r}")
        bounds.append(stamp)
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise ValueError(f"{names[0]} {start!r} is after {names[1]} {end!r}")
    return bounds[0], bounds[1]


def in_time_range(stamp: _dt.datetime, bounds: tuple[_dt.datetime | None, _dt.datetime | None]) -> bool:
    """Whether ``stamp`` lies in ``bounds`` (from ``time_bounds``; None: open on that side)."""
    low, high = bounds
    return (low is None or stamp >= low) and (high is None or stamp <= high)


def rank_dir_name(rank: int, now: _dt.datetime | None = None) -> str:
    """``{%b%d_%H-%M-%S}-rank{R}-{uuid8}`` in host-local time."""
    now = now or _dt.datetime.now().astimezone()
    return f"{now.strftime(TIME_FORMAT)}-rank{rank}-{uuid.uuid4().hex[:8]}"


def find_rank_dir(root: str, rank: int, start: str, end: str) -> str | None:
    """The newest existing directory of ``rank`` under root whose time tag lies in [start, end]."""
    low, high = parse_time_tag(start), parse_time_tag(end)
    found = []
    for entry in os.scandir(root) if os.path.isdir(root) else ():
        match = RANK_DIR_PATTERN.match(entry.name)
        if not match or int(match.group(2)) != rank or not entry.is_dir(follow_symlinks=False):
            continue
        stamp = parse_time_tag(match.group(1))
        if stamp is not None and low <= stamp <= high:
            found.append((stamp, entry.path))
    return max(found)[1] if found else None
