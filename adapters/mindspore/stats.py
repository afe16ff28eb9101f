"""Statistics of many MindSpore tensors at once, on their device, for one host copy per call.

``StatEngine(ops, eps).matrix(tensors)`` returns a float64 Tensor (len(tensors), len(ops)) on
the tensors' device; ``.asnumpy()`` of it is the one device-to-host copy of all those tensors.

PyNative launches every operation separately, so the cost is the number of operations, not the
number of elements, for the small and medium tensors that dominate a model's parameter list.
The engine therefore works on *units*:

* small tensors (up to ``PACK_MAX`` elements) of one dtype are packed, flattened
  and concatenated, up to ``GROUP`` elements per pack, and reduced with segment operations
  (``unsorted_segment_sum/min/max``): a constant number of operations per pack, whatever the
  number of tensors in it (segment ids are built once per pack layout and kept);
* larger tensors are reduced on their own, in pieces of at most ``CHUNK`` elements.

Each unit gives partial rows (sum of squares, min, max, sum, NaN count, near-zero count) in the
accumulation type -- float32 for float32, float16, bfloat16 and integer tensors, float64 for
float64 ones -- which become float64 and, for tensors split into pieces, are combined. Half and
integer tensors are cast one unit at a time, so temporaries stay bounded (about GROUP or CHUNK
elements) and no whole-tensor float64 copy is ever made.

NaN/Inf policy (as the torch adapter's): min, max, norm and mean come out as numpy gives them on
the same data (MindSpore's min/max skip NaN and its segment min/max turn an all-infinite
segment into the largest finite value, so NaN and infinity counts put them back); ``nans`` counts
NaN elements; ``zeros`` is the share of ``|x| < eps``; empty tensors give NaN for
min/max/mean/zeros and 0 for norm/nans; ``id`` is the value of a one-element tensor, else NaN.
Nothing here raises on non-finite values. The sum of squares is accumulated in the accumulation
type, so a float32 norm above about 1.8e19 overflows to inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from monitor.errors import of_the_training
from monitor.stats.host_stats import array_matrix

#: tensors up to this many elements are packed with others.
PACK_MAX = 1 << 16
#: elements per pack.
GROUP = 1 << 22
#: elements per piece of a large tensor (keeps counts exact in float32 and temporaries bounded).
CHUNK = 1 << 24
#: pack layouts whose segment ids are kept on the device.
MAX_LAYOUTS = 64
_EMPTY_VALUE = {"norm": 0.0, "nans": 0.0}
_SEGMENT = {"min": ops.unsorted_segment_min, "max": ops.unsorted_segment_max}


def _numel(t: ms.Tensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64))


def _accumulate_dtype(dtype: ms.dtype) -> ms.dtype:
    return ms.float64 if dtype == ms.float64 else ms.float32


def _partials_needed(ops_: Sequence[str]) -> tuple[str, ...]:
    needs = set()
    if "norm" in ops_:
        needs.add("sq")
    if {"min", "max", "id"} & set(ops_):
        # NaN and infinity counts restore numpy's results where MindSpore's reductions differ
        needs |= {"min", "max", "nans", "posinf", "neginf"}
    if "mean" in ops_:
        needs.add("sum")
    if "zeros" in ops_:
        needs.add("zeros")
    if "nans" in ops_:
        needs.add("nans")
    return tuple(n for n in ("sq", "min", "max", "sum", "nans", "posinf", "neginf", "zeros") if n in needs)


class _Unit:
    """Pieces of one or more tensors reduced together: a pack (with segment ids) or one piece."""

    def __init__(self, acc: ms.dtype) -> None:
        self.acc = acc
        self.rows: list[int] = []
        self.pieces: list[list[ms.Tensor]] = []
        self.sizes: list[int] = []
        self.total = 0

    def add(self, row: int, pieces: list[ms.Tensor], size: int) -> None:
        self.rows.append(row)
        self.pieces.append(pieces)
        self.sizes.append(size)
        self.total += size

    def flat(self, k: int) -> ms.Tensor:
        """The k-th tensor list's pieces of this unit, flattened and concatenated, in ``acc``."""
        parts = [p[k] if p[k].ndim == 1 else p[k].reshape(-1) for p in self.pieces]
        flat = parts[0] if len(parts) == 1 else ops.concat(parts)
        return flat if flat.dtype == self.acc else flat.astype(self.acc)


def _units(tensor_lists: Sequence[Sequence[ms.Tensor]]) -> tuple[list[_Unit], list[int]]:
    """Packs and pieces of the non-empty tensors (parallel lists are cut alike); empty rows."""
    units: list[_Unit] = []
    open_packs: dict[ms.dtype, _Unit] = {}
    empty: list[int] = []
    for row, group in enumerate(zip(*tensor_lists)):
        numel = _numel(group[0])
        if numel == 0:
            empty.append(row)
            continue
        dtype = group[0].dtype
        acc = _accumulate_dtype(dtype)
        if numel <= PACK_MAX:
            pack = open_packs.get(dtype)
            if pack is None or pack.total + numel > GROUP:
                pack = open_packs[dtype] = _Unit(acc)
                units.append(pack)
            pack.add(row, list(group), numel)
            continue
        flats = [t.reshape(-1) for t in group]
        for start in range(0, numel, CHUNK):
            unit = _Unit(acc)
            stop = min(start + CHUNK, numel)
            pieces = flats if stop - start == numel else [f[start:stop] for f in flats]
            unit.add(row, pieces, stop - start)
            units.append(unit)
    return units, empty


def host_memory() -> bool:
    """Whether tensors live in host memory: the CPU back-end."""
    return ms.get_context("device_target") == "CPU"


class StatEngine:
    """Computes the configured statistics for lists of tensors; keeps segment ids per pack layout."""

    def __init__(self, ops_: Sequence[str], eps: float) -> None:
        self.ops = tuple(ops_)
        self.eps = eps
        self.needs = _partials_needed(self.ops)
        self._ids: dict[tuple[int, ...], ms.Tensor] = {}
        #: tensors live in host memory (the CPU back-end): reduce their numpy views
        self.host = host_memory()

    # -- units -------------------------------------------------------------------------------

    def _segment_ids(self, sizes: list[int]) -> ms.Tensor | None:
        if len(sizes) == 1:
            return None
        key = tuple(sizes)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= MAX_LAYOUTS:  # layouts are fixed per data type; this never grows far
                self._ids.clear()
            ids = self._ids[key] = ms.Tensor(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
        return ids

    def _reduce(self, kind: str, x: ms.Tensor, ids: ms.Tensor | None, count: int) -> ms.Tensor:
        if ids is None:
            return {"sum": mint.sum, "min": mint.min, "max": mint.max}[kind](x).reshape(1)
        return _SEGMENT.get(kind, ops.unsorted_segment_sum)(x, ids, count)

    def _unit_partials(self, unit: _Unit) -> ms.Tensor:
        """(segments, len(needs)) float64 partial results of one unit."""
        flat, ids, count = unit.flat(0), self._segment_ids(unit.sizes), len(unit.rows)
        columns = []
        for need in self.needs:
            if need == "sq":
                columns.append(self._reduce("sum", mint.square(flat), ids, count))
            elif need in ("min", "max", "sum"):
                columns.append(self._reduce(need, flat, ids, count))
            elif need == "nans":
                columns.append(self._reduce("sum", mint.isnan(flat).astype(unit.acc), ids, count))
            elif need in ("posinf", "neginf"):
                infinite = mint.eq(flat, float("inf") if need == "posinf" else float("-inf"))
                columns.append(self._reduce("sum", infinite.astype(unit.acc), ids, count))
            else:
                near_zero = mint.lt(mint.abs(flat), self.eps).astype(unit.acc)
                columns.append(self._reduce("sum", near_zero, ids, count))
        return ops.stack(columns, axis=1).astype(ms.float64)

    @staticmethod
    def _combine(
        partials: list[ms.Tensor], rows: list[int], kinds: Sequence[str]
    ) -> tuple[ms.Tensor, list[int]]:
        """Stack the units' partial rows; rows split into pieces are combined. Returns rows in order."""
        stacked = partials[0] if len(partials) == 1 else ops.concat(partials)
        if len(set(rows)) == len(rows):
            return stacked, rows
        distinct = list(dict.fromkeys(rows))
        where = {row: i for i, row in enumerate(distinct)}
        ids = ms.Tensor(np.array([where[r] for r in rows], dtype=np.int32))
        columns = [
            _SEGMENT.get(kind, ops.unsorted_segment_sum)(stacked[:, j], ids, len(distinct))
            for j, kind in enumerate(kinds)
        ]
        return ops.stack(columns, axis=1), distinct

    # -- public ------------------------------------------------------------------------------

    def matrix(self, tensors: Sequence[ms.Tensor]) -> ms.Tensor:
        """Statistics (rows: tensors, columns: ops) as one float64 Tensor on the tensors' device.

        On the CPU back-end the tensors are host memory and ``asnumpy()`` is a view of it: the
        one-pass kernel reads them all in one call (``monitor.stats.host_stats``), with no operator
        launch per statistic.
        """
        if not tensors:
            return ms.Tensor(np.empty((0, len(self.ops)), dtype=np.float64))
        if self.host:
            arrays = [training_values(t) for t in tensors]
            return ms.Tensor(array_matrix(arrays, self.ops, self.eps))
        units, empty = _units([tensors])
        block, rows = None, []
        if units:
            partials = [self._unit_partials(unit) for unit in units]
            unit_rows = [row for unit in units for row in unit.rows]
            block, rows = self._combine(partials, unit_rows, self.needs)
            numel = [_numel(tensors[r]) for r in rows]
            block = self._finish(block, numel)
        return self._in_order(block, rows, empty, len(tensors))

    def _finish(self, partial: ms.Tensor, numel: list[int]) -> ms.Tensor:
        """(rows, ops) float64 statistics from (rows, needs) float64 partial results."""
        column = {need: partial[:, j] for j, need in enumerate(self.needs)}
        count = ms.Tensor(np.array(numel, dtype=np.float64))
        nan = ms.Tensor(float("nan"), ms.float64)
        if "min" in column:
            # segment min/max start from the largest finite value: all-infinite segments need help
            inf = ms.Tensor(float("inf"), ms.float64)
            column["min"] = mint.where(column["posinf"] == count, inf, column["min"])
            column["max"] = mint.where(column["neginf"] == count, -inf, column["max"])
            has_nan = column["nans"] > 0
            column["min"] = mint.where(has_nan, nan, column["min"])
            column["max"] = mint.where(has_nan, nan, column["max"])
        out = []
        for op in self.ops:
            if op == "norm":
                out.append(mint.sqrt(column["sq"]))
            elif op in ("min", "max", "nans"):
                out.append(column[op])
            elif op == "mean":
                out.append(column["sum"] / count)
            elif op == "zeros":
                out.append(column["zeros"] / count)
            elif op == "id":
                single = ms.Tensor(np.array(numel) == 1)
                out.append(mint.where(single, column["min"], nan))
            else:
                raise ValueError(f"unknown statistic {op!r}")
        return ops.stack(out, axis=1)

    def _in_order(self, block: ms.Tensor | None, rows: list[int], empty: list[int], n: int) -> ms.Tensor:
        """Put the computed rows and the constant rows of empty tensors into input order."""
        if empty:
            constant = [_EMPTY_VALUE.get(op, float("nan")) for op in self.ops]
            filler = ms.Tensor(np.array([constant] * len(empty), dtype=np.float64))
            block = filler if block is None else ops.concat([block, filler])
            rows = rows + empty
        if rows == list(range(n)):
            return block
        inverse = np.argsort(np.array(rows)).astype(np.int32)
        return ops.gather(block, ms.Tensor(inverse), 0)

    def sign_agreement(self, grads: Sequence[ms.Tensor], moments: Sequence[ms.Tensor]) -> ms.Tensor:
        """Per pair, the share of elements whose signs agree, ``(mean(sign(g) * sign(m)) + 1) / 2``.

        Returns a float64 (len(grads),) Tensor; pairs must have equal, non-zero sizes.
        """
        units, empty = _units([grads, moments])
        if empty:
            raise ValueError("sign_agreement: empty tensors have no sign agreement")
        partials = []
        for unit in units:
            product = mint.sign(unit.flat(0)) * mint.sign(unit.flat(1))
            ids = self._segment_ids(unit.sizes)
            total = self._reduce("sum", product, ids, len(unit.rows))
            partials.append(total.astype(ms.float64).reshape(-1, 1))
        rows = [row for unit in units for row in unit.rows]
        sums, rows = self._combine(partials, rows, ("sum",))
        sums = sums[:, 0]
        count = ms.Tensor(np.array([_numel(grads[r]) for r in rows], dtype=np.float64))
        share = (sums / count + 1.0) / 2.0
        if rows == list(range(len(grads))):
            return share
        return ops.gather(share, ms.Tensor(np.argsort(np.array(rows)).astype(np.int32)), 0)

    def scalar_matrix(self, values: ms.Tensor) -> ms.Tensor:
        """Statistics of one-element tensors given as a float64 vector: (len(values), ops)."""
        zero_like = mint.lt(mint.abs(values), self.eps).astype(ms.float64)
        columns = {
            "norm": mint.abs(values),
            "zeros": zero_like,
            "nans": mint.isnan(values).astype(ms.float64),
        }
        return ops.stack([columns.get(op, values) for op in self.ops], axis=1)


def training_values(tensor: ms.Tensor) -> np.ndarray:
    """``asnumpy()`` of a tensor the training computed: MindSpore reports a failing kernel of the
    training at the first read of its result, which may be this one; that error is the
    training's (``errors.of_the_training``), raised on to it."""
    try:
        return tensor.asnumpy()
    except RuntimeError as exc:
        raise of_the_training(exc) from None
