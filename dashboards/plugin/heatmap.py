"""Heatmap matrices from a run's sources, downsampled over steps on the server.

A view asks for one data type and op over a step range with at most ``columns`` columns. Reading
is bounded: among the chunks that overlap the range, evenly spaced ones are read until
``budget`` bytes, always including the last chunk (the newest data) and the chunks of the
*must* steps (the anomalies of the view), so a spike that was flagged is never sampled away.
Columns are real steps (evenly spaced among those read, plus the must steps), never averages, so
every cell shows a value that was recorded. The choice depends only on the files, not on what is
cached, so the same request gives the same picture.
"""

from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dashboards.plugin.sources import Block, Chunk, Source
from monitor.datatypes.tasks import ROW_ORDER_FROM, RowKey

#: columns a view may ask for.
MAX_COLUMNS = 2000
#: chunk bytes read for one view of one rank (CSV text or event records), at most.
READ_BUDGET = 64 << 20
#: share of the columns that may go to must (anomaly) steps.
MUST_SHARE = 0.25

MISSING, PRESENT = 1, 0


def _spread(count: int, keep: int) -> list[int]:
    """``keep`` evenly spaced indices of range(count), first and last included."""
    if keep >= count:
        return list(range(count))
    if keep <= 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


def pick_chunks(
    chunks: Sequence[Chunk], lo: int, hi: int, columns: int, budget: int, must: Iterable[int] = ()
) -> list[Chunk]:
    """The chunks to read for steps [lo, hi] (see the module docstring)."""
    inside = [c for c in chunks if c.last >= lo and c.first <= hi]
    if not inside:
        return []
    total = sum(c.nbytes for c in inside)
    if len(inside) <= columns and total <= budget:
        return inside
    mean = max(1, total // len(inside))
    keep = max(1, min(len(inside), columns, budget // mean))
    chosen = set(_spread(len(inside), keep))
    firsts = [c.first for c in inside]
    extra = int(columns * MUST_SHARE)  # the earliest must steps, like pick_steps
    for step in must:
        at = bisect.bisect_right(firsts, step) - 1
        if extra and at >= 0 and inside[at].first <= step <= inside[at].last and at not in chosen:
            chosen.add(at)
            extra -= 1
    return [inside[i] for i in sorted(chosen)]


def pick_steps(available: np.ndarray, columns: int, must: Iterable[int] = ()) -> np.ndarray:
    """At most ``columns`` of the sorted ``available`` steps: evenly spaced, plus the must steps."""
    if len(available) <= columns:
        return available
    must = np.intersect1d(np.fromiter(must, dtype=np.int64), available)[: int(columns * MUST_SHARE)]
    spread = available[_spread(len(available), max(1, columns - len(must)))]
    return np.union1d(spread, must)


@dataclass
class Matrix:
    """Rows x steps of one op: values, and MISSING where nothing was recorded."""

    steps: np.ndarray
    values: np.ndarray
    status: np.ndarray
    sampled: bool = False
    skipped: int = 0
    rows: list = field(default_factory=list)


def _fill(blocks: Sequence[Block], op: str, steps: np.ndarray, rows: int, only: int | None = None) -> tuple:
    """Values and status (rows x steps) of ``op``; with ``only``, that row alone (as row 0)."""
    values = np.full((rows, len(steps)), np.nan)
    status = np.full((rows, len(steps)), MISSING, dtype=np.uint8)
    if len(steps) == 0:
        return values, status
    for block in blocks:
        if op not in block.ops or len(block.steps) == 0:
            continue
        column = np.minimum(np.searchsorted(steps, block.steps), len(steps) - 1)
        keep = steps[column] == block.steps
        j = block.ops.index(op)
        if block.present is not None:
            keep &= block.present[:, j]
        if only is None:
            row = block.rows
        else:
            keep &= block.rows == only
            row = np.zeros(len(block.rows), dtype=np.intp)
        values[row[keep], column[keep]] = block.values[keep, j]
        status[row[keep], column[keep]] = PRESENT
    return values, status


def _steps_of(blocks: Sequence[Block], lo: int, hi: int) -> np.ndarray:
    if not blocks:
        return np.zeros(0, dtype=np.int64)
    steps = np.unique(np.concatenate([b.unique_steps for b in blocks]))
    return steps[(steps >= lo) & (steps <= hi)]


def rank_matrix(
    source: Source, prefix: str, op: str, lo: int, hi: int, columns: int, must: Sequence[int] = ()
) -> Matrix:
    """One rank: rows are the data type's rows in model order (those with data in the view)."""
    chunks = source.chunks(prefix)
    picked = pick_chunks(chunks, lo, hi, columns, READ_BUDGET, must)
    blocks = source.load_many(prefix, picked)
    available = _steps_of(blocks, lo, hi)
    steps = pick_steps(available, columns, must)
    table = source.table(prefix)
    values, status = _fill(blocks, op, steps, len(table.keys))
    keep = _model_order(source, prefix, np.flatnonzero((status == PRESENT).any(axis=1)))
    inside = sum(1 for c in chunks if c.last >= lo and c.first <= hi)
    return Matrix(
        steps,
        values[keep],
        status[keep],
        sampled=len(picked) < inside or len(steps) < len(available),
        skipped=sum(b.skipped for b in blocks),
        rows=[table.keys[i] for i in keep],
    )


def _model_order(source: Source, prefix: str, rows: np.ndarray) -> np.ndarray:
    """``rows`` in model order: a data type written in backward order (ROW_ORDER_FROM) takes the
    order of the first data type of its list that the source has; rows it lacks go last."""
    for reference in ROW_ORDER_FROM.get(prefix, ()):
        chunks = source.chunks(reference)
        if not chunks:
            continue
        source.load(reference, chunks[0])
        position = {(k.vpp_stage, k.name): i for i, k in enumerate(source.table(reference).keys)}
        keys = source.table(prefix).keys
        late = len(position)
        order = sorted(
            range(len(rows)),
            key=lambda i: (keys[rows[i]].micro_step, position.get(keys[rows[i]][:2], late + i)),
        )
        return rows[order]
    return rows


def tag_matrix(
    sources: dict[int, Source],
    prefix: str,
    op: str,
    row: RowKey,
    lo: int,
    hi: int,
    columns: int,
    must: Sequence[int] = (),
) -> Matrix:
    """One row (tag) on every rank: rows are ranks; the steps are chosen among those of the ranks
    whose files cover the view's steps (usually the lowest rank alone, see ``_covering``)."""
    ranks = sorted(r for r, s in sources.items() if s.chunks(prefix))
    if not ranks:
        return Matrix(np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros((0, 0), np.uint8))
    found, sampled = [], False
    for rank in _covering(sources, ranks, prefix, lo, hi):
        chunks = sources[rank].chunks(prefix)
        picked = pick_chunks(chunks, lo, hi, columns, READ_BUDGET, must)
        found.append(_steps_of(sources[rank].load_many(prefix, picked), lo, hi))
        sampled |= len(picked) < sum(1 for c in chunks if c.last >= lo and c.first <= hi)
    available = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
    steps = pick_steps(available, columns, must)
    values = np.full((len(ranks), len(steps)), np.nan)
    status = np.full((len(ranks), len(steps)), MISSING, dtype=np.uint8)
    for i, rank in enumerate(ranks):
        source = sources[rank]
        rank_blocks = source.load_many(prefix, [c for c in source.chunks(prefix) if _holds_any(c, steps)])
        number = source.table(prefix).index.get(row)
        if number is not None:
            v, s = _fill(rank_blocks, op, steps, 1, only=number)
            values[i], status[i] = v[0], s[0]
    sampled = sampled or len(steps) < len(available)
    return Matrix(steps, values, status, sampled=sampled, rows=ranks)


def _covering(sources: dict[int, Source], ranks: list[int], prefix: str, lo: int, hi: int) -> list[int]:
    """The lowest rank, and each later rank whose files (by the steps their names give) hold
    steps of [lo, hi] the ranks chosen before it have no file for: a rank missing a window (a
    file lost, a rank that stopped early) does not hide the others' steps."""
    chosen: list[int] = []
    covered: set[tuple[int, int]] = set()
    starts: list[int] = []  # covered spans merged, sorted: starts and their ends
    ends: list[int] = []
    for rank in ranks:
        spans = {
            (max(c.first, lo), min(c.last, hi))
            for c in sources[rank].chunks(prefix)
            if c.last >= lo and c.first <= hi
        }
        if spans <= covered:  # the usual case: the same files' steps as a rank before
            continue
        if chosen and all(_inside(span, starts, ends) for span in spans - covered):
            continue
        chosen.append(rank)
        covered |= spans
        starts, ends = _merged(covered)
    return chosen


def _merged(spans: set[tuple[int, int]]) -> tuple[list[int], list[int]]:
    starts: list[int] = []
    ends: list[int] = []
    for first, last in sorted(spans):
        if starts and first <= ends[-1] + 1:
            ends[-1] = max(ends[-1], last)
        else:
            starts.append(first)
            ends.append(last)
    return starts, ends


def _inside(span: tuple[int, int], starts: list[int], ends: list[int]) -> bool:
    at = bisect.bisect_right(starts, span[0]) - 1
    return at >= 0 and span[1] <= ends[at]


def _holds_any(chunk: Chunk, steps: np.ndarray) -> bool:
    at = np.searchsorted(steps, chunk.first)
    return bool(at < len(steps) and steps[at] <= chunk.last)


def encode(header: dict, matrix: Matrix) -> bytes:
    """``u32 header length | JSON header | pad to 8 | float64 values | uint8 status`` (row major)."""
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    pad = (-(4 + len(text))) % 8
    values = np.ascontiguousarray(matrix.values, dtype="<f8")
    status = np.ascontiguousarray(matrix.status, dtype=np.uint8)
    return b"".join(
        (struct.pack("<I", len(text) + pad), text, b" " * pad, values.tobytes(), status.tobytes())
    )
