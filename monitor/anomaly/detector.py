"""Vectorised anomaly detection over StepRecords: which (tag, op) cells are abnormal at a step.

For each data type the detector keeps a Baseline whose rows are tags; a step's record is
evaluated with numpy over all (tag, op) cells at once. Non-finite values come first (on by
default, whatever the rules: a NaN or Inf statistic, or a NaN count above zero, is rule
``NonFinite``); then the first rule (in config order) that flags a cell reports it; then, when
the reduced gradients' norms fell together (clipping) and were flagged, the one norm that moved
against that common move is reported as ``MovedAlone``. Every abnormal cell of every step
is returned: which become records, and how they group into incidents, is decided by
:mod:`monitor.anomaly.incidents`.

Besides the rules' baselines the detector keeps one level per norm (an EMA of log|norm|, a value
flagged after an unflagged one left out), from
which each anomaly gets its ``ratio`` to that level and the ``common`` ratio of its column (the
median over every row of the data type, where at least three rows and half of them lie within a
factor 2 of it; else none): when clipping or loss scaling moves every gradient by
the same factor, the one tensor that moved differently stands out (:mod:`monitor.anomaly.root`).
The history can be saved and restored (``state_dict`` / ``load_state_dict``), so a resumed job
keeps its baselines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from monitor.anomaly.detector_state import (
    STATE_VERSION,
    rule_identities,
    same_rules,
    saved_levels,
    state_arrays,
)
from monitor.anomaly.moves import common_move, is_rescaled, moved_alone
from monitor.anomaly.rules import MOVED_ALONE, NONFINITE, non_finite_cells
from monitor.anomaly.verdicts import REFERENCE_FIELDS, Anomaly, Verdicts
from monitor.record import RowSet, StepRecord

__all__ = ["NONFINITE", "NONFINITE_ID", "REFERENCE_FIELDS", "Anomaly", "Detector", "Verdicts"]

NONFINITE_ID, MOVED_ALONE_ID, FIRST_RULE_ID = 0, 1, 2
#: records whose "norm" column holds a share in [0, 1] (mg_direction's of gradient signs that agree
#: with exp_avg): 0 is an ordinary value of a tensor of a few elements, not a norm that vanished
SHARE_PREFIXES = frozenset({"other"})

#: smoothing of the per-tag level of the norms (EMA of log|norm|) the ratios are measured against.
LEVEL_BETA = 0.9


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
        #: what a Verdicts' rule ids index: the detector's own verdicts, then the rules in order.
        self.rule_names = (NONFINITE, MOVED_ALONE, *(rule.name for rule in rules))
        self._rows: dict[str, dict[str, int]] = {}
        #: per (data type, ops): one state (dict of arrays, rows = tags) per rule.
        self._states: dict[tuple[str, tuple[str, ...]], list[dict[str, np.ndarray]]] = {}
        self._index_cache: dict[str, tuple[RowSet, np.ndarray]] = {}
        #: per data type: EMA of log|norm| and how many finite norms it holds, per tag.
        self._levels: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        #: per data type, the tags whose latest norm was flagged
        self._flagged_last: dict[str, np.ndarray] = {}

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
        """Every abnormal cell of the record as an Anomaly (see ``judge``)."""
        return self.judge(record).anomalies()

    def judge(self, record: StepRecord) -> Verdicts:
        """Every abnormal cell of the record (non-finite first, then the rules, then MovedAlone);
        updates the baselines."""
        if not (self.rules or self.non_finite) or len(record.rows) == 0:
            return self._verdicts(record, [], [], [], [], None, math.nan)
        values = record.resolve()
        index = self._index(record.prefix, record.rows)
        if index is None and len(self._rows[record.prefix]) != len(record.rows):
            index = np.arange(len(record.rows))  # the table grew since: no longer the whole state
        states = self._grown_states(record.prefix, record.ops)
        #: rows no rule judges (integer inputs), as a column to mask cells with
        unjudged = None if record.rows.unjudged is None else np.asarray(record.rows.unjudged)[:, None]
        norms = self._norm_moves(record, values, index, unjudged)
        scale = _element_scale(values, record.ops)
        rows, cols, ids, baselines = [], [], [], []
        reported = np.zeros(values.shape, dtype=bool)
        share = record.prefix in SHARE_PREFIXES and "norm" in record.ops  # rows of a share of 0: unjudged
        shares_of_zero = values[:, record.ops.index("norm")] == 0 if share else None
        if self.non_finite:
            reported = non_finite_cells(values, record.ops)
            if unjudged is not None:  # an attention mask holds -inf by design
                reported &= ~unjudged
            if reported.any():
                row, col = np.nonzero(reported)
                rows.append(row), cols.append(col), ids.append(np.full(len(row), NONFINITE_ID))
                baselines.append(self._norm_levels(record, index, row, col))
        if not record.by_rules:  # NaN/Inf only: no rule, no history moves
            return self._verdicts(record, rows, cols, ids, baselines, None, math.nan)
        for number, (rule, state) in enumerate(zip(self.rules, states)):
            if record.prefix in SHARE_PREFIXES and not getattr(rule, "judges_shares", True):
                continue  # a rule of sizes on a share of signs (AnomalyZScore on mg_direction)
            # a rule sees only the columns it judges (AnomalyZScore: norm alone, 1 of 6)
            judged = _columns(rule, record.ops)
            ops = record.ops if judged is None else tuple(record.ops[c] for c in judged)
            view = values if judged is None else values[:, judged]
            if index is None:
                cells = state if judged is None else {name: array[:, judged] for name, array in state.items()}
            else:
                where = index if judged is None else np.ix_(index, judged)
                cells = {name: array[where] for name, array in state.items()}
            if getattr(rule, "uses_scale", False):
                mask, baseline = rule.apply(view, cells, ops, scale=scale)
            else:
                mask, baseline = rule.apply(view, cells, ops)
            verdicts = mask.copy() if getattr(rule, "learns_from_verdicts", False) else None
            mask &= ~(reported if judged is None else reported[:, judged])
            if shares_of_zero is not None:
                mask &= ~shares_of_zero[:, None]
            if unjudged is not None:
                mask &= ~unjudged
            if mask.any():
                row, col = np.nonzero(mask)
                column = col if judged is None else judged[col]
                reported[row, column] = True
                rows.append(row), cols.append(column), baselines.append(baseline[row, col])
                ids.append(np.full(len(row), FIRST_RULE_ID + number))
            updated = rule.update(view, cells) if verdicts is None else rule.update(view, cells, verdicts)
            for name, array in updated.items():
                if index is None and judged is None:
                    state[name] = array
                elif index is None:
                    state[name][:, judged] = array
                else:
                    state[name][where] = array
        common = math.nan
        if norms is not None and rows:
            norm = record.ops.index("norm")
            flagged = np.concatenate(rows)[np.concatenate(cols) == norm]
            common = common_move(norms[1]) if len(flagged) else math.nan
        if norms is not None and self.moved_alone and math.isfinite(common) and is_rescaled(record):
            alone = moved_alone(norms[1], common, flagged, self._levels[record.prefix][0], index)
            if alone is not None:
                reported[alone[0], norm] = True
                rows.append(np.array([alone[0]])), cols.append(np.array([norm]))
                baselines.append(np.array([alone[1]]))
                ids.append(np.array([MOVED_ALONE_ID]))
        if norms is not None:
            self._update_levels(record.prefix, norms[0], index, reported[:, record.ops.index("norm")])
        return self._verdicts(record, rows, cols, ids, baselines, norms, common)

    def _verdicts(
        self,
        record: StepRecord,
        rows: list[np.ndarray],
        cols: list[np.ndarray],
        ids: list[np.ndarray],
        baselines: list[np.ndarray],
        norms: tuple[np.ndarray, np.ndarray] | None,
        common: float,
    ) -> Verdicts:
        row = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        col = np.concatenate(cols).astype(np.int64) if cols else np.zeros(0, np.int64)
        ratios = np.full(len(row), np.nan)
        if norms is not None and len(row):
            on_norm = col == record.ops.index("norm")
            with np.errstate(over="ignore"):
                ratios[on_norm] = np.exp(norms[1][row[on_norm]])
        return Verdicts(
            record,
            row,
            col,
            np.concatenate(ids) if ids else np.zeros(0, np.int64),
            self.rule_names,
            np.concatenate(baselines) if baselines else np.zeros(0),
            ratios,
            math.exp(common) if math.isfinite(common) else math.nan,
            self.rank,
            self.pp_stage,
            self.group_mates,
        )

    # -- levels: how far each norm is from where it was, and from its data type's common move

    def _norm_moves(
        self, record: StepRecord, values: np.ndarray, index: np.ndarray | None, unjudged: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """log|norm| of the record's rows and each row's move from its level (NaN where unknown, and
        on ``unjudged`` rows); None without a ``norm`` op. Only norms have levels: a ratio of means
        or minima says little."""
        if "norm" not in record.ops:
            return None
        level, count = self._level_arrays(record.prefix)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log(np.abs(values[:, record.ops.index("norm")]))
        if index is not None:
            level, count = level[index], count[index]
        with np.errstate(invalid="ignore"):
            moves = np.where((count > 0) & np.isfinite(logs), logs - level, np.nan)
        if unjudged is not None:  # the data's rows move neither with nor against the rest
            moves[unjudged[:, 0]] = np.nan
        return logs, moves

    def _norm_levels(
        self, record: StepRecord, index: np.ndarray | None, row: np.ndarray, col: np.ndarray
    ) -> np.ndarray:
        """Baselines of non-finite cells: where the cell is a norm with a level, that level before
        this step (the tensor's typical norm, so a NaN record still says where it came from), else NaN."""
        baselines = np.full(len(row), np.nan)
        if "norm" not in record.ops:
            return baselines
        level, count = self._level_arrays(record.prefix)
        if index is not None:
            level, count = level[index], count[index]
        known = (col == record.ops.index("norm")) & (count[row] > 0)
        baselines[known] = np.exp(level[row[known]])
        return baselines

    def _level_arrays(self, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        """(level, count) of a data type's norms, grown to its tag table."""
        rows = len(self._rows[prefix])
        level, count = self._levels.get(prefix, (np.zeros(0), np.zeros(0)))
        if len(level) < rows:
            extra = np.zeros(rows - len(level))
            level, count = np.concatenate([level, extra]), np.concatenate([count, extra])
            self._levels[prefix] = (level, count)
        return level, count

    def _update_levels(
        self, prefix: str, logs: np.ndarray, index: np.ndarray | None, flagged: np.ndarray
    ) -> None:
        """Blend this step's log-norms into each tag's level, except one flagged after a value
        that was not: a spike taken into the level would understate the ratios (and common moves)
        of the steps after it, while a value flagged twice in a row enters (a level that moved
        for good, or a rule that flags for long stretches, must not freeze it)."""
        level, count = self._levels[prefix]
        before = self._flagged_last.get(prefix, np.zeros(0, dtype=bool))
        if len(before) < len(level):
            before = self._flagged_last[prefix] = np.concatenate(
                [before, np.zeros(len(level) - len(before), dtype=bool)]
            )
        where = slice(None) if index is None else index
        old_level, old_count = level[where], count[where]
        left_out = flagged & ~before[where]
        before[where] = flagged
        finite = np.isfinite(logs) & ~left_out
        blended = np.where(old_count > 0, LEVEL_BETA * old_level + (1.0 - LEVEL_BETA) * logs, logs)
        level[where] = np.where(finite, blended, old_level)
        count[where] = old_count + finite

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

    def state_dict(self) -> dict[str, Any]:
        """The detector's history as plain Python data (dicts, lists, str, float; NaN/Inf kept).

        Holds the rules' identities, every data type's tag table (tag -> row, in row order),
        each rule's state arrays per (data type, ops) and each tag's norm level (what the common
        move of a data type and a non-finite record's baseline are measured against). Safe for
        pickle/``torch.save`` and for ``json.dumps`` (NaN/Inf as its non-standard literals). The
        detector runs on the writer thread: take the state after ``flush()`` (or on that thread),
        not while records are queued.
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
            "levels": {
                prefix: {"level": level.tolist(), "count": count.tolist()}
                for prefix, (level, count) in self._levels.items()
            },
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
        if not same_rules(saved, self.rules):
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
                    state_arrays(rule, saved_state, len(rows[prefix]), len(ops))
                    for rule, saved_state in zip(self.rules, entry["states"], strict=True)
                ]
            levels = {  # absent in states saved before norm levels were kept: they start again
                str(prefix): saved_levels(saved, len(rows[prefix]))
                for prefix, saved in state.get("levels", {}).items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"detector state: malformed ({type(exc).__name__}: {exc})") from None
        self._rows, self._states, self._index_cache, self._levels = rows, states, {}, levels
        self._flagged_last = {}


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
