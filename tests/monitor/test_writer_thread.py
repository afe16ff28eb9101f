"""WriterThread (monitor/writers/base.py): ordering, failing sinks, draining, flushing."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from monitor.record import RowSet, StepRecord
from monitor.writers.base import WriterThread

ROWS = RowSet.build([0, 0], ["layers.0.weight", "layers.1.weight"], 0, "post_grad")


def _record(step: int, prefix: str = "grad_reduced") -> StepRecord:
    return StepRecord(prefix, step, ("norm",), ROWS, values=np.array([[step], [-step]], dtype=np.float64))


class RecordingSink:
    """Remembers every call, with the thread it ran on."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.events: list[tuple] = []
        self.threads: set[str] = set()
        self.closed = 0

    def write(self, record: StepRecord) -> None:
        if self.delay:
            time.sleep(self.delay)
        self.threads.add(threading.current_thread().name)
        self.events.append(("write", record.prefix, record.step, record.values.tolist()))

    def end_step(self, step: int) -> None:
        self.events.append(("end", step))

    def close(self) -> None:
        self.closed += 1


class FailingSink:
    """Raises on every write."""

    def __init__(self) -> None:
        self.writes = 0
        self.closed = 0

    def write(self, record: StepRecord) -> None:
        self.writes += 1
        raise RuntimeError("disk full")

    def close(self) -> None:
        self.closed += 1


class WriteOnlySink:
    """No end_step: the thread must skip it."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def write(self, record: StepRecord) -> None:
        self.steps.append(record.step)

    def close(self) -> None:
        pass


def test_records_and_step_ends_are_delivered_in_order():
    sink = RecordingSink()
    writer = WriterThread([sink])
    expected = []
    for step in range(50):
        for prefix in ("grad_unreduced", "grad_reduced", "exp_avg"):
            writer.submit(_record(step, prefix))
            expected.append(("write", prefix, step, [[float(step)], [float(-step)]]))
        writer.end_step(step)
        expected.append(("end", step))
    writer.close()
    assert sink.events == expected


def test_sinks_run_on_the_writer_thread():
    sink = RecordingSink()
    writer = WriterThread([sink], name="trainmon-writer-under-test")
    writer.submit(_record(0))
    writer.close()
    assert sink.threads == {"trainmon-writer-under-test"}


def test_failing_sink_is_switched_off_and_logged_once_while_another_keeps_receiving(trainmon_log):
    failing, healthy = FailingSink(), RecordingSink()
    writer = WriterThread([failing, healthy])
    for step in range(5):
        writer.submit(_record(step))
    writer.flush()
    assert failing.writes == 1
    assert failing.closed == 1
    assert [e[2] for e in healthy.events] == [0, 1, 2, 3, 4]
    errors = trainmon_log.at(logging.ERROR)
    assert len(errors) == 1
    assert "FailingSink" in errors[0]
    assert "disk full" in errors[0]
    assert writer.alive
    writer.close()
    assert failing.closed == 1  # not closed a second time
    assert healthy.closed == 1


def test_writer_is_not_alive_when_every_sink_failed():
    writer = WriterThread([FailingSink()])
    writer.submit(_record(0))
    writer.flush()
    assert not writer.alive
    writer.close()


def test_close_drains_everything_queued():
    sink = RecordingSink(delay=0.001)
    writer = WriterThread([sink])
    for step in range(100):
        writer.submit(_record(step))
    writer.end_step(99)
    writer.close()
    assert [e[2] for e in sink.events if e[0] == "write"] == list(range(100))
    assert sink.events[-1] == ("end", 99)
    assert sink.closed == 1


def test_close_is_idempotent():
    sink = RecordingSink()
    writer = WriterThread([sink])
    writer.submit(_record(0))
    writer.close()
    writer.close()
    assert sink.closed == 1
    assert len(sink.events) == 1
    assert not writer.alive


def test_records_submitted_after_close_are_ignored():
    sink = RecordingSink()
    writer = WriterThread([sink])
    writer.close()
    writer.submit(_record(1))
    writer.end_step(1)
    writer.flush()
    assert sink.events == []


def test_flush_waits_until_everything_queued_is_written():
    sink = RecordingSink(delay=0.002)
    writer = WriterThread([sink])
    for step in range(30):
        writer.submit(_record(step))
    writer.flush()
    assert len(sink.events) == 30
    assert sink.closed == 0  # flush does not close
    writer.close()


def test_sink_without_end_step_still_receives_records():
    sink = WriteOnlySink()
    writer = WriterThread([sink])
    for step in range(3):
        writer.submit(_record(step))
        writer.end_step(step)
    writer.close()
    assert sink.steps == [0, 1, 2]


def test_pending_copy_is_completed_on_the_writer_thread():
    fetched_on: list[str] = []

    def fetch():
        fetched_on.append(threading.current_thread().name)
        return [[1.5], [2.5]]

    sink = RecordingSink()
    writer = WriterThread([sink], name="trainmon-writer-fetch")
    writer.submit(StepRecord("grad_reduced", 4, ("norm",), ROWS, fetch=fetch))
    writer.close()
    assert fetched_on == ["trainmon-writer-fetch"]
    assert sink.events == [("write", "grad_reduced", 4, [[1.5], [2.5]])]


def test_failed_copy_skips_that_record_only(trainmon_log):
    def broken():
        raise RuntimeError("device lost")

    sink = RecordingSink()
    writer = WriterThread([sink])
    writer.submit(StepRecord("grad_reduced", 0, ("norm",), ROWS, fetch=broken))
    writer.submit(_record(1))
    writer.close()
    assert [e[2] for e in sink.events] == [1]
    assert sink.closed == 1  # the sink itself was not switched off
    assert any("device lost" in m for m in trainmon_log.at(logging.ERROR))


def test_queued_call_runs_in_order_with_records():
    sink = RecordingSink()
    writer = WriterThread([sink])
    seen_at_call: list[int] = []
    writer.submit(_record(0))
    writer.call(lambda: seen_at_call.append(len(sink.events)))
    writer.submit(_record(1))
    writer.close()
    assert seen_at_call == [1]
    assert len(sink.events) == 2


def test_failing_job_does_not_stop_the_thread(trainmon_log):
    sink = RecordingSink()
    writer = WriterThread([sink])
    writer.call(lambda: 1 / 0)
    writer.submit(_record(0))
    writer.close()
    assert len(sink.events) == 1
    assert len(trainmon_log.at(logging.ERROR)) == 1


def test_sink_failing_in_close_does_not_stop_the_other_sinks_closing(trainmon_log):
    class CloseFails(RecordingSink):
        def close(self) -> None:
            super().close()
            raise OSError("cannot close")

    first, second = CloseFails(), RecordingSink()
    writer = WriterThread([first, second])
    writer.close()
    assert (first.closed, second.closed) == (1, 1)
    assert any("cannot close" in m for m in trainmon_log.at(logging.ERROR))


class BackgroundSink(RecordingSink):
    """Has ``pieces`` pieces of background work, one per idle() call; ``fail`` makes idle raise."""

    def __init__(self, pieces: int, fail: bool = False) -> None:
        super().__init__()
        self.pieces = pieces
        self.fail = fail
        self.idle_threads: set[str] = set()
        self.empty_calls = 0

    def idle(self) -> bool:
        self.idle_threads.add(threading.current_thread().name)
        if self.fail:
            raise OSError(5, "Input/output error")
        if self.pieces == 0:
            self.empty_calls += 1
            return False
        self.events.append(("idle", self.pieces))
        self.pieces -= 1
        return self.pieces > 0


def test_background_work_runs_piece_by_piece_while_nothing_is_queued_and_then_stops():
    sink = BackgroundSink(pieces=3)
    writer = WriterThread([sink])
    writer.submit(_record(0))
    writer.end_step(0)
    assert writer.flush(5.0)
    deadline = time.monotonic() + 5.0
    while sink.pieces and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.submit(_record(1))
    writer.close()
    idle = [event for event in sink.events if event[0] == "idle"]
    assert idle == [("idle", 3), ("idle", 2), ("idle", 1)]
    assert sink.empty_calls <= 2  # asked again only after an item (it may bring work), never in a loop
    assert sink.events[-1][:3] == ("write", "grad_reduced", 1)
    assert sink.idle_threads == {"trainmon-writer"}


def test_a_sink_whose_background_work_fails_is_switched_off_and_the_others_go_on(caplog):
    failing, healthy = BackgroundSink(pieces=1, fail=True), RecordingSink()
    writer = WriterThread([failing, healthy])
    writer.submit(_record(0))
    writer.end_step(0)
    assert writer.flush(5.0)
    writer.submit(_record(1))
    writer.close()
    assert [e[:3] for e in healthy.events if e[0] == "write"] == [
        ("write", "grad_reduced", 0),
        ("write", "grad_reduced", 1),
    ]
    assert ("write", "grad_reduced", 1) not in [e[:3] for e in failing.events]
    assert "BackgroundSink failed in idle" in caplog.text


def test_a_lost_wake_up_does_not_keep_the_writer_asleep_at_close():
    """A Ctrl-C that lands inside ``queue.put`` (at random, so simulated here: every wake-up is
    lost) left the writer asleep on its empty queue and the process waiting for it at exit for
    ever; the writer looks at its queue again within a second."""
    sink = RecordingSink()
    writer = WriterThread([sink])
    time.sleep(0.2)  # the writer is asleep on the empty queue
    writer._queue.not_empty.notify = lambda n=1: None
    writer.submit(_record(3))
    closing = threading.Thread(target=writer.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()
    assert sink.events == [("write", "grad_reduced", 3, [[3.0], [-3.0]])] and sink.closed == 1


def test_close_leaves_a_writer_stuck_in_a_sink_and_says_so(monkeypatch, trainmon_log):
    """A sink stuck in a write (a dead file system) must not keep the process from exiting."""
    import monitor.writers.base as base

    monkeypatch.setattr(base, "WAKE_S", 0.05)
    monkeypatch.setattr(base, "CLOSE_STALL_S", 1.0)
    release = threading.Event()

    class StuckSink(RecordingSink):
        def write(self, record: StepRecord) -> None:
            release.wait(30)

    writer = WriterThread([StuckSink()])
    writer.submit(_record(1))
    started = time.monotonic()
    writer.close()
    waited = time.monotonic() - started
    release.set()
    assert waited < 10
    (warning,) = trainmon_log.at(logging.WARNING)
    assert "the writer made no progress for 1 s at the end of the run" in warning
