"""The writer interface and the background thread that feeds writers.

A writer implements ``write(record)`` and ``close()``. The training thread only puts records on
a bounded queue; a daemon thread resolves them (finishing any pending device-to-host copy) and
hands them to each sink. A sink that raises is logged once with its cause and switched off; the
others keep working and the training never sees the exception.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from monitor.record import StepRecord

logger = logging.getLogger("trainmon")

#: records waiting to be written before the training thread has to wait for the writer.
DEFAULT_QUEUE_SIZE = 256
#: how long the training thread waits for room in a full queue before dropping a record.
PUT_TIMEOUT_S = 60.0
#: how long the end of a collected step waits for it to be written (crash safety).
STEP_WAIT_S = 10.0
#: the longest the writer thread sleeps on an empty queue before it looks again: a Ctrl-C that
#: lands inside ``queue.put`` can lose the wake-up of the item just queued (the stop at exit too)
WAKE_S = 1.0
#: how long ``close()`` waits for a writer thread that makes no progress, no item taken and no
#: sink call ended (a sink stuck in a write to a dead file system), before it leaves it: the
#: process must still be able to exit; a sink's last merge at close may take minutes
CLOSE_STALL_S = 300.0


class Writer(Protocol):
    """Where a StepRecord goes: CSV files, TensorBoard events, memory, the anomaly detector.

    A writer may also define ``end_step(step)``, called once when a collected step is complete,
    and ``idle()``, called while nothing is queued to do a piece of background work (returning
    whether more remains).
    """

    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class RepeatedSteps:
    """Steps a resumed run writes again into files an earlier run wrote (``append_output``): the
    earlier values are kept (first write wins). Said when the first is left out, naming where,
    and at ``close()`` with every step left out per data type, so that none goes unsaid."""

    def __init__(self) -> None:
        #: data type -> (first, last, count) of the steps left out
        self._left_out: dict[str, tuple[int, int, int]] = {}

    def leave_out(self, prefix: str, step: int, where: str) -> None:
        first, last, count = self._left_out.get(prefix, (step, step, 0))
        if not count:
            logger.warning(
                "trainmon: %s: step %d is already in %s, written by an earlier run; such steps are "
                "not written again (the earlier values are kept)",
                prefix,
                step,
                where,
            )
        self._left_out[prefix] = (min(first, step), max(last, step), count + 1)

    def close(self) -> None:
        for prefix, (first, last, count) in sorted(self._left_out.items()):
            logger.warning(
                "trainmon: %s: %d step(s) from %d to %d were already written by an earlier run and "
                "were not written again",
                prefix,
                count,
                first,
                last,
            )
        self._left_out = {}


class _StepEnd:
    __slots__ = ("done", "step")

    def __init__(self, step: int) -> None:
        self.step = step
        self.done = threading.Event()


_STOP = object()


class WriterThread:
    """A bounded queue drained by one daemon thread into a list of sinks.

    Drained and joined by ``close()``, which is also registered to run at interpreter exit.
    """

    def __init__(
        self, sinks: Sequence[Writer], queue_size: int = DEFAULT_QUEUE_SIZE, name: str = "trainmon-writer"
    ):
        self._sinks: list[Writer | None] = list(sinks)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._dropped = 0
        #: items the thread has taken from the queue and sink calls it ended: its progress, for
        #: ``close()``
        self._handled = 0
        self._wait_for_steps = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._atexit = _weak_close(self)
        atexit.register(self._atexit)

    @property
    def alive(self) -> bool:
        return not self._closed and any(s is not None for s in self._sinks)

    def submit(self, record: StepRecord) -> None:
        """Queue a record (training thread). Never raises."""
        self._put(record)

    def end_step(self, step: int) -> None:
        """End a collected step: sinks flush whole rows / replace their JSON, and this call returns
        when they have, so a step that has ended survives a crash (every step before the one a kill
        interrupts is on disk). A writer more than STEP_WAIT_S behind is reported once
        and no longer waited for."""
        marker = _StepEnd(step)
        if not self._put(marker) or not self._wait_for_steps:
            return
        if not marker.done.wait(STEP_WAIT_S):
            self._wait_for_steps = False
            logger.warning(
                "trainmon: the writer is more than %.0f s behind at step %d; training no longer waits for "
                "it (a crash may lose the last steps written)",
                STEP_WAIT_S,
                step,
            )

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread, in order with the records."""
        self._put(fn)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been written (at most ``timeout`` seconds);
        whether it was."""
        if self._closed or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._put(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        """Drain the queue, close every sink and stop the thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._join()
        if self._dropped:
            logger.warning(
                "trainmon: %d records were dropped because the writer could not keep up", self._dropped
            )

    def _join(self) -> None:
        """Wait for the thread to drain the queue and end, as long as it makes progress."""
        handled, still = self._handled, 0.0
        while self._thread.is_alive():
            self._thread.join(WAKE_S)
            handled, still = self._handled, (still + WAKE_S if self._handled == handled else 0.0)
            if still >= CLOSE_STALL_S and self._thread.is_alive():
                logger.warning(
                    "trainmon: the writer made no progress for %.0f s at the end of the run (a sink "
                    "stuck in a write?); the outputs may miss their last steps",
                    CLOSE_STALL_S,
                )
                return

    def _put(self, item: object) -> bool:
        """Queue an item; False when it was not queued (closed, or the queue stayed full)."""
        if self._closed:
            return False
        try:
            self._queue.put(item, timeout=PUT_TIMEOUT_S)
        except queue.Full:
            self._dropped += 1
            return False
        return True

    def _run(self) -> None:
        idle_work = True  # whether a sink may have background work for an empty queue
        while True:
            try:
                item = self._queue.get(block=False) if idle_work else self._queue.get(timeout=WAKE_S)
            except queue.Empty:
                idle_work = self._idle() if idle_work else False
                continue
            idle_work = True
            self._handled += 1
            if item is _STOP:
                break
            if isinstance(item, StepRecord):
                self._each_sink("write", item)
            elif isinstance(item, _StepEnd):
                self._each_sink("end_step", item.step)
                item.done.set()
            else:
                try:
                    item()
                except Exception:  # a queued job must never kill the thread
                    logger.exception("trainmon: a background job failed")
        for index in range(len(self._sinks)):
            self._call_sink(index, "close")

    def _idle(self) -> bool:
        """The queue is empty: one piece of background work of each sink that has some (an
        ``idle()`` method returning whether more remains). A record that arrives waits for one
        piece at most, never for all of it."""
        more = False
        for index in range(len(self._sinks)):
            more |= bool(self._call_sink(index, "idle"))
        return more

    def _each_sink(self, method: str, arg: object) -> None:
        if isinstance(arg, StepRecord):
            try:
                arg.resolve()
            except Exception as exc:
                logger.error(
                    "trainmon: could not copy %s of step %d to the host: %r", arg.prefix, arg.step, exc
                )
                return
        for index in range(len(self._sinks)):
            self._call_sink(index, method, arg)

    def _call_sink(self, index: int, method: str, *args: object) -> object:
        """``sink.method(*args)``'s result; a sink that raises is switched off (None)."""
        sink = self._sinks[index]
        if sink is None:
            return None
        fn = getattr(sink, method, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self._sinks[index] = None
            logger.error(
                "trainmon: %s failed in %s (%r); it is switched off, training and the other outputs go on",
                type(sink).__name__,
                method,
                exc,
            )
            if method != "close":
                try:
                    sink.close()
                except Exception:
                    pass
            return None
        finally:
            self._handled += 1  # progress, for close()


def _weak_close(writer: WriterThread) -> Callable[[], None]:
    ref = weakref.ref(writer)

    def close() -> None:
        target = ref()
        if target is not None:
            target.close()

    return close
