"""StepRecord: one collected step's numbers for one data type.

This is the only thing adapters hand to the core. Values are a float64 array of shape
(rows, ops); the row metadata (chunk index, name, micro-step, tag) lives in a RowSet that an
adapter builds once at attach time and reuses, so no tag string is built per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from monitor.naming import build_tag


@dataclass(frozen=True)
class RowSet:
    """Row labels of a StepRecord: chunk index, name, optional micro-step and the full tag.

    Attributes:
        vpp_stages: virtual-pipeline chunk index of each row (the "N:" prefix).
        names: names without chunk prefix (e.g. "layers.0.mlp.weight").
        micro_steps: micro-step index of each row, or None when the data type has none.
        tags: full tags "N:name[:m]/rankR/task", the keys of the api dictionaries.
        unjudged: per row, whether the anomaly rules and the non-finite check leave it alone
            (None: judge every row): tensors of integers or booleans a module is fed (token ids,
            labels, masks) are the data, not values the model computed; they vary at will (a
            batch whose labels are all 0 has norm 0); and a float attention mask passed to a
            module holds -inf by design.
    """

    vpp_stages: tuple[int, ...]
    names: tuple[str, ...]
    micro_steps: tuple[int, ...] | None
    tags: tuple[str, ...]
    unjudged: tuple[bool, ...] | None = None

    @classmethod
    def build(
        cls,
        vpp_stages: Sequence[int],
        names: Sequence[str],
        rank: int | None,
        task: str,
        micro_steps: Sequence[int] | None = None,
        unjudged: Sequence[bool] | None = None,
    ) -> RowSet:
        """Build the row labels and their tags once (at attach time or once per step)."""
        micro = tuple(micro_steps) if micro_steps is not None else None
        tags = tuple(
            build_tag(v, n, rank, task, None if micro is None else micro[i])
            for i, (v, n) in enumerate(zip(vpp_stages, names, strict=True))
        )
        skip = tuple(unjudged) if unjudged is not None and any(unjudged) else None
        return cls(tuple(vpp_stages), tuple(names), micro, tags, skip)

    def __len__(self) -> int:
        return len(self.names)

    def take(self, index: Sequence[int]) -> RowSet:
        """A RowSet of the given rows, in the given order."""
        return RowSet(
            tuple(self.vpp_stages[i] for i in index),
            tuple(self.names[i] for i in index),
            None if self.micro_steps is None else tuple(self.micro_steps[i] for i in index),
            tuple(self.tags[i] for i in index),
            None if self.unjudged is None else tuple(self.unjudged[i] for i in index),
        )


class SameRows:
    """The previous step's RowSet again when a step's rows are the same (the usual case).

    Writers keep what they build per RowSet object (CSV row templates, TensorBoard tags) for as
    long as it lives, so handing them the same object makes that per-row work once per run
    instead of once per step.
    """

    def __init__(self) -> None:
        self._key: object = None
        self._rows: RowSet | None = None

    def get(self, key: object, build: Callable[[], RowSet]) -> RowSet:
        """The RowSet of ``key`` (any value comparable with ==), built only when it changed."""
        if self._rows is None or key != self._key:
            self._key, self._rows = key, build()
        return self._rows


@dataclass
class StepRecord:
    """One step's statistics of one data type on one rank.

    Attributes:
        prefix: data type, also the CSV file prefix ("grad_reduced", "exp_avg", ...).
        step: the monitor's optimizer-step counter.
        ops: statistic names, the columns of ``values``.
        rows: row labels.
        values: float64 array (len(rows), len(ops)); NaN/Inf kept as computed.
        call_ids: order of collection within the step on this rank, one per row (see docs/configuration.md).
        fetch: optional callable that returns ``values`` when the device-to-host copy was started
            asynchronously; the writer thread calls it, the training thread never waits on it.
        judged: whether the anomaly rules judge the values, or a callable that says so on the
            writer thread (one with a ``settled`` attribute, once that is true: the writer holds
            the record until its step ends): not the gradients of a step whose update a loss
            scaler skipped (Inf/NaN there is the scaler's business, not a fault).
        by_rules: whether the rules judge the values too, or only the check for NaN/Inf: not the
            activations and gradients of a step shorter than ``grad_acc_steps`` (an epoch's last:
            their scale then depends on how the loop normalises its loss).
    """

    prefix: str
    step: int
    ops: tuple[str, ...]
    rows: RowSet
    values: np.ndarray | None = None
    call_ids: np.ndarray | None = None
    fetch: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    judged: bool | Callable[[], bool] = True
    by_rules: bool = True

    def resolve(self) -> np.ndarray:
        """Return the values, completing a pending device-to-host copy if there is one."""
        if self.values is None:
            if self.fetch is None:
                raise ValueError(f"StepRecord {self.prefix} step {self.step} has no values")
            self.values = np.asarray(self.fetch(), dtype=np.float64)
            self.fetch = None
        return self.values

    def judged_now(self) -> bool:
        """``judged``, asking its callable (which may wait for the device) if it is one; a
        callable that fails leaves the values judged."""
        if isinstance(self.judged, bool):
            return self.judged
        try:
            return bool(self.judged())
        except Exception:
            return True

    @property
    def has_micro_step(self) -> bool:
        return self.rows.micro_steps is not None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{tag: {op: float}}`` with plain Python floats."""
        values = self.resolve().tolist()
        return {tag: dict(zip(self.ops, row, strict=True)) for tag, row in zip(self.rows.tags, values)}
