"""Statistics of accelerator tensors with torch's own device ops: the host never waits for the
device, and the number of kernel launches does not grow with the number of small tensors.

``device_block(tensors, ops, eps)`` turns tensors of one dtype and device into a float64
(len(tensors), len(ops)) matrix on that device. Tensors of at most STACKED (64K) elements that
share their size (every layer's biases and norm weights, a model of many small layers or
experts) are stacked into matrices of at most STACK_ELEMENTS elements and reduced row by row: a
handful of kernels for any number of them, where one reduction per statistic and tensor launches
five or six kernels per tensor, each costing the host microseconds. Larger tensors (an expert's
weight of millions of elements among them) get their own reductions, whose launch costs little
beside reading them, and one fused norm over their list.

Sums of squares accumulate in float64 (torch's fused norm over a list widens each element as it
reads it): the host path can take a float32 sum of squares again in float64 where it lost range,
but here reading that verdict would stall the device, and in float32 vanishing gradients (below
1e-19) get a norm of 0 and huge finite ones Inf. Sums accumulate in float32 per COUNT_CHUNK
elements (float64 for float64 and integer tensors), the pieces combined in float64: torch widens
a whole tensor first where the sum's type differs from its accumulator's, a copy of up to four
times the tensor. ``zeros`` compares in float32 (float64 for float64 tensors), where an eps below
the half types' range still exists. Small host values (element counts, row indices) reach the
device through pinned memory without a blocking copy: torch's blocking host-to-device copy
synchronises the stream, which would stop the training thread at every call until the device
caught up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: elements per piece of the counting ops (bounds their temporaries)
COUNT_CHUNK = 1 << 24
#: a tensor of at most this many elements is stacked with its same-sized peers
STACKED = 1 << 16
#: elements of one stacked matrix (bounds its copy: 64 MB of float32)
STACK_ELEMENTS = 1 << 24
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


def _summed_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a sum accumulates in: float32 for the float types torch reads as they are (fp32, and
    the half types it widens to fp32 in registers), float64 for float64 and integers (exact)."""
    return torch.float32 if dtype.is_floating_point and dtype != _F64 else _F64


def _sum(t: torch.Tensor) -> torch.Tensor:
    """A float64 0-d sum of ``t``, its pieces of COUNT_CHUNK elements summed in ``_summed_dtype``."""
    acc = _summed_dtype(t.dtype)
    pieces = t.reshape(-1).split(COUNT_CHUNK)
    if len(pieces) == 1:
        return pieces[0].sum(dtype=acc).to(_F64)
    return torch.stack([piece.sum(dtype=acc) for piece in pieces]).to(_F64).sum()


def device_block(tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """The statistics matrix of non-empty tensors of one dtype and device (see the module)."""
    by_size: dict[int, list[int]] = {}
    alone: list[int] = []
    for i, t in enumerate(tensors):
        if t.numel() <= STACKED:
            by_size.setdefault(t.numel(), []).append(i)
        else:
            alone.append(i)
    parts: list[tuple[list[int], torch.Tensor]] = []
    for size, index in by_size.items():
        if len(index) == 1:
            alone.extend(index)
            continue
        rows = max(1, STACK_ELEMENTS // size)
        for start in range(0, len(index), rows):
            chosen = index[start : start + rows]
            matrix = torch.stack([tensors[i].reshape(-1) for i in chosen])
            parts.append((chosen, _row_columns(matrix, ops, eps)))
    if alone:
        parts.append((alone, _tensor_columns([tensors[i] for i in alone], ops, eps)))
    if len(parts) == 1 and len(parts[0][0]) == len(tensors) and parts[0][0] == sorted(parts[0][0]):
        return parts[0][1]
    device = tensors[0].device
    order = on_device([i for index, _ in parts for i in index], torch.long, device)
    out = torch.empty((len(tensors), len(ops)), dtype=_F64, device=device)
    return out.index_copy_(0, order, torch.cat([block for _, block in parts]))


def _row_columns(matrix: torch.Tensor, ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """Statistics of each row of a (tensors, elements) matrix: one reduction per op."""
    floating = matrix.is_floating_point()
    size = matrix.shape[1]
    columns: dict[str, torch.Tensor] = {}
    if "norm" in ops:
        columns["norm"] = torch.linalg.vector_norm(matrix if floating else matrix.to(_F64), dim=1, dtype=_F64)
    if "min" in ops or "max" in ops:
        low, high = torch.aminmax(matrix, dim=1)
        columns["min"], columns["max"] = low.to(_F64), high.to(_F64)
    if "mean" in ops:
        columns["mean"] = matrix.sum(dim=1, dtype=_summed_dtype(matrix.dtype)).to(_F64).div_(size)
    if "zeros" in ops:
        compared = accumulate_dtype(matrix.dtype)
        small = (matrix.abs() if matrix.dtype == compared else matrix.to(compared).abs_()) < eps
        columns["zeros"] = torch.count_nonzero(small, dim=1).to(_F64).div_(size)
    if "nans" in ops:
        if floating:
            columns["nans"] = torch.count_nonzero(torch.isnan(matrix), dim=1).to(_F64)
        else:
            columns["nans"] = matrix.new_zeros(matrix.shape[0], dtype=_F64)
    if "id" in ops:
        columns["id"] = (
            matrix[:, 0].to(_F64) if size == 1 else matrix.new_full((len(matrix),), float("nan"), dtype=_F64)
        )
    return torch.stack([columns[op] for op in ops], dim=1)


def _tensor_columns(tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """Statistics of tensors of any sizes: a fused norm over the list, the rest tensor by tensor."""
    floating = tensors[0].is_floating_point()
    device = tensors[0].device
    columns: dict[str, torch.Tensor] = {}
    if "norm" in ops:
        if floating:  # contiguous, as the fused kernel takes them (else torch widens each whole)
            flats = [t if t.is_contiguous() else t.reshape(-1) for t in tensors]
            norms = torch._foreach_norm(flats, 2, dtype=_F64)
        else:
            norms = [torch.linalg.vector_norm(t.to(_F64)) for t in tensors]
        columns["norm"] = torch.stack(norms)
    if "min" in ops or "max" in ops:
        pairs = [torch.aminmax(t) for t in tensors]
        columns["min"] = torch.stack([p.min for p in pairs]).to(_F64)
        columns["max"] = torch.stack([p.max for p in pairs]).to(_F64)
    if "mean" in ops or "zeros" in ops:  # one tensor (an activation's hook) needs no host copy
        sizes = [t.numel() for t in tensors]
        numel = float(sizes[0]) if len(sizes) == 1 else on_device(sizes, _F64, device)
    if "mean" in ops:
        columns["mean"] = torch.stack([_sum(t) for t in tensors]) / numel
    if "zeros" in ops:
        compared = accumulate_dtype(tensors[0].dtype)
        counts = []
        for t in tensors:
            pieces = t.reshape(-1).split(COUNT_CHUNK)
            found = [
                torch.count_nonzero((p.abs() if p.dtype == compared else p.to(compared).abs_()) < eps)
                for p in pieces
            ]
            counts.append(found[0] if len(found) == 1 else torch.stack(found).sum())
        columns["zeros"] = torch.stack(counts).to(_F64) / numel
    if "nans" in ops:
        if floating:
            columns["nans"] = torch.stack([count_nans(t, COUNT_CHUNK) for t in tensors]).to(_F64)
        else:
            columns["nans"] = torch.zeros(len(tensors), dtype=_F64, device=device)
    if "id" in ops:
        columns["id"] = id_column(tensors)
    return torch.stack([columns[op] for op in ops], dim=1)
