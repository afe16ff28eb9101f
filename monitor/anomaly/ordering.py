"""Anomaly records: parsing one decoded record, and their total, deterministic order.

The order fixes two flaws of msprobe's: unknown tasks sorted first, and no rank tie-break.

An anomaly that happens earlier in a training step is more likely to be a cause than an effect, so
records are ranked by when they were produced. The sort key is::

    (step, micro_step, stage, V, P, call_id, rank, tag_name, op, message)

* ``stage`` comes from the tag's task (its last ``/`` component): ``param_origin`` and the
  linear layers' spectral norms ``sr`` -> -1 (the parameters the step starts from); ``actv`` and
  the attention features ``qkt`` -> 0 (forward); ``actv_grad``, ``pre_grad``,
  ``acc_grad``, ``post_grad`` and communication tasks ``pre_N`` / ``post_N`` -> 1 (backward);
  ``exp_avg``, ``exp_avg_sq``, ``mg_direction``, ``param_updated`` -> 2 (optimizer); anything
  else -> 3, i.e. **after** every known stage (msprobe sorts unknown tasks first by
  accident, and puts the parameters a step starts from with the optimizer, after their effects).
  Unknown tasks rank after the step's micro-steps too.
* ``micro_step``: records of the whole step carry 0, yet those before its micro-steps
  (``param_origin``) rank before micro-step 0 and those after them (reduced gradients, the
  optimizer's, and local gradients summed over the step, whose tags name no micro-step) after
  the last one.
* ``(V, P)`` is ``(vpp_stage, pp_stage)`` for forward records and ``(-vpp_stage, -pp_stage)``
  otherwise: earlier pipeline stages run first in forward, later ones first in backward.
* ``call_id`` is the order in which the monitor computed the rows within the step **on one rank**
  (0, 1, 2, ...). It is only comparable within a rank; across ranks it is merely a heuristic that
  holds for replicas running the same program (e.g. data-parallel ranks).
* ``rank``, ``tag_name``, ``op`` and finally ``message`` break the remaining ties, so the order does
  not depend on the order in which files or records were read.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import count
from typing import Any

from monitor.naming import split_tag

PARAMETERS, FORWARD, BACKWARD, OPTIMIZER, UNKNOWN = -1, 0, 1, 2, 3
STAGE_NAMES = {
    PARAMETERS: "parameters",
    FORWARD: "forward",
    BACKWARD: "backward",
    OPTIMIZER: "optimizer",
    UNKNOWN: "unknown",
}
#: tasks of the whole step, measured after all its micro-steps: ranked after the last of them
_AFTER_MICRO_STEPS = frozenset({"post_grad", "exp_avg", "exp_avg_sq", "mg_direction", "param_updated"})
#: local gradients: per micro-batch with monitor_mbs_grad (the tag then names it), else the step's
#: sum, measured at its last micro-batch and so ranked after every micro-step's activations
_SUMMED_UNLESS_NAMED = frozenset({"acc_grad", "pre_grad"})
_LAST_MICRO = 1 << 62

#: task key (last component of a tag) -> stage.
TASK_STAGE: dict[str, int] = {
    "actv": FORWARD,
    "actv_grad": BACKWARD,
    "pre_grad": BACKWARD,
    "acc_grad": BACKWARD,
    "post_grad": BACKWARD,
    "exp_avg": OPTIMIZER,
    "exp_avg_sq": OPTIMIZER,
    "mg_direction": OPTIMIZER,
    "param_origin": PARAMETERS,
    "param_updated": OPTIMIZER,
    "comm": BACKWARD,
    # msprobe's later l2 features: attention's entropy and softmax max come from the forward's
    # queries and keys; a linear layer's spectral norm from the weight the step started from
    "qkt": FORWARD,
    "sr": PARAMETERS,
}
_COMM_TASK = re.compile(r"(?:pre|post)_\d+")
_OP_RE = re.compile(r", '([^']*)'\) at step ")
_RULE_RE = re.compile(r"Rule (\S+) reports")
_VALUE_RE = re.compile(r"current value ([^\s,]+), history mean ([^\s,]+?)\.?$")

_INT_ONLY = {int}

SortKey = tuple[int, int, int, int, int, int, int, str, str, str]


@dataclass(slots=True)
class AnomalyRecord:
    """One anomaly.json record, reduced to the fields the analysis needs.

    ``value``/``baseline`` are None when unknown (reference files); ``rule`` is None when unknown.
    """

    rank: int
    step: int
    tag_name: str
    message: str
    micro_step: int = 0
    pp_stage: int = 0
    vpp_stage: int = 0
    call_id: int = -1
    op: str = ""
    value: float | None = None
    baseline: float | None = None
    rule: str | None = None
    group_mates: tuple[int, ...] = ()


def _number(value: object) -> float | None:
    """A JSON number, or a non-finite value written as a string ("nan", "inf"); raises on others."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)  # type: ignore[arg-type]
    if value is None:
        return None
    if kind is str:
        number = float(value)  # type: ignore[arg-type]
        if math.isfinite(number):
            raise ValueError("finite numbers must be JSON numbers")
        return number
    raise TypeError("not a number")


def _parse_message(message: str) -> tuple[str | None, float | None, float | None]:
    """(rule, value, history mean) parsed from a reference message; None where absent."""
    match = _RULE_RE.match(message)
    rule = match.group(1) if match else None
    match = _VALUE_RE.search(message)
    if match:
        try:
            return rule, float(match.group(1)), float(match.group(2))
        except ValueError:
            pass
    return rule, None, None


_FILL_RULE, _FILL_NUMBERS = 1, 2


def _fields(obj: object) -> tuple | None:
    """The validated fields of one decoded record; None if malformed.

    ``(rank, step, tag, message, micro, pp, vpp, call_id, op, value, baseline, rule, mates, fill)``: a
    plain tuple is much cheaper than an AnomalyRecord, which only selected records become (_build).
    ``fill`` says what _build must still parse from the message (reference records: the rule and, in
    later versions, value and history mean); only the op, part of the sort key, is parsed here.
    """
    if type(obj) is not dict:
        return None
    get = obj.get
    rank, step, tag, message = get("rank"), get("step"), get("tag_name"), get("message")
    micro, pp, vpp, call_id = get("micro_step"), get("pp_stage"), get("vpp_stage"), get("call_id")
    micro = 0 if micro is None else micro
    pp = 0 if pp is None else pp
    vpp = 0 if vpp is None else vpp
    call_id = -1 if call_id is None else call_id
    if {type(rank), type(step), type(micro), type(pp), type(vpp), type(call_id)} != _INT_ONLY:
        return None
    if type(tag) is not str or type(message) is not str:
        return None
    op, rule, value, baseline, mates = (
        get("op"),
        get("rule"),
        get("value"),
        get("baseline"),
        get("group_mates"),
    )
    try:
        if type(value) is not float:
            value = _number(value)
        if type(baseline) is not float:
            baseline = _number(baseline)
    except (TypeError, ValueError):
        return None
    if op is None:  # reference format: the op is only in the message
        match = _OP_RE.search(message)
        op = match.group(1) if match else ""
    elif type(op) is not str:
        return None
    fill = 0
    if rule is None:
        fill = _FILL_RULE
    elif type(rule) is not str:
        return None
    if "value" not in obj and "baseline" not in obj:
        fill |= _FILL_NUMBERS
    if mates is None:
        mates = ()
    elif type(mates) is list and set(map(type, mates)) <= _INT_ONLY:
        mates = tuple(mates)
    else:
        return None
    return rank, step, tag, message, micro, pp, vpp, call_id, op, value, baseline, rule, mates, fill


def _build(fields: tuple) -> AnomalyRecord:
    """The AnomalyRecord of _fields' tuple, completed from the message where needed."""
    record = AnomalyRecord(*fields[:13])
    fill = fields[13]
    if fill:
        rule, value, baseline = _parse_message(record.message)
        if fill & _FILL_RULE:
            record.rule = rule
        if fill & _FILL_NUMBERS:
            record.value, record.baseline = value, baseline
    return record


def parse_record(obj: object) -> AnomalyRecord | None:
    """An AnomalyRecord from one decoded record, or None when it is malformed."""
    fields = _fields(obj)
    return None if fields is None else _build(fields)


def task_of(tag: str) -> str:
    """The task key of a tag: its last ``/`` component, or "" for a tag without ``/``."""
    _, sep, task = tag.rpartition("/")
    return task if sep else ""


_STAGE_CACHE: dict[str, int] = dict(TASK_STAGE)


def stage_of_task(task: str) -> int:
    """PARAMETERS, FORWARD, BACKWARD, OPTIMIZER or UNKNOWN for a task key."""
    stage = _STAGE_CACHE.get(task)
    if stage is None:
        stage = BACKWARD if _COMM_TASK.fullmatch(task) else UNKNOWN
        if len(_STAGE_CACHE) < 4096:
            _STAGE_CACHE[task] = stage
    return stage


def stage_of(record: AnomalyRecord) -> int:
    """The stage of a record, from its tag."""
    return stage_of_task(task_of(record.tag_name))


#: task (last tag component) -> causal phase within a step.
PHASES: dict[str, int] = {
    "param_origin": 0,
    "sr": 0,
    "actv": 1,
    "qkt": 1,
    "actv_grad": 2,
    "acc_grad": 3,
    "pre_grad": 3,
    "comm": 4,
    "post_grad": 5,
    "mg_direction": 6,
    "exp_avg": 6,
    "exp_avg_sq": 6,
    "param_updated": 7,
}
OTHER_PHASE = 8


def phase_of(record: Mapping[str, Any]) -> int:
    """The causal phase of a record, from its tag's task."""
    task = str(record["tag_name"]).rpartition("/")[2]
    if task in PHASES:
        return PHASES[task]
    if task.startswith(("pre_", "post_")) and task.split("_", 1)[1].isdigit():
        return PHASES["comm"]
    return OTHER_PHASE


def place_in_step(tag: str, micro_step: int) -> tuple[int, int]:
    """``(micro-step, stage)`` of a tag's row as the ranking places it within its step: the
    parameters before micro-step 0, whole-step and unknown tasks after the last micro-step."""
    _, sep, task = tag.rpartition("/")
    stage = stage_of_task(task if sep else "")
    if stage == PARAMETERS:
        return -1, stage
    if stage == UNKNOWN or task in _AFTER_MICRO_STEPS:  # unknown: after every known stage
        return _LAST_MICRO, stage
    if task in _SUMMED_UNLESS_NAMED and split_tag(tag)[2] is None:
        return _LAST_MICRO, stage
    return micro_step, stage


def _key(
    rank: int, step: int, tag: str, message: str, micro: int, pp: int, vpp: int, call_id: int, op: str
) -> SortKey:
    micro, stage = place_in_step(tag, micro)
    if stage == FORWARD:
        return (step, micro, stage, vpp, pp, call_id, rank, tag, op, message)
    return (step, micro, stage, -vpp, -pp, call_id, rank, tag, op, message)


def sort_key(record: AnomalyRecord) -> SortKey:
    """The ranking key of a record (module docstring); smaller = earlier = more likely a cause."""
    r = record
    return _key(r.rank, r.step, r.tag_name, r.message, r.micro_step, r.pp_stage, r.vpp_stage, r.call_id, r.op)


def top_k(records: Iterable[AnomalyRecord], k: int) -> list[AnomalyRecord]:
    """The k earliest records in ranking order (heap selection, O(n log k))."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return heapq.nsmallest(k, records, key=sort_key)


@dataclass(slots=True)
class Selection:
    """select_records' result: the k earliest records kept and the counts of one document."""

    records: list[AnomalyRecord]
    valid: int
    bad_keys: list[str]
    selected: int


def select_records(document: dict, k: int, steps: frozenset[int] | None = None) -> Selection:
    """Parse a decoded anomaly.json object and keep its k earliest records in steps (None: all).

    Equivalent to ``top_k(parsed records in steps, k)`` but builds AnomalyRecords only for the winners.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    entries, bad_keys, valid = [], [], 0
    for index, (name, obj) in enumerate(document.items()):
        fields = _fields(obj)
        if fields is None:
            bad_keys.append(str(name))
            continue
        valid += 1
        if steps is None or fields[1] in steps:
            entries.append((_key(*fields[:9]), index, fields))
    best = heapq.nsmallest(k, entries)
    return Selection([_build(fields) for _, _, fields in best], valid, bad_keys, len(entries))


class TopK:
    """Streaming top-k: memory stays O(max(k, chunk)) however many records are added.

    Records are buffered with their keys (computed once) and the buffer is cut back to its k best
    whenever it grows past ``max(4 * k, chunk)``; the result equals ``top_k(all_records, k)``.
    """

    def __init__(self, k: int, chunk: int = 65536) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self._limit = max(4 * k, chunk)
        self._buffer: list[tuple[SortKey, int, AnomalyRecord]] = []
        self._order = count()  # arrival order: ties on the whole key keep input order, like top_k

    def extend(self, records: Iterable[AnomalyRecord]) -> None:
        """Add records."""
        order = self._order
        self._buffer.extend((sort_key(r), next(order), r) for r in records)
        if len(self._buffer) > self._limit:
            self._buffer = heapq.nsmallest(self.k, self._buffer)

    def result(self) -> list[AnomalyRecord]:
        """The k earliest records added so far, in ranking order."""
        self._buffer = heapq.nsmallest(self.k, self._buffer)
        return [record for _, _, record in self._buffer]
