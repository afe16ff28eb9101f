"""Delivery of incident messages: one thread and one bounded queue per sink, and the stop flag.

``Alerts.incident`` runs on the monitor's writer thread and only builds the message, drops a claim
file and puts the message on each sink's queue (never waiting). Each sink's own daemon thread
applies its rank choice, cool-down and hourly limit, retries with exponential back-off, and logs
its first failure once; a sink that hangs holds up only itself, and a full queue drops the message
(counted). Messages dropped by a limit are counted in the next one delivered (``suppressed``).

Which rank delivers (``ranks``): ``all``; ``rank0``; or ``lowest`` (default), the lowest rank
whose incident began at that step, naming the root that comes first among those ranks' incidents
(``monitor.alerts.claims``): each rank that opens an incident claims its step, waits
``CLAIM_WAIT_S`` and delivers only if no lower rank claimed it. Where ranks do not share the output
root (node-local disks), each node's lowest rank delivers.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from monitor.alerts.claims import job_message, read_claims, write_claim
from monitor.alerts.config import BundleSpec, SinkSpec
from monitor.alerts.sinks import CallbackSink, Message, open_sink

logger = logging.getLogger("trainmon")

#: messages waiting per sink; more are dropped (and counted).
QUEUE_SIZE = 64
#: seconds a ``lowest`` sink waits for other ranks' claims before deciding.
CLAIM_WAIT_S = 3.0
#: claims this many seconds older than the session still count as its own (ranks start a little
#: apart); an earlier run's are older, as a restart takes longer.
CLAIM_MARGIN_S = 2.0
#: seconds ``close`` waits for each sink to deliver what is queued.
CLOSE_WAIT_S = 5.0
_HOUR = 3600.0


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats as strings ("nan", "inf"), containers converted throughout."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def incident_message(incident: Any, output_dir: str | None) -> Message:
    """The message of a new incident: where and when it began, its root, and a one-line summary."""
    root = incident.root
    return _plain(
        {
            "event": "incident",
            "incident": incident.id,
            "rank": incident.rank,
            "step": incident.onset_step,
            "micro_step": incident.onset_micro_step,
            "tag": root.get("tag_name"),
            "op": root.get("op"),
            "rule": root.get("rule"),
            "value": root.get("value"),
            "baseline": root.get("baseline"),
            "evidence": list(incident.evidence),
            "batch_ids": incident.batch_ids,
            "summary": incident.announcement(),
            "output_dir": output_dir,
            "host": socket.gethostname(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    )


class Channel:
    """One sink: its queue, its thread and its limits. ``claims``: the claims directory where the
    sink delivers for the lowest rank (``ranks: lowest`` in a job of several processes), and the
    wall-clock time from which claims there are this run's."""

    def __init__(
        self, sink: Any, spec: SinkSpec, label: str, rank: int, claims: tuple[str, float] | None
    ) -> None:
        self.sink, self.spec, self.label, self.rank, self.claims = sink, spec, label, rank, claims
        self.queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.delivered = 0
        self.failed = 0
        self.suppressed = 0
        self._sent: collections.deque[float] = collections.deque()
        self._warned = False
        self._said_limit = False
        #: set by close(): after it, nothing more is delivered
        self._deadline: float | None = None
        #: set by close(): wakes a retry's back-off, which then gives up if it would outlast it
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trainmon-alert {label}", daemon=True)
        self._thread.start()

    def offer(self, message: Message) -> None:
        """Queue a message without waiting; a full queue drops it."""
        try:
            self.queue.put_nowait((time.monotonic(), message))
        except queue.Full:
            self.suppressed += 1
            self._warn_once(f"its queue is full ({QUEUE_SIZE} messages waiting); dropping")

    def close(self, wait: float) -> None:
        """Deliver what is queued for at most ``wait`` seconds from now, then abandon the rest; a
        delivery under way (a hanging endpoint) ends at its own timeout, on this daemon thread,
        unless ``finish`` ends it first (a command still running at the run's end)."""
        self._deadline = time.monotonic() + wait
        self._closing.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:  # the thread sees the deadline at its next message, or an empty queue
            pass

    def finish(self, wait: float, given: float) -> None:
        """Wait at most ``wait`` seconds more for the thread ``close`` ended, then say what it left
        undelivered of the ``given`` seconds it had."""
        self._thread.join(wait)
        left = sum(item is not None for item in list(self.queue.queue)) + self._thread.is_alive()
        if self._thread.is_alive() and hasattr(self.sink, "abandon"):
            self.sink.abandon()  # a program still running must not outlive the run, nor page late
        if left:  # said even where a failure was said before: these were never tried to the end
            logger.warning(
                "trainmon: %s: %d alert message(s) not delivered in the %.0f s left to it at the run's end",
                self.label,
                left,
                given,
            )

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=None if self._deadline is None else 0.1)
            except queue.Empty:  # closing, and nothing left
                return self._say_held_back()
            if item is None or (self._deadline is not None and time.monotonic() > self._deadline):
                return self._say_held_back()
            queued_at, message = item
            try:
                mine = self._mine(queued_at, message)
                if mine is not None and self._allowed():
                    self._deliver({**mine, "suppressed": self.suppressed})
            except Exception as exc:  # never let a sink's thread die on an unexpected error
                self._warn_once(f"failed unexpectedly ({exc!r})")

    def _say_held_back(self) -> None:
        """At the sink's end: the messages its limits held back since its last delivery, which no
        later message will count."""
        if self.suppressed:
            logger.warning(
                "trainmon: %s: %d alert message(s) held back by its limits (cooldown_s, max_per_hour, "
                "a full queue) since its last delivery; incidents.json has every incident",
                self.label,
                self.suppressed,
            )

    def _mine(self, queued_at: float, message: Message) -> Message | None:
        """The message this rank delivers (the sink's ``ranks``), or None where another rank does."""
        if self.spec.ranks == "rank0":
            return message if self.rank == 0 else None
        if self.spec.ranks == "all" or self.claims is None:
            return message
        directory, since = self.claims
        time.sleep(max(0.0, queued_at + CLAIM_WAIT_S - time.monotonic()))
        claims = read_claims(os.path.join(directory, f"step{message['step']}"), since)
        if min(claims, default=self.rank) < self.rank:
            return None
        return job_message(message, self.rank, claims)

    def _allowed(self) -> bool:
        """The cool-down and the hourly limit; a refused message is counted."""
        now = time.monotonic()
        while self._sent and now - self._sent[0] > _HOUR:
            self._sent.popleft()
        cooling = bool(self._sent) and now - self._sent[-1] < self.spec.cooldown_s
        if cooling or len(self._sent) >= self.spec.max_per_hour:
            self.suppressed += 1
            if not self._said_limit:  # counted in the next delivered message; said once here
                self._said_limit = True
                why = "its cooldown_s" if cooling else f"its max_per_hour ({self.spec.max_per_hour})"
                logger.warning("trainmon: %s holds back a message for %s (said once)", self.label, why)
            return False
        return True

    def _deliver(self, message: Message) -> None:
        for attempt in range(self.spec.retries + 1):
            try:
                self.sink.deliver(message)
            except Exception as exc:
                delay = self.spec.backoff_s * 2**attempt
                if attempt == self.spec.retries or not self._may_wait(delay):
                    # said before counted: whoever sees the count (a test, a summary) finds it said
                    self._warn_once(f"failed after {attempt + 1} attempt(s) ({exc}); training goes on")
                    self.failed += 1
                    return
            else:
                self._sent.append(time.monotonic())
                self.delivered += 1
                self.suppressed = 0
                return

    def _may_wait(self, delay: float) -> bool:
        """Wait ``delay`` seconds before a retry; False (at once) where close() came or comes
        meanwhile and its deadline falls before the back-off ends."""
        until = time.monotonic() + delay
        if self._deadline is None:
            self._closing.wait(delay)  # woken early by close()
        if self._deadline is not None:
            if until > self._deadline:
                return False
            time.sleep(max(0.0, until - time.monotonic()))
        return True

    def _warn_once(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("trainmon: %s %s (reported once)", self.label, what)


class Alerts:
    """The sinks, callbacks and actions of one session.

    Args:
        sinks: the ``alert.sinks`` entries.
        actions: the ``alert.actions`` entries (``stop``).
        rank: this process's global rank.
        root: the output root (claims, relative file sinks).
        bundle: how many incidents get an evidence bundle (None: none); the session writes them.
        world_size: the ranks of the job (1: no other rank to wait for a claim of; 0: unknown).
    """

    def __init__(
        self,
        sinks: Sequence[SinkSpec],
        actions: Sequence[str],
        rank: int,
        root: str,
        bundle: BundleSpec | None = None,
        world_size: int = 0,
    ) -> None:
        self.rank = rank
        self.root = root
        self.actions = tuple(actions)
        #: an incident asked for the actions (``stop``, ``checkpoint``); the session acts on it
        self.action_requested = threading.Event()
        self.action_reason = ""
        needs_claims = world_size != 1 and any(spec.ranks == "lowest" for spec in sinks)
        self._claims = os.path.join(root, "anomaly_detected", "alerts") if needs_claims else None
        #: claims from this time on are this run's (less a margin for the ranks' start and clocks)
        claims = None if self._claims is None else (self._claims, time.time() - CLAIM_MARGIN_S)
        hidden = {variable for spec in sinks for variable in spec.variables()}
        self.channels = [
            Channel(open_sink(spec, root, hidden), spec, spec.label(i), rank, claims)
            for i, spec in enumerate(sinks)
        ]
        self._lock = threading.Lock()
        #: incidents (as JSON) whose evidence bundle is still to be written, and how many more may be
        self._bundles: collections.deque[dict] = collections.deque()
        self._bundles_left = bundle.incidents if bundle is not None else 0

    @property
    def bundles_wanted(self) -> bool:
        """Whether an incident found from now on would still get an evidence bundle."""
        return self._bundles_left > 0

    def take_bundles(self) -> list[dict]:
        """The incidents found since the last call whose evidence is to be kept (training thread)."""
        taken = []
        while self._bundles:
            taken.append(self._bundles.popleft())
        return taken

    def add_callback(self, callback: Callable[[Message], Any]) -> None:
        """Call ``callback(message)`` on its own thread for each new incident of this rank."""
        name = getattr(callback, "__qualname__", repr(callback))
        spec = SinkSpec("callback", ranks="all", retries=0, max_per_hour=1_000_000)
        with self._lock:
            self.channels.append(
                Channel(CallbackSink(callback), spec, f"on_incident({name})", self.rank, None)
            )

    def incident(self, incident: Any, output_dir: str | None) -> None:
        """A new incident (writer thread): claim its step, queue its message, ask for the actions."""
        message = incident_message(incident, output_dir)
        if self._claims is not None:
            try:
                write_claim(self._claims, self.root, self.rank, message)
            except OSError as exc:  # without a claim this rank delivers as if alone
                logger.warning(
                    "trainmon: cannot write the alert claim for step %d (%r)", message["step"], exc
                )
        with self._lock:
            channels = list(self.channels)
        for channel in channels:
            channel.offer(message)
        if self._bundles_left > 0:
            self._bundles_left -= 1
            self._bundles.append(incident.to_json())
        if self.actions and not self.action_requested.is_set():
            self.action_reason = message["summary"]
            self.action_requested.set()

    def close(self, block: bool = True) -> None:
        """Let the sinks deliver what is queued within CLOSE_WAIT_S in all: waiting for them
        (``block``: the end of the run), or not (the alert config changed while training runs:
        the old sinks finish on their own threads, and the training thread goes on)."""
        with self._lock:
            channels, self.channels = self.channels, []
        deadline = time.monotonic() + CLOSE_WAIT_S
        for channel in channels:  # all at once: a hanging sink does not use up the others' time
            channel.close(CLOSE_WAIT_S)
        if block:
            for channel in channels:
                channel.finish(max(0.0, deadline - time.monotonic()), CLOSE_WAIT_S)
