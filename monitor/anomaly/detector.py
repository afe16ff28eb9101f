"""Vectorised anomaly detection over StepRecords, and the writer-thread sink that reports it.

For each data type the detector keeps a Baseline whose rows are tags; a step's record is
evaluated with numpy over all (tag, op) cells at once. The first rule (in config order) that
flags a cell reports it. The history can be saved and restored (``state_dict`` /
``load_state_dict``), so a resumed job keeps its baselines.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from monitor.record import RowSet, StepRecord

logger = logging.getLogger("trainmon")

#: anomaly lines printed per step before the rest are only counted.
MAX_LINES_PER_STEP = 20
_YELLOW, _RESET = "\033[93m", "\033[0m"
#: layout version of Detector.state_dict().
STATE_VERSION = 1


@dataclass
class Anomaly:
    """One flagged value; serialises to the reference's anomaly.json record plus op/value/rule."""

    rank: int
    step: int
    micro_step: int
    pp_stage: int
    vpp_stage: int
    call_id: int
    tag_name: str
    op: str
    value: float
    baseline: float
    rule: str
    message: str
    group_mates: list[int]

    @property
    def key(self) -> str:
        """anomaly.json key; includes the op so that no record overwrites another (spec W22)."""
        return f"{self.tag_name}_{self.op}_step_{self.step}_call_{self.call_id}"

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("value", "baseline"):
            if not np.isfinite(record[name]):
                record[name] = str(record[name])  # JSON has no NaN/Inf literals
        return record


class Detector:
    """Rules plus per-data-type baselines; ``evaluate`` returns the anomalies of one record."""

    def __init__(
        self, rules: list, rank: int, pp_stage: int = 0, group_mates: list[int] | None = None
    ) -> None:
        self.rules = rules
        self.rank = rank
        self.pp_stage = pp_stage
        self.group_mates = list(group_mates) if group_mates is not None else [rank]
        self._rows: dict[str, dict[str, int]] = {}
        #: per (data type, ops): one state (dict of arrays, rows = tags) per rule.
        self._states: dict[tuple[str, tuple[str, ...]], list[dict[str, np.ndarray]]] = {}
        self._index_cache: dict[str, tuple[RowSet, np.ndarray]] = {}

    def _index(self, prefix: str, rows: RowSet) -> np.ndarray:
        cached = self._index_cache.get(prefix)
        if cached is not None and cached[0] is rows:
            return cached[1]
        table = self._rows.setdefault(prefix, {})
        index = np.fromiter(
            (table.setdefault(tag, len(table)) for tag in rows.tags), dtype=np.int64, count=len(rows)
        )
        if len(index) == len(table) and np.array_equal(index, np.arange(len(index))):
            index = None  # every tag of the table, in table order: the state arrays are used as they are
        self._index_cache[prefix] = (rows, index)
        return index

    def evaluate(self, record: StepRecord) -> list[Anomaly]:
        """Evaluate every rule on every (tag, op) of the record and update the baselines."""
        if not self.rules or len(record.rows) == 0:
            return []
        values = record.resolve()
        index = self._index(record.prefix, record.rows)
        if index is None and len(self._rows[record.prefix]) != len(record.rows):
            index = np.arange(len(record.rows))  # the table grew since: no longer the whole state
        states = self._grown_states(record.prefix, record.ops)
        reported = None
        found: list[Anomaly] = []
        for rule, state in zip(self.rules, states):
            # a rule sees only the columns it judges (AnomalyZScore: norm alone, 1 of 6)
            cols = _columns(rule, record.ops)
            ops = record.ops if cols is None else tuple(record.ops[c] for c in cols)
            view = values if cols is None else values[:, cols]
            if index is None:
                rows = state if cols is None else {name: array[:, cols] for name, array in state.items()}
            else:
                where = index if cols is None else np.ix_(index, cols)
                rows = {name: array[where] for name, array in state.items()}
            mask, baseline = rule.apply(view, rows, ops)
            if reported is not None:
                mask &= ~(reported if cols is None else reported[:, cols])
            if mask.any():
                if reported is None:
                    reported = np.zeros(values.shape, dtype=bool)
                for row, col in zip(*np.nonzero(mask)):
                    column = int(col) if cols is None else int(cols[col])
                    reported[row, column] = True
                    base = float(baseline[row, col])
                    found.append(self._anomaly(record, int(row), column, rule.name, base))
            for name, array in rule.update(view, rows).items():
                if index is None and cols is None:
                    state[name] = array
                elif index is None:
                    state[name][:, cols] = array
                else:
                    state[name][where] = array
        return found

    def _grown_states(self, prefix: str, ops: tuple[str, ...]) -> list[dict[str, np.ndarray]]:
        """The rules' state arrays for a data type, with a row for every tag seen so far."""
        states = self._states.get((prefix, ops))
        if states is None:
            states = [{name: np.zeros((0, len(ops))) for name in rule.fields} for rule in self.rules]
            self._states[(prefix, ops)] = states
        rows = len(self._rows[prefix])
        for rule, state in zip(self.rules, states):
            for name, fill in rule.fields.items():
                extra = rows - state[name].shape[0]
                if extra > 0:
                    state[name] = np.vstack([state[name], np.full((extra, len(ops)), fill)])
        return states

    def _anomaly(self, record: StepRecord, row: int, col: int, rule: str, base: float) -> Anomaly:
        tag, op = record.rows.tags[row], record.ops[col]
        value = float(record.values[row, col])
        micro = record.rows.micro_steps[row] if record.rows.micro_steps is not None else 0
        call_id = int(record.call_ids[row]) if record.call_ids is not None else -1
        message = (
            f"Rule {rule} reports anomaly signal in ('{tag}', '{op}') at step {record.step}, "
            f"current value {value:.6g}, history mean {base:.6g}."
        )
        return Anomaly(
            rank=self.rank,
            step=record.step,
            micro_step=micro,
            pp_stage=self.pp_stage,
            vpp_stage=record.rows.vpp_stages[row],
            call_id=call_id,
            tag_name=tag,
            op=op,
            value=value,
            baseline=base,
            rule=rule,
            message=message,
            group_mates=self.group_mates,
        )

    def state_dict(self) -> dict[str, Any]:
        """The detector's history as plain Python data (dicts, lists, str, float; NaN/Inf kept).

        Holds the rules' identities, every data type's tag table (tag -> row, in row order) and
        each rule's state arrays per (data type, ops). Safe for pickle/``torch.save`` and for
        ``json.dumps`` (NaN/Inf as its non-standard literals). The detector runs on the writer
        thread: take the state after ``flush()`` (or on that thread), not while records are queued.
        """
        return {
            "version": STATE_VERSION,
            "rules": rule_identities(self.rules),
            "tags": {prefix: list(table) for prefix, table in self._rows.items()},
            "baselines": [
                {
                    "prefix": prefix,
                    "ops": list(ops),
                    "states": [{name: array.tolist() for name, array in state.items()} for state in states],
                }
                for (prefix, ops), states in self._states.items()
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the detector's history by one from ``state_dict()`` (of a detector with the same rules).

        Raises:
            ValueError: the state is malformed, of another version, or was saved with other rules
                or rule arguments (the message shows both); the detector is then left unchanged.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"detector state: expected a mapping with version {STATE_VERSION}, got {found!r}"
            )
        saved, configured = state.get("rules"), rule_identities(self.rules)
        if saved != configured:
            raise ValueError(
                f"detector state: saved with other anomaly rules; saved {saved!r}, configured {configured!r}"
            )
        try:
            rows = {
                str(prefix): {str(tag): i for i, tag in enumerate(tags)}
                for prefix, tags in state["tags"].items()
            }
            states = {}
            for entry in state["baselines"]:
                prefix, ops = str(entry["prefix"]), tuple(str(op) for op in entry["ops"])
                states[(prefix, ops)] = [
                    _state_arrays(rule, saved_state, len(rows[prefix]), len(ops))
                    for rule, saved_state in zip(self.rules, entry["states"], strict=True)
                ]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"detector state: malformed ({type(exc).__name__}: {exc})") from None
        self._rows, self._states, self._index_cache = rows, states, {}


def _columns(rule: Any, ops: tuple[str, ...]) -> np.ndarray | None:
    """The columns a rule judges (its ``ops``), or None for all of them."""
    judged = getattr(rule, "ops", None)
    if judged is None or all(op in judged for op in ops):
        return None
    return np.array([i for i, op in enumerate(ops) if op in judged], dtype=np.int64)


def rule_identities(rules: list) -> list[dict[str, Any]]:
    """Each rule's class and parameters as plain data, to tell whether a saved state fits."""

    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    return [
        {"rule": type(rule).__name__, "args": {k: plain(v) for k, v in sorted(vars(rule).items())}}
        for rule in rules
    ]


def _state_arrays(rule: Any, saved: Mapping[str, Any], tags: int, ops: int) -> dict[str, np.ndarray]:
    """One rule's saved arrays, checked against its fields and the tag table."""
    if set(saved) != set(rule.fields):
        raise ValueError(
            f"{type(rule).__name__} state has fields {sorted(saved)}, expected {sorted(rule.fields)}"
        )
    arrays = {}
    for name in rule.fields:
        array = np.array(saved[name], dtype=np.float64)
        if array.size == 0:
            array = array.reshape(0, ops)
        if array.ndim != 2 or array.shape[1] != ops or array.shape[0] > tags:
            raise ValueError(
                f"{type(rule).__name__}.{name} has shape {array.shape}, expected (<= {tags}, {ops})"
            )
        arrays[name] = array
    return arrays


class AnomalySink:
    """Writer-thread sink: runs the detector, prints at most 20 lines a step, feeds the dump."""

    def __init__(
        self, detector: Detector, dump: Any | None = None, keep: list[Anomaly] | None = None
    ) -> None:
        self.detector = detector
        self.dump = dump
        self.found: list[Anomaly] = keep if keep is not None else []
        self._printed = 0
        self._unprinted = 0

    def write(self, record: StepRecord) -> None:
        anomalies = self.detector.evaluate(record)
        for anomaly in anomalies:
            if self._printed < MAX_LINES_PER_STEP:
                logger.warning("%s> %s%s", _YELLOW, anomaly.message, _RESET)
                self._printed += 1
            else:
                self._unprinted += 1
        if anomalies:
            self.found.extend(anomalies)
            if self.dump is not None:
                self.dump.add(anomalies)

    def end_step(self, step: int) -> None:
        if self._unprinted:
            logger.warning("> ... and %d more anomalies at step %d (see anomaly.json)", self._unprinted, step)
        self._printed = self._unprinted = 0
        self._to_dump("end_step", step)

    def close(self) -> None:
        self._to_dump("close")

    def _to_dump(self, method: str, *args: int) -> None:
        """anomaly.json is an output of its own: when writing it fails, only the dump is switched off."""
        if self.dump is None:
            return
        try:
            getattr(self.dump, method)(*args)
        except Exception as exc:
            self.dump = None
            logger.error(
                "trainmon: writing anomaly.json failed (%r); the anomaly dump is switched off, "
                "detection goes on",
                exc,
            )
