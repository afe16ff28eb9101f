"""Vectorised anomaly detection over StepRecords: which (tag, op) cells are abnormal at a step.

For each data type the detector keeps a Baseline whose rows are tags; a step's record is
evaluated with numpy over all (tag, op) cells at once. Non-finite values come first (on by
default, whatever the rules: a NaN or Inf statistic, or a NaN count above zero, is rule
``NonFinite``); then the first rule (in config order) that flags a cell reports it; then, when
a data type's norms moved together (clipping, loss scaling) and were flagged, the one norm that
moved against that common move is reported as ``MovedAlone``. Every
abnormal cell of every step is returned: which of them become records, and how they group into
incidents, is decided by :mod:`monitor.anomaly.incidents`.

Besides the rules' baselines the detector keeps one level per cell (an EMA of log|value|), from
which each anomaly gets its ``ratio`` to that level and the ``common`` ratio of its column (the
median over every row of the data type): when clipping or loss scaling moves every gradient by
the same factor, the one tensor that moved differently stands out (:mod:`monitor.anomaly.root`).
The history can be saved and restored (``state_dict`` / ``load_state_dict``), so a resumed job
keeps its baselines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from monitor.anomaly.root import ALONE_FACTOR
from monitor.anomaly.rules import COUNT_OPS, MOVED_ALONE, NONFINITE
from monitor.record import RowSet, StepRecord

#: layout version of Detector.state_dict().
STATE_VERSION = 1
#: the fields of msprobe's anomaly record, in its order: anomaly.json holds exactly these, so
#: msprobe's own analyser reads our files (it builds its record class from them and rejects others).
REFERENCE_FIELDS = (
    "rank",
    "step",
    "micro_step",
    "pp_stage",
    "vpp_stage",
    "call_id",
    "tag_name",
    "message",
    "group_mates",
)
#: smoothing of the per-cell level (EMA of log|value|) the ratios are measured against.
LEVEL_BETA = 0.9


@dataclass
class Anomaly:
    """One abnormal value.

    ``to_json`` is msprobe's anomaly.json record; ``details`` adds what that format has no room
    for (op, value, baseline, rule, data type, ratio to the cell's level and the column's common
    ratio) and goes to the incidents file.
    """

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
    prefix: str = ""
    ratio: float = math.nan
    common: float = math.nan

    @property
    def key(self) -> str:
        """anomaly.json key; includes the op so that no record overwrites another (msprobe's omits it)."""
        return f"{self.tag_name}_{self.op}_step_{self.step}_call_{self.call_id}"

    def to_json(self) -> dict[str, Any]:
        """msprobe's record: exactly its fields (op, rule, value and baseline are in the message)."""
        record = asdict(self)
        return {name: record[name] for name in REFERENCE_FIELDS}

    def details(self) -> dict[str, Any]:
        """Every field, non-finite numbers as strings (JSON has no NaN/Inf literals)."""
        record = asdict(self)
        record["key"] = self.key
        for name in ("value", "baseline", "ratio", "common"):
            if not math.isfinite(record[name]):
                record[name] = str(record[name])
        return record


class Detector:
    """Rules plus per-data-type baselines; ``evaluate`` returns the anomalies of one record."""

    def __init__(
        self,
        rules: list,
        rank: int,
        pp_stage: int = 0,
        group_mates: list[int] | None = None,
        non_finite: bool = True,
        moved_alone: bool = True,
    ) -> None:
        self.rules = rules
        self.non_finite = non_finite
        self.moved_alone = moved_alone
        self.rank = rank
        self.pp_stage = pp_stage
        self.group_mates = list(group_mates) if group_mates is not None else [rank]
        self._rows: dict[str, dict[str, int]] = {}
        #: per (data type, ops): one state (dict of arrays, rows = tags) per rule.
        self._states: dict[tuple[str, tuple[str, ...]], list[dict[str, np.ndarray]]] = {}
        self._index_cache: dict[str, tuple[RowSet, np.ndarray]] = {}
        #: per (data type, ops): EMA of log|value| and how many finite values it holds, per cell.
        self._levels: dict[tuple[str, tuple[str, ...]], tuple[np.ndarray, np.ndarray]] = {}

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
        """Every abnormal cell of the record (non-finite first, then the rules); updates the baselines."""
        if not (self.rules or self.non_finite) or len(record.rows) == 0:
            return []
        values = record.resolve()
        index = self._index(record.prefix, record.rows)
        if index is None and len(self._rows[record.prefix]) != len(record.rows):
            index = np.arange(len(record.rows))  # the table grew since: no longer the whole state
        states = self._grown_states(record.prefix, record.ops)
        logs, level_rows = self._levels_of(record, values, index)
        scale = _element_scale(values, record.ops)
        reported = None
        hits: list[tuple[int, int, str, float]] = []
        if self.non_finite:
            counts = np.array([op in COUNT_OPS for op in record.ops], dtype=bool)[None, :]
            with np.errstate(invalid="ignore"):
                reported = ~np.isfinite(values) | (counts & (values > 0))
            hits += [(int(r), int(c), NONFINITE, math.nan) for r, c in zip(*np.nonzero(reported))]
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
            if getattr(rule, "uses_scale", False):
                mask, baseline = rule.apply(view, rows, ops, scale=scale)
            else:
                mask, baseline = rule.apply(view, rows, ops)
            if reported is not None:
                mask &= ~(reported if cols is None else reported[:, cols])
            if mask.any():
                if reported is None:
                    reported = np.zeros(values.shape, dtype=bool)
                for row, col in zip(*np.nonzero(mask)):
                    column = int(col) if cols is None else int(cols[col])
                    reported[row, column] = True
                    hits.append((int(row), column, rule.name, float(baseline[row, col])))
            for name, array in rule.update(view, rows).items():
                if index is None and cols is None:
                    state[name] = array
                elif index is None:
                    state[name][:, cols] = array
                else:
                    state[name][where] = array
        if self.moved_alone:
            hits += _moved_alone(logs, level_rows, hits, record.ops)
        ratios = self._ratios(logs, level_rows, hits)
        self._update_levels(record, logs, level_rows, index)
        return [
            self._anomaly(record, row, col, rule, base, *ratios[(row, col)]) for row, col, rule, base in hits
        ]

    # -- levels: how far each value is from where its cell was, and from its column's common move

    def _levels_of(
        self, record: StepRecord, values: np.ndarray, index: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """log|values| and the record rows' (level, count) arrays, grown to the tag table."""
        key = (record.prefix, record.ops)
        rows = len(self._rows[record.prefix])
        level, count = self._levels.get(key, (np.zeros((0, len(record.ops))), np.zeros((0, len(record.ops)))))
        if level.shape[0] < rows:
            extra = np.zeros((rows - level.shape[0], len(record.ops)))
            level, count = np.vstack([level, extra]), np.vstack([count, extra])
            self._levels[key] = (level, count)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log(np.abs(values))
        if index is None:
            return logs, (level, count)
        return logs, (level[index], count[index])

    @staticmethod
    def _ratios(
        logs: np.ndarray, level_rows: tuple[np.ndarray, np.ndarray], hits: list
    ) -> dict[tuple[int, int], tuple[float, float]]:
        """(ratio to the cell's level, common ratio of its column) for each hit; NaN where unknown."""
        if not hits:
            return {}
        level, count = level_rows
        with np.errstate(invalid="ignore"):
            moves = np.where((count > 0) & np.isfinite(logs), logs - level, np.nan)
        common: dict[int, float] = {}
        result = {}
        for row, col, _, _ in hits:
            if col not in common:
                column = moves[:, col]
                known = column[np.isfinite(column)]
                common[col] = math.exp(float(np.median(known))) if known.size >= 3 else math.nan
            move = moves[row, col]
            result[(row, col)] = (math.exp(move) if math.isfinite(move) else math.nan, common[col])
        return result

    def _update_levels(
        self,
        record: StepRecord,
        logs: np.ndarray,
        level_rows: tuple[np.ndarray, np.ndarray],
        index: np.ndarray | None,
    ) -> None:
        level, count = level_rows
        finite = np.isfinite(logs)
        blended = np.where(count > 0, LEVEL_BETA * level + (1.0 - LEVEL_BETA) * logs, logs)
        new_level, new_count = np.where(finite, blended, level), count + finite
        if index is None:
            self._levels[(record.prefix, record.ops)] = (new_level, new_count)
        else:
            full_level, full_count = self._levels[(record.prefix, record.ops)]
            full_level[index], full_count[index] = new_level, new_count

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

    def _anomaly(
        self, record: StepRecord, row: int, col: int, rule: str, base: float, ratio: float, common: float
    ) -> Anomaly:
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
            prefix=record.prefix,
            ratio=ratio,
            common=common,
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
        self._rows, self._states, self._index_cache, self._levels = rows, states, {}, {}


def _moved_alone(
    logs: np.ndarray, level_rows: tuple[np.ndarray, np.ndarray], hits: list, ops: tuple[str, ...]
) -> list[tuple[int, int, str, float]]:
    """The ``norm`` cell that moved against its data type's common move, when that common move
    (the median over every row) is at least ALONE_FACTOR and was flagged somewhere: clipping or
    loss scaling then moved every tensor alike, and the tensor that caused it may itself look
    ordinary (clipped back to the usual size) while every other one is flagged."""
    if "norm" not in ops or not hits:
        return []
    col = ops.index("norm")
    flagged = {row for row, c, _, _ in hits if c == col}
    if not flagged:
        return []
    level, count = level_rows
    with np.errstate(invalid="ignore"):
        moves = np.where(
            (count[:, col] > 0) & np.isfinite(logs[:, col]), logs[:, col] - level[:, col], np.nan
        )
    known = np.flatnonzero(np.isfinite(moves))
    if known.size < 3:
        return []
    common = float(np.median(moves[known]))
    limit = math.log(ALONE_FACTOR)
    if abs(common) < limit:
        return []
    excess = np.abs(moves[known] - common)
    order = np.argsort(excess)[::-1]
    best, runner_up = excess[order[0]], excess[order[1]]
    row = int(known[order[0]])
    if best < limit or best - runner_up < limit or row in flagged:
        return []
    return [(row, col, MOVED_ALONE, math.exp(float(level[row, col])))]


def _element_scale(values: np.ndarray, ops: tuple[str, ...]) -> np.ndarray | None:
    """Each row's element scale ``max(|min|, |max|)`` when both ops are recorded, else None."""
    if "min" not in ops or "max" not in ops:
        return None
    with np.errstate(invalid="ignore"):
        return np.maximum(np.abs(values[:, ops.index("min")]), np.abs(values[:, ops.index("max")]))


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
