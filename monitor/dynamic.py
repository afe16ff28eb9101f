"""Dynamic mode: switching collection on and off by editing the config file during a live run.

With ``DYNAMIC_MONITOR=true`` the config file is polled once per step with one ``os.stat``; only
when its (mtime, size, inode) changed is it read, and only when its content hash changed is it
parsed. An edit that says ``dynamic_on: true`` starts (or restarts with the new config) collection
at the next step; ``collect_times`` ends it, and then rank 0 alone writes ``dynamic_on: false``
back into the file, atomically and changing nothing else the user wrote (msprobe rewrites the
whole file). A broken edit is reported once and the current state goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

from monitor.config import ConfigError, MonitorConfig, read_config_file, validate_config
from monitor.files import atomic_write_text

logger = logging.getLogger("trainmon")

ENV = "DYNAMIC_MONITOR"
_DYNAMIC_ON = re.compile(r"""(["']?dynamic_on["']?\s*:\s*)(true|True|TRUE)\b""")


def dynamic_mode() -> bool:
    """True when the environment asks for dynamic mode (``DYNAMIC_MONITOR=true``, any case)."""
    return os.environ.get(ENV, "").strip().lower() == "true"


class DynamicControl:
    """Polls one config file and says when collection must (re)start with which config."""

    def __init__(self, path: str | os.PathLike, rank: int = 0) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self._signature: tuple[int, int, int] | None = None
        self._digest: str | None = None
        self._reported: str | None = None

    def poll(self) -> MonitorConfig | None:
        """A new config to start collecting with, or None (no change, switched off, or broken)."""
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            self._report("stat", f"cannot be read ({exc.strerror or exc})")
            return None
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._signature:
            return None
        self._signature = signature
        try:
            with open(self.path, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
        except OSError as exc:
            self._report("read", f"cannot be read ({exc.strerror or exc})")
            return None
        if digest == self._digest:
            return None
        self._digest = digest
        try:
            config = validate_config(read_config_file(self.path))
        except ConfigError as exc:
            self._report(digest, f"is not valid, the current state goes on: {exc}")
            return None
        return config if config.dynamic_on else None

    def _report(self, key: str, text: str) -> None:
        if self._reported != key:
            self._reported = key
            logger.error("trainmon: dynamic config %s %s", self.path, text)

    def finish(self) -> None:
        """collect_times reached: rank 0 writes ``dynamic_on: false`` back, leaving the rest as written."""
        if self.rank != 0:
            return
        try:
            with open(self.path, encoding="utf-8") as handle:
                text = handle.read()
            new_text, count = _DYNAMIC_ON.subn(lambda m: m.group(1) + _false_like(m.group(2)), text, count=1)
            if count == 0:
                return
            atomic_write_text(self.path, new_text, file_mode=os.stat(self.path).st_mode & 0o777)
            stat = os.stat(self.path)
            self._signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            self._digest = hashlib.sha256(new_text.encode("utf-8")).hexdigest()
            logger.info("trainmon: collection finished; dynamic_on set back to false in %s", self.path)
        except OSError as exc:
            logger.error("trainmon: could not write dynamic_on back to %s (%r)", self.path, exc)


def _false_like(word: str) -> str:
    return {"true": "false", "True": "False", "TRUE": "FALSE"}[word]
