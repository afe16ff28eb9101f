"""Dynamic mode: switching collection on and off by editing the config file during a live run.

With ``DYNAMIC_MONITOR=true`` the config file is polled once per step with one ``os.stat``; only
when its (mtime, size, inode) changed is it read, and only when its content hash changed is it
parsed. An edit that says ``dynamic_on: true`` starts (or restarts with the new config) collection;
``collect_times`` ends it, and then rank 0 alone writes ``dynamic_on: false`` back into the file,
atomically and changing nothing else the user wrote (msprobe rewrites the whole file). An edit
that says ``dynamic_on: false`` ends a collection under way (msprobe's goes on until
``collect_times``). A broken edit is reported once and the current state goes on.

One process switches at the next step. With several ranks the decision is made once, by rank 0,
and every rank follows it at the same step, ``DELAY_STEPS`` steps after rank 0 saw the edit.
(msprobe polls on every rank, which starts ranks at different steps when they see the edit at
different times.) Rank 0 announces the start step and the config's text through a channel the
adapter offers (PyTorch: the process group's key-value store), which every rank reads each step
in one round trip, so the other ranks need neither the file nor a timely view of it (a file
system that caches attributes for seconds, a node with a copy of its own). Without a channel, or
when it fails, rank 0 writes the step and the content hash into a schedule file next to the config
(``<config>.schedule``) and each rank starts there once its own read of the config has that hash.
No collective is used, so a rank without a monitor can never make the others wait; a rank that
sees the announcement only after its step has passed starts at once and says how late.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from typing import Protocol

from monitor.config.files import is_yaml_path, parse_config_text
from monitor.config.schema import ConfigError, MonitorConfig, validate_config
from monitor.config.values import config_warnings_said
from monitor.files import atomic_write_text

logger = logging.getLogger("trainmon")

ENV = "DYNAMIC_MONITOR"
#: with several ranks, how many steps after rank 0 saw an edit every rank starts collecting: the
#: margin for the edit and the schedule to reach every rank (ranks that synchronise every step,
#: as data parallelism does, are within a step of each other)
DELAY_STEPS = 5
_DYNAMIC_ON = re.compile(r"""(["']?dynamic_on["']?\s*:\s*)(true|True|TRUE)\b""")


class ScheduleChannel(Protocol):
    """Where rank 0 announces a start to the other ranks (bytes: the start step, the content hash
    and the text of the config); a failing call raises, and the schedule file takes over."""

    def publish(self, announcement: bytes) -> None:
        """Rank 0: the newest announcement."""

    def poll(self) -> list[bytes]:
        """Other ranks: the announcements published since the last poll (or since the channel was
        made), oldest first; one round trip when there are none."""


def dynamic_mode() -> bool:
    """True when the environment asks for dynamic mode (``DYNAMIC_MONITOR=true``, any case)."""
    return os.environ.get(ENV, "").strip().lower() == "true"


class DynamicControl:
    """Polls one config file and says from which step which edited config applies."""

    def __init__(self, path: str | os.PathLike, rank: int = 0, world_size: int = 1) -> None:
        self.path = os.fspath(path)
        self.schedule_path = self.path + ".schedule"
        self.rank = rank
        self.world_size = world_size
        self.channel: ScheduleChannel | None = None
        self._signature: tuple[int, int, int] | None = None
        self._digest: str | None = None
        self._reported: str | None = None
        #: the text of the newest valid config read from the file (what rank 0 announces)
        self._text = ""
        #: valid configs read or announced, by content hash
        self._known: dict[str, MonitorConfig] = {}
        #: (step, content hash) of the agreed edits not applied yet, by step
        self._orders: list[tuple[int, str]] = []
        #: rank 0: the orders it made lately, which the schedule file lists
        self._made: list[tuple[int, str]] = []
        self._applied_step = -1
        self._schedule_signature: tuple[int, int, int] | None = None

    def attach(
        self, rank: int, world_size: int, channel: ScheduleChannel | None = None
    ) -> MonitorConfig | None:
        """At set_monitor, on every rank at the same step: the file's config (collection starts
        now if it says ``dynamic_on: true``), None if it cannot be used."""
        self.rank, self.world_size, self.channel = rank, world_size, channel
        self._schedule_signature = _signature_of(self.schedule_path)  # an older run's schedule
        return self._read_file()

    def poll(self, step: int) -> MonitorConfig | None:
        """At the end of each step (``step`` is the next one): the edited config that applies
        from ``step`` on (``dynamic_on`` true: collect with it; false: collect nothing), or None
        (no change, not yet, or broken)."""
        if self.world_size <= 1:
            return self._read_file()
        if self.rank == 0:
            if self._read_file() is not None and self._digest is not None:
                self._schedule(step + DELAY_STEPS, self._digest)
        else:
            self._follow_channel()
            self._follow_schedule()
        return self._due(step)

    def _read_file(self) -> MonitorConfig | None:
        """The file's config when its content changed to a valid one (``dynamic_on`` true: start
        or restart with it; false: end a collection under way)."""
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
                raw = handle.read()
            digest = hashlib.sha256(raw).hexdigest()
        except OSError as exc:
            self._report("read", f"cannot be read ({exc.strerror or exc})")
            return None
        if digest == self._digest:
            return None
        self._digest = digest
        try:
            text = raw.decode("utf-8")
            first = not self._known  # TrainerMon read this file just now, and said what it found
            with config_warnings_said() if first else contextlib.nullcontext():
                config = validate_config(parse_config_text(text, self.path, is_yaml_path(self.path)))
        except UnicodeDecodeError:
            self._report(digest, "is not valid, the current state goes on: expected UTF-8 text")
            return None
        except ConfigError as exc:
            self._report(digest, f"is not valid, the current state goes on: {exc}")
            return None
        self._forget_unused()
        self._known[digest], self._text = config, text
        return config

    def _schedule(self, step: int, digest: str) -> None:
        """Rank 0: every rank applies the config with this hash from ``step`` on."""
        self._orders.append((step, digest))
        self._made = [*self._made[-(2 * DELAY_STEPS) :], (step, digest)]
        if self._announce(step, digest) or self._write_schedule():
            switch = "collects" if self._known[digest].dynamic_on else "stops collecting"
            logger.info("trainmon: config %s updated; every rank %s from step %d", self.path, switch, step)

    def _announce(self, step: int, digest: str) -> bool:
        """Rank 0: the order and the config's text through the channel; whether it went."""
        if self.channel is None:
            return False
        announcement = {"step": step, "sha256": digest, "config": self._text, "yaml": is_yaml_path(self.path)}
        try:
            self.channel.publish(json.dumps(announcement).encode("utf-8"))
        except Exception as exc:
            self._lose_channel(exc)
            return False
        return True

    def _write_schedule(self) -> bool:
        """Rank 0: the recent orders into the schedule file; whether it was written."""
        try:
            atomic_write_text(self.schedule_path, json.dumps({"orders": self._made}) + "\n")
        except OSError as exc:
            logger.error(
                "trainmon: could not write %s (%r); other ranks will not follow", self.schedule_path, exc
            )
            return False
        self._schedule_signature = _signature_of(self.schedule_path)
        return True

    def _follow_channel(self) -> None:
        """Other ranks: take up rank 0's announcements, each config parsed from the text it sent."""
        if self.channel is None:
            return
        try:
            announcements = self.channel.poll()
        except Exception as exc:
            self._lose_channel(exc)
            return
        for announcement in announcements:
            try:
                told = json.loads(announcement)
                config = validate_config(parse_config_text(told["config"], self.path, bool(told["yaml"])))
                order = (int(told["step"]), str(told["sha256"]))
            except (ValueError, KeyError, TypeError, ConfigError) as exc:
                self._report("announcement", f"announced by rank 0 cannot be used ({exc})")
                continue
            self._known[order[1]] = config
            self._take_orders([order])

    def _lose_channel(self, exc: BaseException) -> None:
        self.channel = None
        logger.warning(
            "trainmon: dynamic mode cannot reach the other ranks' channel (%r); the schedule file "
            "%s is used instead",
            exc,
            self.schedule_path,
        )

    def _follow_schedule(self) -> None:
        """Other ranks: take up the schedule file's new orders; each applies once this rank's own
        read of the config has its hash."""
        signature = _signature_of(self.schedule_path)
        if signature is not None and signature != self._schedule_signature:
            try:
                with open(self.schedule_path, encoding="utf-8") as handle:
                    orders = [(int(step), str(digest)) for step, digest in json.load(handle)["orders"]]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._report("schedule", f"schedule {self.schedule_path} cannot be read ({exc})")
                return
            self._schedule_signature = signature
            self._take_orders(orders)
        if any(digest not in self._known for _, digest in self._orders):
            self._read_file()  # the edit may reach this rank's view of the file later

    def _take_orders(self, orders: list[tuple[int, str]]) -> None:
        new = [order for order in orders if order[0] > self._applied_step and order not in self._orders]
        self._orders = sorted(self._orders + new)

    def _due(self, step: int) -> MonitorConfig | None:
        """The config of the latest order whose step has come and whose config this rank has
        (earlier due orders are passed over: the latest one applies)."""
        ready = [order for order in self._orders if order[0] <= step and order[1] in self._known]
        if not ready:
            return None
        start, digest = ready[-1]
        config = self._known[digest]
        self._orders = [order for order in self._orders if order[0] > start]
        self._applied_step = start
        self._forget_unused()
        if step > start:
            logger.warning(
                "trainmon: rank %d follows the config edit at step %d, %d step(s) after the other ranks "
                "(the edit or the schedule reached it late)",
                self.rank,
                step,
                step - start,
            )
        return config

    def _forget_unused(self) -> None:
        """Keep the configs that pending orders still need (and the file's latest)."""
        needed = {digest for _, digest in self._orders} | {self._digest}
        self._known = {digest: config for digest, config in self._known.items() if digest in needed}

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


def _signature_of(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _false_like(word: str) -> str:
    return {"true": "false", "True": "False", "TRUE": "FALSE"}[word]
