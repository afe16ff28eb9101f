"""From abnormal values to what people are told about: records once per tag, incidents per cause.

The detector returns every abnormal (tag, op) cell of every step. Here, on the writer thread:

* **Records.** A tag becomes a record when it turns abnormal: at most one record per tag and
  step (a NaN that makes norm, mean, min and max NaN is one record), and none while it stays
  abnormal at consecutive collected steps, whether by a rule or as a non-finite value (a spike
  that turns into NaN is one event: the incident counts the NaN steps).
* **Incidents.** New records while no incident is open start one: its onset is that step, its
  root and the evidence come from :mod:`monitor.anomaly.root`. While an incident is open, new
  records join it (what follows a fault is mostly its echo: the optimizer's moments, the next
  steps' activations) until it has gone ``FRESH_AFTER`` collected steps without one: records
  after that start an incident of their own (a second fault while the first one's values stay
  abnormal), the first staying open. Open incidents stay open while any tag is abnormal and
  close after ``CLOSE_AFTER`` collected steps without one, or when monitoring ends after a step
  without one. A NaN that stays is one incident, open to the end.

The console gets one line per new incident (warning) and one when it closes (info).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from monitor.anomaly.detector import Anomaly, Detector, Verdicts
from monitor.anomaly.root import choose_root, describe_root, phase_of
from monitor.datatypes.tasks import SCALED_PREFIXES, parse_tag, task_of_tags, tasks_of_prefix
from monitor.naming import split_tag

logger = logging.getLogger("trainmon")

#: the tasks of local gradients (before reduction)
LOCAL_GRADIENT_TASKS = frozenset(tasks_of_prefix("grad_unreduced"))
#: collected steps an open incident goes without new records after which new ones start another
FRESH_AFTER = 10
#: collected steps without an abnormal value after which an incident is closed.
CLOSE_AFTER = 3
#: records kept in full per incident (the incidents file is rewritten at each step with news);
#: the rest are counted in ``more_records``.
MAX_RECORDS = 10_000
#: steps whose micro-batch ids an incident keeps (``step_batch_ids``): the file stays small when
#: records keep joining an incident for a long time.
MAX_BATCH_STEPS = 1_000
#: collected steps in a row whose gradients a loss scaler's skipped updates left unjudged, after
#: which they are judged again: a scale that finds no finite gradient for that long is a fault
MAX_UNJUDGED_STEPS = 20


@dataclass
class Incident:
    """Anomalies that started together: onset, root and evidence, what they touched, and state."""

    id: int
    rank: int
    onset_step: int
    onset_micro_step: int
    root: dict[str, Any]
    evidence: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    more_records: int = 0
    abnormal_steps: int = 1
    last_abnormal_step: int = -1
    state: str = "open"
    closed_step: int | None = None
    #: ids of the micro-batches where it began (``TrainerMon.set_batch_ids``): the onset
    #: micro-batch's when the root is per micro-batch, else every micro-batch of the step.
    batch_ids: list[dict[str, Any]] = field(default_factory=list)
    #: step -> the ids of each of its micro-batches, for the first MAX_BATCH_STEPS steps at which
    #: records kept in full joined (the onset's included): a record's micro-batch, by its step
    #: and micro_step.
    step_batch_ids: dict[int, list[Any]] = field(default_factory=dict)
    #: the run's number of ranks, where known (anomaly-analyse words the merged root's evidence by it)
    world_size: int | None = None
    #: whether local gradients (before reduction) were recorded at the onset step
    local_gradients_recorded: bool = True

    @property
    def tensors(self) -> int:
        """Distinct tags with a record (a tensor's series of one data type)."""
        return len({record["tag_name"] for record in self.records})

    @property
    def distinct_tensors(self) -> int:
        """Distinct tensors with a record: a parameter counts once over its data types."""
        return len({split_tag(str(record["tag_name"]))[:2] for record in self.records})

    @property
    def data_types(self) -> dict[str, int]:
        """Records per data type."""
        return dict(Counter(record.get("prefix", "") for record in self.records))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rank": self.rank,
            "ranks": [self.rank],
            "world_size": self.world_size,
            "local_gradients_recorded": self.local_gradients_recorded,
            "onset_step": self.onset_step,
            "onset_micro_step": self.onset_micro_step,
            "state": self.state,
            "last_abnormal_step": self.last_abnormal_step,
            "closed_step": self.closed_step,
            "abnormal_steps": self.abnormal_steps,
            "tensors": self.tensors,
            "data_types": self.data_types,
            "root": self.root,
            "evidence": self.evidence,
            "records": self.records,
            "more_records": self.more_records,
            "batch_ids": self.batch_ids,
            "step_batch_ids": {str(step): ids for step, ids in sorted(self.step_batch_ids.items())},
        }

    def __repr__(self) -> str:
        """One line (the records, possibly thousands, are in ``records`` and ``to_json()``)."""
        return (
            f"Incident({self.id}, step {self.onset_step}, rank {self.rank}, {self.state}, "
            f"{describe_root(self.root)}, {len(self.records) + self.more_records} records)"
        )

    def announcement(self) -> str:
        """The one console line of a new incident."""
        return (
            f"trainmon: incident {self.id} at step {self.onset_step} on rank {self.rank}: "
            f"{describe_root(self.root)}; {self.distinct_tensors} tensor(s) abnormal in "
            f"{len(self.data_types)} data type(s) ({self.tensors} series); {'; '.join(self.evidence[1:])}"
        ).rstrip("; ")


def onset_batches(root: dict[str, Any], step_ids: list[Any]) -> list[dict[str, Any]]:
    """The micro-batches an incident began in: the root's own when its row is per micro-batch
    (``name:m``), else every micro-batch of the step (a conservative list to skip)."""
    parsed = parse_tag(str(root.get("tag_name", "")))
    micro = parsed.row.micro_step if parsed is not None else -1
    if 0 <= micro < len(step_ids):
        return [{"micro_step": micro, "ids": step_ids[micro]}]
    return [{"micro_step": index, "ids": ids} for index, ids in enumerate(step_ids)]


class IncidentTracker:
    """Turns each step's abnormal cells into records and incidents (one rank)."""

    def __init__(
        self, rank: int, close_after: int = CLOSE_AFTER, first_id: int = 1, world_size: int | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.close_after = close_after
        self.incidents: list[Incident] = []
        #: the open incident new records join, and those opened before it that are still open
        self.open: Incident | None = None
        self._earlier: list[Incident] = []
        #: collected steps since the open incident last got a new record
        self._since_news = 0
        #: the number the next incident gets (a restarted collection of the run goes on from it)
        self.next_id = first_id
        self._quiet = 0
        #: tags abnormal at the last collected step that had them (by a rule or non-finite), and
        #: at this one; those of ``_before`` this step has rows for, abnormal or not
        self._before: set[str] = set()
        self._now: set[str] = set()
        self._present: set[str] = set()
        self._recorded: set[str] = set()
        self._new: list[Anomaly] = []
        #: the tasks (``acc_grad``, ``post_grad``, ...) judged at this step
        self._tasks: set[str | None] = set()
        self._last_step: int | None = None
        self.changed = False

    def observe(self, verdicts: Verdicts) -> list[Anomaly]:
        """One record's abnormal cells; returns those that become records (first per tag).

        A tag abnormal at the last step that had it (by a rule or non-finite: a spike that turns
        into NaN is one event) adds no record: a micro-step's row that a shorter step lacks (the
        last step of an epoch) keeps its state while the incident is open. Python work is per
        abnormal tag, not per cell, and an Anomaly is built only for a new record: a NaN that
        makes every statistic of every tag NaN costs a few set lookups per row and step.
        """
        tags = verdicts.record.rows.tags
        self._tasks.add(task_of_tags(tags))
        if self._before:
            self._present.update(self._before.intersection(tags))
        if not len(verdicts):
            return []
        _, first = np.unique(verdicts.rows, return_index=True)
        new = []
        for i in np.sort(first):
            tag = tags[verdicts.rows[i]]
            self._now.add(tag)
            if tag in self._before or tag in self._recorded:
                continue
            self._recorded.add(tag)
            new.append(verdicts.anomaly(int(i)))
        self._new += new
        return new

    @property
    def has_abnormal(self) -> bool:
        """Whether any value of the current step so far is abnormal (new or not: a NaN that
        stays is abnormal at every step)."""
        return bool(self._now)

    def end_step(
        self, step: int, step_ids: list[Any] | None = None
    ) -> tuple[Incident | None, list[Incident]]:
        """Close the step: ``(incident opened or None, incidents closed)`` at this step.
        ``step_ids``: the ids of each micro-batch of the step, where the loop named them."""
        self._last_step = step
        new, abnormal, local = self._new, bool(self._now), bool(LOCAL_GRADIENT_TASKS & self._tasks)
        self._before = (self._before - self._present) | self._now
        self._now, self._present, self._recorded, self._new, self._tasks = set(), set(), set(), [], set()
        if new and self.open is not None and self._since_news >= FRESH_AFTER:
            self._earlier.append(self.open)  # stays open; what is new now is a fault of its own
            self.open = None
        if self.open is None and new:
            opened = self.open = self._start(step, new, local)
            self._since_news = 0
            if step_ids:
                opened.batch_ids = onset_batches(opened.root, step_ids)
                opened.step_batch_ids[step] = step_ids
            self.incidents.append(opened)
            self.changed = True
            return opened, []
        incident = self.open
        if incident is None:
            return None, []
        self._since_news = 0 if new else self._since_news + 1
        if new:
            room = max(MAX_RECORDS - len(incident.records), 0)
            incident.records += [cell.details() for cell in new[:room]]
            incident.more_records += len(new) - min(room, len(new))
            if step_ids and room and len(incident.step_batch_ids) < MAX_BATCH_STEPS:
                incident.step_batch_ids[step] = step_ids
            self.changed = True
        if abnormal:
            self._quiet = 0
            for each in (*self._earlier, incident):
                if each.last_abnormal_step != step:
                    each.abnormal_steps += 1
                    each.last_abnormal_step = step
                    self.changed = True
            return None, []
        self._quiet += 1
        if self._quiet < self.close_after:
            return None, []
        self._before = set()  # a tag without rows since is judged afresh when it returns
        return None, self._close_all(step)

    def finish(self) -> list[Incident]:
        """The end of monitoring: open incidents whose values were back to normal at the last
        step are closed there (ones still abnormal at the last step stay open); returns them."""
        if self.open is None or self._quiet == 0 or self._last_step is None:
            return []
        return self._close_all(self._last_step)

    def _close_all(self, step: int) -> list[Incident]:
        closed = [*self._earlier, self.open]
        for incident in closed:
            incident.state, incident.closed_step = "closed", step
        self.open, self._earlier, self.changed = None, [], True
        return closed

    def _start(self, step: int, new: list[Anomaly], local_recorded: bool) -> Incident:
        records = [cell.details() for cell in new]
        root, evidence = choose_root(records, self.world_size, local_recorded)
        micro = min((r["micro_step"] for r in records if phase_of(r) == phase_of(root)), default=0)
        incident = Incident(
            id=self.next_id,
            rank=self.rank,
            onset_step=step,
            onset_micro_step=int(micro),
            root=dict(root),
            evidence=evidence,
            records=records,
            last_abnormal_step=step,
            world_size=self.world_size,
            local_gradients_recorded=local_recorded,
        )
        self.next_id += 1
        self._quiet = 0
        return incident


class AnomalySink:
    """Writer-thread sink: detector -> records and incidents -> console and the anomaly files.

    Args:
        detector: evaluates each record's cells.
        dump: the rank's anomaly files (anomaly.json, incidents.json), or None without ``alert.dump``.
        keep: list that receives every record (``TrainerMon.anomalies``).
        world_size: the run's number of ranks, None where unknown (for the incidents' evidence).
    """

    def __init__(
        self,
        detector: Detector,
        dump: Any | None = None,
        keep: list[Anomaly] | None = None,
        world_size: int | None = None,
    ) -> None:
        self.detector = detector
        first_id = dump.next_incident_id if dump else 1
        self.tracker = IncidentTracker(detector.rank, first_id=first_id, world_size=world_size)
        self.dump = dump
        self.found: list[Anomaly] = keep if keep is not None else []
        #: called with each new incident (the alerts); its failures are logged, never raised.
        self.on_open: Callable[[Incident], None] | None = None
        #: step -> ids of each of its micro-batches, until the step ends.
        self._batch_ids: dict[int, list[Any]] = {}
        #: records whose verdict comes when their step returns, held until it ends
        self._held: list[Any] = []
        #: steps in a row whose gradients were left unjudged, and the last of them
        self._unjudged = (0, -1)

    def note_batch_ids(self, step: int, step_ids: list[Any]) -> None:
        """The ids of each micro-batch of ``step`` (handed over before the step ends)."""
        self._batch_ids[step] = step_ids

    def write(self, record: Any) -> None:
        if getattr(record.judged, "settled", True) is False:  # said when its step returns
            self._held.append(record)
            return
        self._observe(record)

    def _observe(self, record: Any) -> None:
        """Judge a record (its verdict settled, or never to be: then judged) and keep what is new."""
        if not self._judged(record):
            return
        new = self.tracker.observe(self.detector.judge(record))
        if new:
            self.found.extend(new)
            if self.dump is not None:
                self.dump.add(new)

    def _judged(self, record: Any) -> bool:
        """Whether the rules judge a record: as it says, except that gradients a loss scaler's
        skipped updates left unjudged ``MAX_UNJUDGED_STEPS`` steps in a row are judged again."""
        if record.judged_now():
            if record.prefix in SCALED_PREFIXES:
                self._unjudged = (0, -1)
            return True
        count, last = self._unjudged
        if record.step != last:
            self._unjudged = count, last = count + 1, record.step
        return count > MAX_UNJUDGED_STEPS

    def end_step(self, step: int) -> None:
        held, self._held = self._held, []
        for record in held:  # their step ended: its verdict is settled, or never will be (it raised)
            if record.step <= step:
                self._observe(record)
            else:
                self._held.append(record)
        step_ids = self._batch_ids.pop(step, None)
        self._batch_ids = {s: ids for s, ids in self._batch_ids.items() if s > step}
        opened, closed_now = self.tracker.end_step(step, step_ids)
        if opened is not None:
            logger.warning("%s", opened.announcement())
            if self.on_open is not None:
                try:
                    self.on_open(opened)
                except Exception as exc:
                    logger.error("trainmon: handing incident %d to the alerts failed (%r)", opened.id, exc)
        for closed in closed_now:
            logger.info(
                "trainmon: incident %d closed at step %d (abnormal at %d step(s), %d record(s))",
                closed.id,
                step,
                closed.abnormal_steps,
                len(closed.records) + closed.more_records,
            )
        if self.tracker.changed:
            self.tracker.changed = False
            self._to_dump("set_incidents", self.tracker.incidents)
        self._to_dump("end_step", step)

    def close(self) -> None:
        held, self._held = self._held, []
        for record in held:  # steps that never ended (a step raised): judged
            self._observe(record)
        if self.tracker.finish() or self.tracker.changed:
            self.tracker.changed = False
            self._to_dump("set_incidents", self.tracker.incidents)
        self._to_dump("close")

    def _to_dump(self, method: str, *args: Any) -> None:
        """The anomaly files are an output of their own: when writing fails, only they are switched off."""
        if self.dump is None:
            return
        try:
            getattr(self.dump, method)(*args)
        except Exception as exc:
            self.dump = None
            logger.error(
                "trainmon: writing the anomaly files failed (%r); they are switched off, detection goes on",
                exc,
            )
