"""Statistics of accelerator tensors with torch's own device ops: the host never waits for the
device, and the number of kernel launches does not grow with the number of tensors.

``device_block(tensors, ops, eps)`` turns tensors of one dtype and device into a float64
(len(tensors), len(ops)) matrix on that device. On a GPU each operation costs the host a launch
of several microseconds (tens in a virtual machine), while reading a tensor of a million elements
takes the device about one: one reduction per statistic and tensor made a model's gradients cost
several times its training step. The tensors are therefore packed: copied one after another
into buffers of at most PACK_ELEMENTS elements (then widened to the accumulation type, float32
for half types), each buffer cut into pieces of at most PIECE elements that never span two tensors,
and every statistic of every piece taken by one segmented reduction per buffer; the pieces' rows
then combine into the tensors' rows with one more segmented reduction per statistic. The number
of launches follows the number of buffers (the total size), not the number of tensors. Integer
tensors, rare here, are packed in float64 (exact up to 2**53).

Squares are taken and summed in float64: the host path can take a float32 sum of squares again
in float64 where it lost range, but here reading that verdict would stall the device, and in
float32 vanishing gradients (below 1e-19) get a norm of 0 and huge finite ones Inf. Sums
accumulate in float32 per piece (float64 for float64 tensors) and the pieces combine in float64;
only a piece whose sum passes float32's range (values near 1e34) comes out Inf. ``zeros``
compares in float32 (float64 for float64 tensors), where an eps below the half types' range
still exists; counts of zeros and NaNs are exact (a piece holds fewer than 2**24 elements). Min
and max are NaN wherever a NaN was counted, as numpy has them. Small host values (element
counts, offsets) reach the device through pinned memory without a blocking copy: torch's
blocking host-to-device copy synchronises the stream, which would stop the training thread at
every call until the device caught up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

#: elements of one packed buffer of floating tensors (bounds its copy: 64 MB of float32)
PACK_ELEMENTS = 1 << 24
#: elements of one piece of a packed buffer: many pieces keep a GPU's multiprocessors busy, and
#: a piece's float32 sum and counts stay exact or close
PIECE = 1 << 16
#: what a piece's row holds: min, max, sum ("mean"), sum of squares ("norm"), counts of zeros and NaNs
_PIECE_STATISTICS = ("min", "max", "mean", "norm", "zeros", "nans")
#: how a statistic's pieces reduce (the others are sums)
_REDUCTION = {"min": "min", "max": "max"}
_F64 = torch.float64


def on_device(
    values: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Small host values (a list, an array or a CPU tensor) as a tensor on ``device``, copied
    without making the host wait."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)  # elsewhere a copy from pageable memory must not outlive its source


def device_scalars(values: Sequence[float | torch.Tensor], device: torch.device | None) -> list[torch.Tensor]:
    """Host floats and device 0-d tensors as float64 0-d tensors on ``device``: the floats in one
    copy that does not wait for the device, the tensors as they are."""
    on_host = [k for k, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    scalars = list(values)
    if on_host:
        hosted = on_device([values[k] for k in on_host], _F64, device or torch.device("cpu"))
        for k, scalar in zip(on_host, hosted):
            scalars[k] = scalar
    return scalars


def with_host_columns(matrix: torch.Tensor, columns: np.ndarray) -> torch.Tensor:
    """``matrix`` with host columns (element counts, flags) appended, on its device."""
    return torch.cat([matrix, on_device(columns, matrix.dtype, matrix.device)], dim=1)


def id_column(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The value of each one-element tensor (msprobe's "id" op), NaN for the others."""
    return torch.stack(
        [
            t.reshape(()).to(_F64) if t.numel() == 1 else t.new_full((), float("nan"), dtype=_F64)
            for t in tensors
        ]
    )


def count_nans(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """The number of NaN elements, counted in pieces of ``chunk`` (a 0-d tensor on t's device)."""
    flat = t.reshape(-1)
    parts = [torch.count_nonzero(torch.isnan(piece)) for piece in flat.split(chunk)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 tensors, else float32: what comparisons and host sums are made in."""
    return _F64 if dtype == _F64 else torch.float32


def device_block(
    tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float, laid_out: torch.Tensor | None = None
) -> torch.Tensor:
    """The statistics matrix of non-empty tensors of one dtype and device, packed into buffers
    (see the module). ``laid_out``: the tensors' elements already one after another in one flat
    tensor of the accumulation type (a stager's buffer, the tensors views of it), read there."""
    device = tensors[0].device
    dtype = tensors[0].dtype
    acc = accumulate_dtype(dtype) if dtype.is_floating_point else _F64  # integers: exact to 2**53
    sizes = np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))
    layout = _Layout(sizes)
    minmax = "min" in ops or "max" in ops
    wanted = [op for op in _PIECE_STATISTICS if op in ops or (op == "nans" and minmax)]
    if not wanted:  # msprobe's "id" alone
        return torch.stack([id_column(tensors)], dim=1)
    # every small host value in one copy: each buffer's piece offsets, pieces per tensor, sizes
    facts = on_device(np.concatenate([*layout.offsets, layout.per_tensor, sizes]), torch.long, device)
    pieces = []
    for b, offsets in enumerate(layout.offsets_on(facts)):
        low, high = layout.span(b)
        buffer = _flatten(layout.parts(b, tensors)) if laid_out is None else laid_out[low:high]
        pieces.append(_piece_columns(buffer.to(acc), offsets, wanted, eps))
    rows = _combine(torch.cat(pieces) if len(pieces) > 1 else pieces[0], layout, facts, wanted)
    columns = dict(zip(wanted, rows.unbind(1)))
    numel = facts[-len(sizes) :].to(_F64)
    if "mean" in columns:
        columns["mean"] = columns["mean"] / numel
    if "zeros" in columns:
        columns["zeros"] = columns["zeros"] / numel
    if "norm" in columns:
        columns["norm"] = columns["norm"].sqrt()
    if minmax:  # a NaN makes both NaN, as numpy has them, whatever the segmented reduction did
        seen = columns["nans"] > 0  # (no host value: a blocking copy would wait for the device)
        for op in ("min", "max"):
            columns[op] = columns[op].masked_fill(seen, float("nan"))
    if "id" in ops:
        columns["id"] = id_column(tensors)
    return torch.stack([columns[op] for op in ops], dim=1)


def _flatten(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' elements one after another in a new flat tensor (one that is alone, as it is):
    torch's own flattening of a list (what DDP buckets with) views each part in C++, where a
    Python ``reshape`` per part cost more than the copy of a small one."""
    if len(parts) == 1:
        return parts[0].reshape(-1)
    return _flatten_dense_tensors(parts)


class _Layout:
    """Where the tensors' elements lie when packed: one after another, cut into buffers of
    PACK_ELEMENTS, and into pieces of at most PIECE that never span two tensors or buffers."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes
        self.starts = np.cumsum(sizes) - sizes
        self.total = int(sizes.sum())
        count = -(-sizes // PIECE)
        within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        cuts = np.repeat(self.starts, count) + within * PIECE
        cuts = np.union1d(cuts, np.arange(PACK_ELEMENTS, self.total, PACK_ELEMENTS))
        self.owner = np.searchsorted(self.starts, cuts, side="right") - 1
        buffer = cuts // PACK_ELEMENTS
        self.bounds = np.searchsorted(buffer, np.arange(int(buffer[-1]) + 2))
        lengths = np.diff(np.append(cuts, self.total))
        self.offsets = [
            np.concatenate(([0], np.cumsum(lengths[low:high])))
            for low, high in zip(self.bounds[:-1], self.bounds[1:])
        ]
        self.per_tensor = np.bincount(self.owner, minlength=len(sizes))
        #: the tensor a buffer's edge cuts, flattened: ``(index, flat)``
        self._cut: tuple[int, torch.Tensor] | None = None

    def offsets_on(self, facts: torch.Tensor) -> list[torch.Tensor]:
        """Each buffer's piece offsets, as views of the device copy of the host values."""
        views, at = [], 0
        for offsets in self.offsets:
            views.append(facts[at : at + len(offsets)])
            at += len(offsets)
        return views

    def span(self, b: int) -> tuple[int, int]:
        """Buffer ``b``'s elements in the packed order."""
        return b * PACK_ELEMENTS, min((b + 1) * PACK_ELEMENTS, self.total)

    def parts(self, b: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Buffer ``b``'s tensors: whole, or the piece of one that a buffer's edge cuts (such a
        tensor flattened once for all its buffers: a non-contiguous one is copied then)."""
        low, high = self.span(b)
        first = int(self.owner[self.bounds[b]])
        last = int(self.owner[self.bounds[b + 1] - 1])
        parts = list(tensors[first : last + 1])
        for k in {0, len(parts) - 1}:
            i = first + k
            start, stop = int(self.starts[i]), int(self.starts[i] + self.sizes[i])
            if start < low or stop > high:
                if self._cut is None or self._cut[0] != i:
                    self._cut = (i, parts[k].reshape(-1))
                parts[k] = self._cut[1][max(start, low) - start : min(stop, high) - start]
        return parts


def _piece_columns(
    buffer: torch.Tensor, offsets: torch.Tensor, wanted: list[str], eps: float
) -> torch.Tensor:
    """Per piece of a flat buffer, one float64 column per ``wanted`` statistic: min, max, sum
    ("mean"), sum of squares ("norm"), the count below eps ("zeros") and of NaNs ("nans"); one
    reduction each."""
    columns = []
    for op in wanted:
        if op == "zeros":
            values = buffer.abs().lt_(eps)  # 1.0 where below eps, in the buffer's type
        elif op == "nans":
            values = torch.isnan(buffer).to(buffer.dtype)
        elif op == "norm":  # squares in float64: vanishing values keep their norm, huge ones stay finite
            values = buffer.to(_F64, copy=True).square_()  # a copy even of a float64 tensor's own data
        else:
            values = buffer
        columns.append(torch.segment_reduce(values, _REDUCTION.get(op, "sum"), offsets=offsets, unsafe=True))
    return torch.stack(columns, dim=1).to(_F64)


def _combine(pieces: torch.Tensor, layout: _Layout, facts: torch.Tensor, wanted: list[str]) -> torch.Tensor:
    """The tensors' rows from their pieces' rows (min of minima, max of maxima, sums of the rest)."""
    tensors = len(layout.sizes)
    if len(layout.owner) == tensors:  # one piece each: the pieces are the tensors
        return pieces
    lengths = facts[-2 * tensors : -tensors]
    columns = [
        torch.segment_reduce(pieces[:, k], _REDUCTION.get(op, "sum"), lengths=lengths, unsafe=True)
        for k, op in enumerate(wanted)
    ]
    return torch.stack(columns, dim=1)
