"""Statistics of many tensors at once, on their device, stacked for one host copy.

``stat_matrix(tensors, ops, eps)`` returns a float64 tensor (len(tensors), len(ops)) on the
tensors' device. No whole-tensor float64 (or, for half types, float32) copy is ever made.

CPU: floating tensors go through one pass of the C kernel (monitor.stats.fused_stats: min, max,
sum, sum of squares and the zero count together) when min, max or zeros are asked for, read where
they lie (adapters.torch.in_place); fp16 is upcast to fp32 in cache-sized chunks (CPU_CHUNK
elements) into a reused buffer first. Without the kernel, and for integer types, each chunk gets
one library call per statistic while it is in cache.
Sums accumulate in fp32 per chunk (fp64 for fp64 inputs) and chunks combine in float64. NaNs
are counted only in tensors whose sum of squares (or sum, or min/max) came out non-finite: a
finite one proves there is no NaN, and on the CPU reading that verdict costs nothing.

Per-tensor cost: the kernel takes the addresses of a whole list of tensors in one call
(``fused_stats.stats_many``) and one tensor's address in a hook (``stats_at``); the matrix is
derived column-wise with numpy. One-at-a-time rows (a hook per parameter) gather in
adapters.torch.row_buffer without a Python object each.

Accelerators: adapters.torch.device_stats (tensors packed into a few buffers, each statistic of
each buffer one segmented reduction; squares in float64, sums in float32 pieces combined in
float64) and, for a hook's tensor, adapters.torch.staged_stats (copied at the hook, measured with
its peers later); no host synchronisation.

NaN/Inf policy: min, max, norm and mean propagate NaN/Inf exactly as numpy does on the same
data; ``nans`` counts NaN elements; empty tensors give NaN for min/max/mean/zeros and 0 for
norm/nans. Nothing here raises on non-finite values. ``zeros`` compares |x| with eps in fp32
(fp64 for fp64 inputs), so an eps below the half types' range still counts their zeros.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from adapters.torch.device_stats import accumulate_dtype, count_nans, device_block, id_column, on_device
from adapters.torch.in_place import KINDS, PLAIN, in_place, kernel_parts, kernel_sweep, kernel_tuple
from adapters.torch.staged_stats import StagedRow, stacked_rows, staged_row
from monitor.stats import fused_stats
from monitor.stats.host_stats import EMPTY_VALUE, columns, float32_sums_lost, kernel_row, probe_index

#: CPU: elements per cache-resident chunk (512 KiB of fp32).
CPU_CHUNK = 1 << 17
_F64 = torch.float64
_BUFFERS = threading.local()


def _scratch(dtype: torch.dtype, numel: int, slot: int) -> torch.Tensor:
    """A reused per-thread buffer of at least ``numel`` elements (no page faults per call)."""
    buffers = _BUFFERS.__dict__.setdefault("by_key", {})
    buffer = buffers.get((dtype, slot))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(dtype, slot)] = torch.empty(max(numel, 1024), dtype=dtype)
    return buffer[:numel]


def _fused_pays(ops: tuple[str, ...], dtype: torch.dtype) -> bool:
    """Whether the fused pass beats library calls: where the library needs several passes
    (min/max, the zero count) or a widening copy (bf16, which the kernel widens in registers)."""
    return "min" in ops or "max" in ops or "zeros" in ops or dtype == torch.bfloat16


def _cpu_block(tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """CPU tensors of one dtype: each read once (fused kernel) or chunk by chunk while in cache.
    Tensor subclasses (a collective's result still in flight) go through torch's own ops."""
    first = tensors[0]
    if (
        first.is_floating_point()
        and _fused_pays(ops, first.dtype)
        and fused_stats.available()
        and all(type(t) in PLAIN for t in tensors)
    ):
        parts = _fused_parts(tensors, eps)
    else:
        parts = _library_parts(tensors, ops, eps)
    numel = np.fromiter((t.numel() for t in tensors), dtype=np.float64, count=len(tensors))
    identity = id_column(tensors).numpy() if "id" in ops else None
    return torch.from_numpy(columns(parts, numel, ops, identity))


def _fused_parts(tensors: Sequence[torch.Tensor], eps: float) -> np.ndarray:
    """(min, max, sum, sum of squares, zero count, NaN count) per tensor from the one-pass kernel.

    fp32/fp64 and bf16 tensors are read in place (bf16 is widened in registers), all of them in
    one call; fp16 is upcast chunk by chunk into a reused fp32 buffer. Either way the comparison
    with eps happens in fp32, where a small eps still exists.
    """
    first = tensors[0]
    kind = KINDS.get(first.dtype)
    if kind is not None:
        flats = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # alive during the call
        return kernel_parts(kind, [t.data_ptr() for t in flats], [t.numel() for t in flats], eps)
    upcast = _scratch(torch.float32, min(CPU_CHUNK, max(t.numel() for t in tensors)), 0)
    parts = []
    for t in tensors:
        pieces = [
            fused_stats.stats(upcast[: chunk.numel()].copy_(chunk).numpy(), eps)
            for chunk in t.detach().reshape(-1).split(CPU_CHUNK)
        ]
        parts.append(pieces[0] if len(pieces) == 1 else _fold(pieces))
    return np.array(parts, dtype=np.float64)


def _fold(pieces: list[tuple]) -> tuple:
    """One tensor's statistics from those of its chunks (NaN, once in a chunk, stays)."""
    lows, highs, totals, squares, smalls, nans = zip(*pieces)
    return (float(np.min(lows)), float(np.max(highs)), sum(totals), sum(squares), sum(smalls), sum(nans))


def _library_parts(tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float) -> np.ndarray:
    """The same per-tensor statistics from library calls, chunk by chunk while each is in cache:
    without the C extension, and for integer types. NaNs are counted only where the statistic
    that proves their absence (sum of squares, else sum, else min + max) is not finite."""
    first = tensors[0]
    floating = first.is_floating_point()
    minmax = "min" in ops or "max" in ops
    sums = "mean" in ops
    squares = "norm" in ops or ("nans" in ops and floating and not (minmax or sums))
    zeros = "zeros" in ops
    acc = accumulate_dtype(first.dtype)
    size = min(CPU_CHUNK, max(t.numel() for t in tensors))
    # half types are read as they are where the library accumulates in fp32 by itself (sum and
    # norm); an upcast copy is made only for the element-wise comparisons and for integers
    copied = minmax or zeros or (not floating and (sums or squares))
    upcast = None if first.dtype == acc or not copied else _scratch(acc, size, 0)
    absolute = _scratch(acc, size, 1) if zeros else None
    parts = []
    for t in tensors:
        flat = t.detach().contiguous().view(-1)
        lows, highs = [], []
        total = squared = small = 0.0
        for chunk in (flat,) if flat.numel() <= CPU_CHUNK else flat.split(CPU_CHUNK):
            values = chunk if upcast is None else upcast[: chunk.numel()].copy_(chunk)
            if minmax:
                if floating:  # numpy's min/max are vectorised; NaN propagates as in numpy
                    array = values.numpy()
                    lows.append(array.min())
                    highs.append(array.max())
                else:  # integers: exact, whatever their size
                    pair = torch.aminmax(chunk if chunk.dtype != torch.bool else values)
                    lows.append(pair.min.item())
                    highs.append(pair.max.item())
            if sums:
                total += values.sum(dtype=acc).item()
            if squares:
                if values.dtype == acc:
                    squared += torch.dot(values, values).item()
                else:
                    squared += torch.linalg.vector_norm(values, dtype=acc).item() ** 2
            if zeros:
                part = absolute[: chunk.numel()]
                torch.abs(values, out=part)
                small += part.lt_(eps).sum().item()  # 0/1 in acc: exact below 2**24 per chunk
        low = float(np.min(lows)) if lows else 0.0
        high = float(np.max(highs)) if highs else 0.0
        if floating and acc != _F64:
            finite = (
                math.isfinite(low) and math.isfinite(high) if minmax else functools.partial(_all_finite, flat)
            )
            nonzero = squares and ((low, high) != (0.0, 0.0) if minmax else squared > 0)
            if float32_sums_lost(total, squared, flat.numel(), finite, nonzero):
                total, squared = _double_sums(flat)
        nans = 0.0
        if "nans" in ops and floating:
            witness = squared if squares else total if sums else low + high
            if not math.isfinite(witness):
                nans = float(count_nans(t, CPU_CHUNK))
        parts.append((low, high, total, squared, small, nans))
    return np.array(parts, dtype=np.float64)


def _all_finite(flat: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf (a pass over it: asked only where a sum is not finite)."""
    return bool(torch.isfinite(flat).all())


def _double_sums(flat: torch.Tensor) -> tuple[float, float]:
    """Sum and sum of squares of a flat floating tensor in float64, chunk by chunk, as the
    reference takes them (where the accumulation type overflowed on finite values)."""
    total = squared = 0.0
    for chunk in flat.split(CPU_CHUNK):
        wide = chunk.to(_F64)
        total += wide.sum().item()
        squared += torch.dot(wide, wide).item()
    return total, squared


def _group_columns(tensors: Sequence[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """The (len(tensors), len(ops)) block of non-empty tensors that share a dtype and device."""
    if tensors[0].device.type == "cpu":
        return _cpu_block(tensors, ops, eps)
    return device_block(tensors, ops, eps)


@torch.no_grad()
def stat_matrix(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float = 1e-8) -> torch.Tensor:
    """Statistics (rows: tensors, columns: ops) as one float64 tensor on the tensors' device.

    Runs without autograd, so callers need not detach each tensor (one object per tensor less)."""
    ops = tuple(ops)
    if not tensors:
        return torch.empty((0, len(ops)), dtype=_F64)
    swept = kernel_sweep(tensors) if "id" not in ops and _fused_pays(ops, tensors[0].dtype) else None
    if swept is not None:  # the common case on the CPU, in one sweep
        kind, addresses, counts = swept
        parts = kernel_parts(kind, addresses, counts, eps)
        return torch.from_numpy(columns(parts, np.array(counts, dtype=np.float64), ops))
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    empty = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            empty.append(i)
        else:
            groups.setdefault((t.dtype, t.device), []).append(i)
    if not empty and len(groups) == 1:  # the common case: one dtype, one device, nothing empty
        return _group_columns(tensors, ops, eps)
    device = tensors[0].device
    out = torch.empty((len(tensors), len(ops)), dtype=_F64, device=device)
    if empty:
        empty_row = [EMPTY_VALUE.get(op, float("nan")) for op in ops]
        out.index_copy_(
            0, on_device(empty, torch.long, device), on_device([empty_row] * len(empty), _F64, device)
        )
    for index in groups.values():
        block = _group_columns([tensors[i] for i in index], ops, eps)
        if block.device != device:
            block = on_device(block, _F64, device) if block.device.type == "cpu" else block.to(device)
        out.index_copy_(0, on_device(index, torch.long, device), block)
    return out


def still_measured(
    rows: torch.Tensor, tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float
) -> bool:
    """Whether ``rows``, the statistics measured earlier of ``tensors`` (same tensors, same
    versions), still hold. torch's in-place kernels bump a tensor's version, which is how a
    change is seen otherwise; a few write without: a loss scaler's unscaling
    (``GradScaler.unscale_``) and anything done through ``.data``. Those rescale every gradient
    alike, which one tensor measured again shows (``probe_index``). Rows on an accelerator are
    never reused: measuring there again costs less than the host sync a comparison would need."""
    if rows.device.type != "cpu":
        return False
    probe = probe_index(rows.numpy(), ops, [t.numel() for t in tensors])
    if probe is None:
        return False
    again = stat_matrix([tensors[probe]], ops, eps)[0].to(rows.device)
    return bool(torch.allclose(again, rows[probe], rtol=1e-6, atol=0.0, equal_nan=True))


def sign_shares(grads: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> list[float | torch.Tensor]:
    """Per pair of equal-sized, non-empty tensors, the share of elements whose signs agree,
    ``(mean(sign(g) * sign(m)) + 1) / 2`` (a NaN's sign is 0, as torch.sign has it): a float for the pairs
    the kernel reads in place (one call for all of them, no sign tensors), else a float64 0-d
    tensor on the device (no host synchronisation)."""
    shares: list[float | torch.Tensor | None] = [None] * len(grads)
    direct: dict[int, list] = {}
    for k, (grad, moment) in enumerate(zip(grads, moments)):
        first, second = in_place(grad), in_place(moment)
        if first is not None and second is not None and first[1] == second[1]:
            direct.setdefault(first[1], []).append((k, first[0], second[0]))
            continue
        with torch.no_grad():
            agreement = (torch.sign(grad) * torch.sign(moment)).sum(dtype=_F64)
        shares[k] = (agreement / moment.numel() + 1.0) / 2.0
    for kind, pairs in direct.items():
        count = np.fromiter((a.numel() for _, a, _ in pairs), dtype=np.int64, count=len(pairs))
        sums = fused_stats.sign_sums_many(
            np.fromiter((a.data_ptr() for _, a, _ in pairs), dtype=np.int64, count=len(pairs)),
            np.fromiter((b.data_ptr() for _, _, b in pairs), dtype=np.int64, count=len(pairs)),
            count,
            kind,
        )
        for (k, _, _), share in zip(pairs, ((sums / count + 1.0) / 2.0).tolist()):
            shares[k] = share
    return shares


def tensor_stats(
    t: torch.Tensor, ops: Sequence[str], eps: float = 1e-8
) -> list[float] | torch.Tensor | StagedRow:
    """Statistics of one tensor: a list of floats for a CPU tensor; for an accelerator's a
    ``StagedRow`` (copied to be measured with its peers, adapters.torch.staged_stats) or a float64
    vector (len(ops),) on the device, with no host synchronisation. ``stack_rows`` stacks them."""
    ops = tuple(ops)
    parts = None if "id" in ops else kernel_tuple(t, eps)
    if parts is not None:
        return kernel_row(parts, t.numel(), ops)
    if t.numel() and _staged(t):
        staged = staged_row(t, ops, eps)
        if staged is not None:
            return staged
    row = stat_matrix((t,), ops, eps)[0]
    return row.tolist() if row.device.type == "cpu" else row


def _staged(t: torch.Tensor) -> bool:
    """Whether a tensor measured alone is staged with its peers: on accelerators, where each
    operation is a launch (on the CPU the kernel reads it in place at once)."""
    return t.device.type != "cpu"


def stack_rows(rows: Sequence[list[float] | torch.Tensor | StagedRow], width: int) -> torch.Tensor:
    """A float64 (len(rows), width) matrix of ``tensor_stats`` rows: on the host when they all
    are, else on the first device row's device."""
    if not rows:
        return torch.empty((0, width), dtype=_F64)
    staged = [isinstance(r, StagedRow) for r in rows]
    if all(staged):  # an accelerator's hooks: picked from their batches at once
        return stacked_rows(rows)
    if any(staged):
        rows = [r.value() if isinstance(r, StagedRow) else r for r in rows]
    device = next((r.device for r in rows if isinstance(r, torch.Tensor)), None)
    if device is None:  # numpy builds a matrix from lists of floats several times faster
        return torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), width))
    on_host = [k for k, r in enumerate(rows) if not isinstance(r, torch.Tensor)]
    if not on_host:
        return torch.stack(list(rows))
    # host rows beside device ones (a CPU tensor given to a module): one copy that does not wait
    out = torch.empty((len(rows), width), dtype=_F64, device=device)
    out.index_copy_(
        0, on_device(on_host, torch.long, device), on_device([rows[k] for k in on_host], _F64, device)
    )
    there = [k for k, r in enumerate(rows) if isinstance(r, torch.Tensor)]
    return out.index_copy_(0, on_device(there, torch.long, device), torch.stack([rows[k] for k in there]))


def to_host(matrix: torch.Tensor) -> tuple[np.ndarray | None, Any]:
    """Start the one device-to-host copy of a step's statistics: ``(values, None)`` or ``(None, fetch)``."""
    if matrix.device.type == "cpu":
        return matrix.numpy(), None
    if matrix.device.type == "cuda":
        host = torch.empty(matrix.shape, dtype=matrix.dtype, pin_memory=True)
        with torch.cuda.device(matrix.device):  # the copy and its event on the matrix's stream
            host.copy_(matrix, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        def fetch() -> np.ndarray:
            done.synchronize()
            return host.numpy()

        return None, fetch
    return matrix.cpu().numpy(), None
