"""Anomaly records and the abnormal cells of one record, built into records only when asked.

The detector finds abnormal cells as arrays (row, column, rule, baseline); most of them, in a
run where a NaN stays or a rule floods, continue an abnormality already reported and never
become records. ``Verdicts`` keeps them as arrays and builds an ``Anomaly`` (with its message)
only for the cells that become records.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from monitor.record import StepRecord

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


@dataclass
class Verdicts:
    """The abnormal cells of one record, in reporting order (non-finite first, then the rules in
    config order, then MovedAlone): row, column, rule and baseline per cell, and for cells of
    the ``norm`` column the ratio to the tag's level and the data type's common ratio."""

    record: StepRecord
    rows: np.ndarray
    cols: np.ndarray
    #: per cell, an index into ``rule_names``.
    rule_ids: np.ndarray
    rule_names: tuple[str, ...]
    baselines: np.ndarray
    ratios: np.ndarray
    common: float
    rank: int
    pp_stage: int
    group_mates: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def anomaly(self, i: int) -> Anomaly:
        """The Anomaly of cell ``i``."""
        record, row, col = self.record, int(self.rows[i]), int(self.cols[i])
        tag, op, rule = record.rows.tags[row], record.ops[col], self.rule_names[self.rule_ids[i]]
        value, base = float(record.values[row, col]), float(self.baselines[i])
        ratio = float(self.ratios[i])
        message = (
            f"Rule {rule} reports anomaly signal in ('{tag}', '{op}') at step {record.step}, "
            f"current value {value:.6g}, history mean {base:.6g}."
        )
        return Anomaly(
            rank=self.rank,
            step=record.step,
            micro_step=record.rows.micro_steps[row] if record.rows.micro_steps is not None else 0,
            pp_stage=self.pp_stage,
            vpp_stage=record.rows.vpp_stages[row],
            call_id=int(record.call_ids[row]) if record.call_ids is not None else -1,
            tag_name=tag,
            op=op,
            value=value,
            baseline=base,
            rule=rule,
            message=message,
            group_mates=self.group_mates,
            prefix=record.prefix,
            ratio=ratio,
            common=self.common if math.isfinite(ratio) else math.nan,
        )

    def anomalies(self) -> list[Anomaly]:
        """Every cell as an Anomaly."""
        return [self.anomaly(i) for i in range(len(self))]
