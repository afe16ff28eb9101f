"""Cross-rank outlier statistics: is one rank's value unlike its peers' for the same tensor and step?

For every data type, step, micro-step, tensor (vpp stage and name) and op, the ranks that hold the
tensor are compared. Rank i's value x_i is measured against the median of the OTHER ranks' values
(its peers), m_i = median(x_j, j != i), so an outlier never pulls its own baseline. The unit is

    scale = max(MAD, pooled * size, REL_FLOOR * size, usual),   size = median over the ranks of |x_j|

* MAD: the median over the ranks of |x_j - m_j| at this step (a median absolute deviation);
* pooled: the typical MAD / size over all steps of the run, the larger of the tensor's own
  (per type, tensor and op) and that of all tensors of the type (per type and op). It steadies
  the MAD of a few ranks (over 4 values it is often near 0 by chance) while following the
  tensor's magnitude from step to step (size, not |median|, so that a signed statistic is
  measured against its spread, though across a few ranks a statistic that hovers around zero,
  such as a gradient's mean, still has no steady unit: the CLI leaves mean out by default);
* REL_FLOOR * size: tensors identical on most ranks (MAD 0) do not alarm on rounding;
* ABS_FLOOR for shares (``zeros``): one percentage point, so that a share of 0.03 against peers
  at exactly 0 is 3 units away, not infinitely many.
* usual, where most ranks hold exactly 0 (size 0: the min of a sparse gradient): the tensor's
  usual non-zero magnitude, the median over the run of each step's mean |x_j| of its non-zero
  values, so that -0.02 against peers at 0, where -0.005 is usual, is 4 units away, not 1e305.
  Only from USUAL_STEPS such steps on, so that a lone value is not its own unit; not for NaN
  counts, of which any is an outlier among zeros, nor for shares (ABS_FLOOR). Otherwise, when
  size and MAD are both 0, any non-zero value is an outlier.

A rank is flagged when |x_i - m_i| > k_mad * scale with at least MIN_RANKS (4) finite values in
its row (of two ranks neither can be told to be the odd one; of three, an outlier is its peers'
peer and lifts the step's MAD to half its own deviation), or when its value is NaN/Inf while
at least one peer holds a finite value: a rank that alone went non-finite in a two-rank run is
named too. False-positive rates on noise: see benchmarks/cross_rank.py and docs/anomalies.md.

Everything is vectorised with numpy over blocks of (tensor x step) rows x ranks, bounded in memory;
the statistics of a block's rows are monitor.anomaly.peer_rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from monitor.anomaly.peer_rows import MIN_RANKS, MIN_RANKS_NONFINITE, peer_stats
from monitor.anomaly.rank_csv import Table

#: smallest scale, relative to the median magnitude.
REL_FLOOR = 1e-3
#: smallest scale of ops whose values are shares in [0, 1]: peers all at exactly 0 (a share of
#: zeros) would otherwise leave no unit at all, and a 3% share would be 1e306 "MADs" away.
ABS_FLOOR = {"zeros": 0.01}
#: steps with non-zero values a tensor's usual magnitude needs (of fewer, one could be the outlier's)
USUAL_STEPS = 3
#: ops whose rows of peers at 0 keep their own unit: NaN counts (any is an outlier) and shares.
OWN_UNITS = frozenset(("nans", *ABS_FLOOR))
#: elements of one (rows x ranks) block.
BLOCK = 1 << 20
_TINY = np.finfo(np.float64).tiny


@dataclass
class Prepared:
    """One Table sorted by step, with run-wide tensor labels and micro-step indices (0: none)."""

    column: int
    ops: tuple[str, ...]
    labels: np.ndarray
    micro: np.ndarray | int
    steps: np.ndarray
    values: np.ndarray


class _Labels:
    """Ids of (vpp stage, name) labels in the order first seen, and the lookup table from the row
    codes of each distinct list of names (the ranks' Tables usually share one) to those ids."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, str], int] = {}
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def lookup(self, low: int, stages: int, names: list[str], codes: np.ndarray) -> np.ndarray:
        """The ids of codes ``(vpp - low) * len(names) + name code``, for the codes used."""
        key = (low, stages, tuple(names))
        if key not in self._tables:
            size = stages * len(names)
            self._tables[key] = (np.zeros(size, dtype=np.int32), np.zeros(size, dtype=bool))
        lut, known = self._tables[key]
        if known.all():  # the usual case after a run's first file
            return lut
        missing = np.flatnonzero((np.bincount(codes, minlength=len(lut)) > 0) & ~known).tolist()
        if missing:
            keys = [(low + index // len(names), names[index % len(names)]) for index in missing]
            lut[missing] = [self.ids.setdefault(label, len(self.ids)) for label in keys]
            known[missing] = True
        return lut


def _prepare(column: int, table: Table, labels: _Labels) -> Prepared:
    low, high = int(table.vpp.min()), int(table.vpp.max())
    pair = table.codes if low == high else (table.vpp.astype(np.int64) - low) * len(table.names) + table.codes
    lut = labels.lookup(low, high - low + 1, table.names, pair)
    micro: np.ndarray | int = table.micro + 1 if table.micro is not None else 0
    steps, values = table.steps, table.values
    ids = lut[pair]
    if np.any(steps[1:] < steps[:-1]):
        order = np.argsort(steps, kind="stable")
        ids, steps, values = ids[order], steps[order], values[order]
        micro = micro[order] if isinstance(micro, np.ndarray) else 0
    return Prepared(column, table.ops, ids, micro, steps, values)


class _Columns:
    """Parallel arrays appended block by block."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, **arrays: np.ndarray) -> None:
        for name, array in arrays.items():
            self.parts.setdefault(name, []).append(array)

    def __getitem__(self, name: str) -> np.ndarray:
        parts = self.parts.get(name)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def joined(self) -> dict[str, np.ndarray]:
        """Every column as one array."""
        return {name: self[name] for name in self.parts}


@dataclass
class Outliers:
    """The outliers of a run as parallel arrays (see ``columns``), the labels they index, the count judged.

    Columns: type, step, micro (-1: none), label, op, rank, value, peers (median of the other
    ranks), scale, score (|value - peers| / scale; inf for NaN/Inf values). ``only_ops`` restricts
    the ops compared; ``only_steps`` the steps reported and counted (the pooled MAD uses all steps).
    ``type`` indexes the judged groups: ``types`` (a data type, once per pipeline stage),
    ``stages`` and ``labels``; ``ranks`` is data type -> pipeline stage -> the ranks compared.
    """

    k_mad: float
    only_ops: tuple[str, ...] | None = None
    only_steps: frozenset[int] | None = None
    types: list[str] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)
    labels: list[list[tuple[int, str]]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    ranks: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    columns: _Columns = field(default_factory=_Columns)
    judged: int = 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]


@dataclass
class Partial:
    """The first pass of one data type over some of its steps: per-row statistics and the values
    that may be outliers, with tensor labels and ops indexing this Partial's own lists."""

    labels: list[tuple[int, str]]
    ops: list[str]
    rows: dict[str, np.ndarray]
    candidates: dict[str, np.ndarray]
    judged: int


def first_pass(
    tables: list[tuple[int, Table]],
    ranks: int,
    k_mad: float,
    only_ops: tuple[str, ...] | None = None,
    only_steps: frozenset[int] | None = None,
) -> Partial:
    """Compare the ranks' Tables of one data type, given as (rank column, Table) with columns in
    range(ranks), in blocks of at most BLOCK values (empties ``tables``)."""
    registry = _Labels()
    prepared = [_prepare(column, table, registry) for column, table in tables]
    label_ids = registry.ids
    tables.clear()  # the prepared arrays replace the tables
    ops: list[str] = []
    rows, candidates, judged_total = _Columns(), _Columns(), 0
    if not prepared:
        return Partial([], ops, {}, {}, 0)
    steps = np.unique(np.concatenate([p.steps[np.r_[True, p.steps[1:] != p.steps[:-1]]] for p in prepared]))
    n_micro, n_labels = 1 + max(int(np.max(p.micro, initial=0)) for p in prepared), len(label_ids)
    aligned = _aligned(prepared, ranks, n_micro, n_labels)
    for op in dict.fromkeys(op for p in prepared for op in p.ops):
        if only_ops is not None and op not in only_ops:
            continue
        ops.append(op)
        holders = [(p, p.ops.index(op)) for p in prepared if op in p.ops]
        if aligned and len(holders) == ranks:
            blocks = _aligned_blocks(holders, ranks)
        else:
            blocks = _scattered_blocks(holders, ranks, steps, n_micro, n_labels)
        for values, present, labels in blocks:
            judged = _block(
                values, present, labels, len(ops) - 1, ABS_FLOOR.get(op, 0.0), k_mad, rows, candidates
            )
            judged_total += int((judged & _chosen(labels[1], only_steps)).sum())
    return Partial(list(label_ids), ops, rows.joined(), candidates.joined(), judged_total)


_Block = tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _aligned(prepared: list[Prepared], ranks: int, n_micro: int, n_labels: int) -> bool:
    """Whether every rank has one table holding the same entries (step, micro-step, tensor) in the
    same order, each once: the usual case, whose blocks need no scattering."""
    first = prepared[0]
    if ranks < MIN_RANKS_NONFINITE or sorted(p.column for p in prepared) != list(range(ranks)):
        return False
    same = all(
        np.array_equal(p.steps, first.steps)
        and np.array_equal(p.labels, first.labels)
        and np.array_equal(p.micro, first.micro)
        for p in prepared[1:]
    )
    if not same or not len(first.steps):
        return False
    key = ((first.steps - first.steps[0]) * n_micro + first.micro) * n_labels + first.labels
    return len(np.unique(key)) == len(key)


def _aligned_blocks(holders: list[tuple[Prepared, int]], ranks: int) -> Iterator[_Block]:
    """Blocks of aligned tables: each rank's values side by side."""
    holders = sorted(holders, key=lambda holder: holder[0].column)
    first = holders[0][0]
    micro = first.micro - 1 if isinstance(first.micro, np.ndarray) else np.full(len(first.steps), -1)
    height = max(1, BLOCK // ranks)
    for lo in range(0, len(first.steps), height):
        # rank by rank (contiguous writes), then one transposition: twice column_stack's speed
        values = np.stack([p.values[lo : lo + height, column] for p, column in holders]).T.copy()
        labels = (first.labels[lo : lo + height], first.steps[lo : lo + height], micro[lo : lo + height])
        yield values, np.ones(values.shape, dtype=bool), labels


def _scattered_blocks(
    holders: list[tuple[Prepared, int]], ranks: int, steps: np.ndarray, n_micro: int, n_labels: int
) -> Iterator[_Block]:
    """Blocks of any tables: each rank's values placed at their (step, micro-step, tensor) row,
    rows held by fewer than MIN_RANKS_NONFINITE ranks left out."""
    per_step = n_micro * n_labels
    chunk = max(1, BLOCK // (per_step * ranks))
    for first in range(0, len(steps), chunk):
        window = steps[first : first + chunk]
        # filled rank by rank (contiguous writes), then one transposition to rows x ranks
        values = np.full((ranks, len(window) * per_step), np.nan)
        present = np.zeros(values.shape, dtype=bool)
        for p, op_column in holders:
            lo, hi = np.searchsorted(p.steps, window[0]), np.searchsorted(p.steps, window[-1], "right")
            micro = p.micro[lo:hi] if isinstance(p.micro, np.ndarray) else 0
            key = (np.searchsorted(window, p.steps[lo:hi]) * n_micro + micro) * n_labels + p.labels[lo:hi]
            values[p.column, key] = p.values[lo:hi, op_column]
            present[p.column, key] = True
        values, present = np.ascontiguousarray(values.T), np.ascontiguousarray(present.T)
        keys = np.flatnonzero(present.sum(axis=1) >= MIN_RANKS_NONFINITE)
        if len(keys) < len(values):
            values, present = values[keys], present[keys]
        yield values, present, (keys % n_labels, window[keys // per_step], (keys % per_step) // n_labels - 1)


def judge(prefix: str, ranks: list[int], partials: list[Partial], out: Outliers, stage: int = 0) -> None:
    """Second pass over one data type's Partials (in any order) of one pipeline ``stage``'s ranks
    (each stage's layers are its own, alike named): its outliers into ``out``."""
    label_ids: dict[tuple[int, str], int] = {}
    rows, candidates = _Columns(), _Columns()
    for part in partials:
        label_map = np.array([label_ids.setdefault(label, len(label_ids)) for label in part.labels], np.int32)
        op_map = np.array([_index(out.ops, op) for op in part.ops], np.int16)
        for target, columns in ((rows, part.rows), (candidates, part.candidates)):
            if columns:
                target.add(**{**columns, "label": label_map[columns["label"]], "op": op_map[columns["op"]]})
        out.judged += part.judged
    out.types.append(prefix)
    out.stages.append(stage)
    out.labels.append(list(label_ids))
    out.ranks.setdefault(prefix, {})[stage] = list(ranks)
    _judge(rows, candidates, np.asarray(ranks, dtype=np.int64), out)


def _index(names: list[str], name: str) -> int:
    if name not in names:
        names.append(name)
    return names.index(name)


def _chosen(steps: np.ndarray, only: frozenset[int] | None) -> np.ndarray:
    return np.ones(len(steps), dtype=bool) if only is None else np.isin(steps, list(only))


def _block(
    values: np.ndarray,
    present: np.ndarray,
    labels: tuple[np.ndarray, np.ndarray, np.ndarray],
    op: int,
    absolute_floor: float,
    k_mad: float,
    rows: _Columns,
    candidates: _Columns,
) -> np.ndarray:
    """First pass over one block: per-row statistics, and the values that may be outliers.

    ``labels`` are the rows' (tensor label, step, micro-step); returns which rows were judged on
    their values' sizes (NaN/Inf values are judged wherever a peer is finite).
    """
    stats = peer_stats(values, present)
    judged = stats.count >= MIN_RANKS
    floor = np.maximum.reduce([stats.mad, REL_FLOOR * stats.size, np.full(len(stats.mad), absolute_floor)])
    floor = np.maximum(floor, _TINY)
    with np.errstate(invalid="ignore"):
        far = judged[:, None] & (stats.deviation > k_mad * floor[:, None])
    maybe = present & (far | (~stats.finite & (stats.count > 0)[:, None]))
    label, step, micro = labels
    with np.errstate(divide="ignore", invalid="ignore"):  # kept per judged row for the pooled MAD
        ratio = stats.mad[judged] / stats.size[judged]
        nonzero = present[judged] & np.isfinite(values[judged]) & (values[judged] != 0)
        magnitude = np.where(nonzero, np.abs(values[judged]), 0.0).sum(axis=1) / nonzero.sum(axis=1)
    rows.add(
        label=label[judged].astype(np.int32),
        op=np.full(len(ratio), op, np.int16),
        ratio=ratio,
        magnitude=magnitude,
    )
    row, column = np.nonzero(maybe)
    candidates.add(
        step=step[row],
        micro=micro[row],
        label=label[row],
        op=np.full(len(row), op),
        column=column,
        value=values[row, column],
        peers=stats.peers[row, column],
        deviation=stats.deviation[row, column],
        size=stats.size[row],
        mad=stats.mad[row],
    )
    return judged


class _GroupMedians:
    """The median of the values (NaN left out) of each key."""

    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        keep = ~np.isnan(values)
        keys, values = keys[keep], values[keep]
        order = np.argsort(values)  # then by key, keeping that order: half of np.lexsort's time
        order = order[np.argsort(keys[order], kind="stable")]
        keys, values = keys[order], values[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, int)
        counts = np.diff(np.r_[starts, len(keys)])
        self.keys = keys[starts]
        self.medians = (values[starts + (counts - 1) // 2] + values[starts + counts // 2]) / 2.0
        self.counts = counts

    def of(self, keys: np.ndarray, at_least: int = 1) -> np.ndarray:
        """The median of each key's values, NaN for keys with fewer than ``at_least``."""
        if not len(self.keys):
            return np.full(len(keys), np.nan)
        index = np.searchsorted(self.keys, keys).clip(max=len(self.keys) - 1)
        found = (self.keys[index] == keys) & (self.counts[index] >= at_least)
        return np.where(found, self.medians[index], np.nan)


def _judge(rows: _Columns, candidates: _Columns, ranks: np.ndarray, out: Outliers) -> None:
    """Second pass: pool the MADs over the run and keep the candidates beyond k_mad scales."""
    ratio = np.where(np.isinf(rows["ratio"]), np.nan, rows["ratio"])
    row_op = rows["op"].astype(np.int64)
    per_tensor = _GroupMedians(rows["label"].astype(np.int64) * len(out.ops) + row_op, ratio)
    per_op = _GroupMedians(row_op, ratio)
    label, op = candidates["label"].astype(np.int64), candidates["op"].astype(np.int64)
    typical = np.fmax(per_tensor.of(label * len(out.ops) + op), per_op.of(op))
    typical = np.nan_to_num(typical, nan=0.0)
    size = candidates["size"]
    absolute = np.array([ABS_FLOOR.get(name, 0.0) for name in out.ops])[op]
    magnitude = _GroupMedians(rows["label"].astype(np.int64) * len(out.ops) + row_op, rows["magnitude"])
    sparse = (size == 0) & np.array([name not in OWN_UNITS for name in out.ops])[op]
    usual = np.where(
        sparse, np.nan_to_num(magnitude.of(label * len(out.ops) + op, USUAL_STEPS), nan=0.0), 0.0
    )
    # fmax: a lone finite peer has no deviation of its own to take a MAD of
    scale = np.fmax.reduce([candidates["mad"], typical * size, REL_FLOOR * size, absolute, usual])
    scale = np.where(scale > 0, scale, _TINY)
    deviation = candidates["deviation"]
    finite = np.isfinite(candidates["value"])
    with np.errstate(over="ignore", invalid="ignore"):
        keep = (~finite | (deviation > out.k_mad * scale)) & _chosen(candidates["step"], out.only_steps)
        score = np.where(finite, deviation / scale, np.inf)
    out.columns.add(
        type=np.full(int(keep.sum()), len(out.types) - 1),
        step=candidates["step"][keep],
        micro=candidates["micro"][keep],
        label=label[keep],
        op=op[keep],
        rank=ranks[candidates["column"][keep]],
        value=candidates["value"][keep],
        peers=candidates["peers"][keep],
        scale=scale[keep],
        score=score[keep],
    )
