"""Where the C kernel reads a torch tensor's memory where it lies: plain CPU tensors of an
element kind it knows, contiguous or laid out as regular rows (a split piece, a transpose).

The statistics do not depend on the order of the elements, so a strided view is read in memory
order instead of copied first; anything else (accelerator tensors, tensor subclasses such as a
collective's result still in flight or a DTensor, other dtypes) is left to torch's own ops by
the callers in ``adapters.torch.stats``. The caller keeps every tensor alive while the kernel
reads its address.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from monitor.stats import fused_stats

#: dtypes the kernel reads in place, by their element kind
KINDS = {
    torch.float32: fused_stats.FLOAT32,
    torch.float64: fused_stats.FLOAT64,
    torch.bfloat16: fused_stats.BFLOAT16,
}


#: tensor classes whose memory the kernel may read directly
PLAIN = (torch.Tensor, torch.nn.Parameter)


def kernel_sweep(tensors: Sequence[torch.Tensor]) -> tuple[int, list[int], list[int]] | None:
    """``(element kind, addresses, element counts)`` where the kernel can read every tensor in
    place: plain, non-empty, contiguous CPU tensors of one dtype it knows; else None. One sweep
    reading each tensor's few facts once: with thousands of small tensors, these reads are
    most of the cost."""
    first = tensors[0]
    dtype = first.dtype
    kind = KINDS.get(dtype)
    if kind is None or not fused_stats.available():
        return None
    addresses, counts = [], []
    for t in tensors:
        if type(t) not in PLAIN or t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
            return None
        count = t.numel()
        if not count:
            return None
        addresses.append(t.data_ptr())
        counts.append(count)
    return kind, addresses, counts


def kernel_parts(kind: int, addresses: list[int], counts: list[int], eps: float) -> np.ndarray:
    """The kernel's (n, 6) tuples of tensors of one kind at ``addresses`` (kept alive by the caller)."""
    return fused_stats.stats_many(
        np.array(addresses, dtype=np.int64), np.array(counts, dtype=np.int64), kind, eps
    )


def readable_kind(t: torch.Tensor) -> int | None:
    """The element kind of a tensor whose memory the kernel may read (a plain CPU fp32/fp64/bf16
    tensor with elements), else None. Tensor subclasses (a collective's result still in flight, a
    DTensor) go through torch's own ops, which know how to read them."""
    kind = KINDS.get(t.dtype)
    if kind is None or type(t) not in PLAIN or not t.numel() or not t.is_cpu or not fused_stats.available():
        return None
    return kind


def in_place(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(contiguous tensor, element kind)`` where the kernel can read a tensor (``readable_kind``;
    a non-contiguous one is copied); else None. The caller keeps the returned tensor alive while
    the kernel reads its ``data_ptr()``."""
    kind = readable_kind(t)
    if kind is None:
        return None
    return (t if t.is_contiguous() else t.contiguous()), kind


def row_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(run, rows, stride)`` when a non-contiguous tensor's elements are ``rows`` runs of
    ``run`` contiguous elements, ``stride`` elements apart, starting at its data pointer: a
    permuted dense tensor (a transpose; one run) or a regular piece of one (a split, a slice);
    else None. The statistics do not depend on the order of the elements, so the kernel may read
    them in memory order instead of a contiguous copy."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    if not dims or dims[0][0] != 1:
        return None
    run = dims[0][1]
    k = 1
    while k < len(dims) and dims[k][0] == run:
        run *= dims[k][1]
        k += 1
    if k == len(dims):
        return run, 1, run
    stride, rows = dims[k]
    if stride < run:  # overlapping elements
        return None
    for outer_stride, size in dims[k + 1 :]:
        if outer_stride != stride * rows:
            return None
        rows *= size
    return run, rows, stride


#: the shortest run of a strided view read in place: below it one kernel call per run costs more
#: than a contiguous copy (measured: 2 elements a run, 5x slower; 32, even)
MIN_RUN = 64


def kernel_tuple(t: torch.Tensor, eps: float) -> tuple | None:
    """The kernel's tuple of a tensor it reads (one call, no buffer object), else None. A strided
    view that ``row_layout`` describes with runs of MIN_RUN elements or more is read where it
    lies; any other non-contiguous tensor is copied first."""
    kind = readable_kind(t)
    if kind is None:
        return None
    if not t.is_contiguous():
        layout = row_layout(t)
        if layout is not None and (layout[0] >= MIN_RUN or layout[1] == 1):
            return fused_stats.stats_rows(t.data_ptr(), *layout, kind, eps)
        t = t.contiguous()
    return fused_stats.stats_at(t.data_ptr(), t.numel(), kind, eps)
