"""The ranked anomaly records as output: the anomaly_analyse.json document and the printed table.

The document lays records out as trainmon's anomaly writer does (non-finite numbers as strings);
it is written atomically so that a reader never sees half a file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from monitor.anomaly.ordering import STAGE_NAMES, AnomalyRecord, stage_of
from monitor.files import atomic_write_text

MESSAGE_WIDTH = 60

_CONTROL = {c: "?" for c in range(32)} | {127: "?"}


def record_key(record: AnomalyRecord) -> str:
    """trainmon's anomaly.json key; without the op segment when the op is unknown."""
    op = f"_{record.op}" if record.op else ""
    return f"{record.tag_name}{op}_step_{record.step}_call_{record.call_id}"


def _json_number(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)


_JSON_FIELDS = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "op")


def record_to_json(record: AnomalyRecord) -> dict[str, object]:
    """The record as trainmon's writer lays it out (non-finite numbers as strings)."""
    document: dict[str, object] = {name: getattr(record, name) for name in _JSON_FIELDS}
    document["value"] = _json_number(record.value)
    document["baseline"] = _json_number(record.baseline)
    document["rule"] = record.rule
    document["message"] = record.message
    document["group_mates"] = list(record.group_mates)
    return document


def to_document(records: Iterable[AnomalyRecord]) -> dict[str, dict[str, object]]:
    """key -> record in ranking order; a key seen twice gets ``_rank{R}`` and then ``_{n}`` appended."""
    document: dict[str, dict[str, object]] = {}
    for record in records:
        key = record_key(record)
        if key in document:
            key = f"{key}_rank{record.rank}"
        base, n = key, 1
        while key in document:
            n += 1
            key = f"{base}_{n}"
        document[key] = record_to_json(record)
    return document


#: the analysis output is replaced like every file trainmon writes (fsync, rename, no symlinks)
write_atomic = atomic_write_text


def _clean(text: str) -> str:
    return text.translate(_CONTROL)


def _value_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def format_table(records: list[AnomalyRecord], message_width: int = MESSAGE_WIDTH) -> str:
    """An aligned text table of ranked records: where, what, the value against its baseline and
    the rule that judged it (a record of unknown rule shows its message, cut at
    ``message_width``; msprobe's message only repeats the tag, op and step)."""
    header = ("#", "rank", "step", "micro_step", "stage", "tag", "op", "value", "baseline", "rule")
    rows = []
    for index, r in enumerate(records, 1):
        rule = _clean(r.rule or r.message)
        if len(rule) > message_width:
            rule = rule[: message_width - 3] + "..."
        rows.append(
            (
                str(index),
                str(r.rank),
                str(r.step),
                str(r.micro_step),
                STAGE_NAMES[stage_of(r)],
                _clean(r.tag_name),
                _clean(r.op) or "-",
                _value_text(r.value),
                _value_text(r.baseline),
                rule,
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = {0, 1, 2, 3, 7, 8}
    lines = []
    for row in [header, *rows]:
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
