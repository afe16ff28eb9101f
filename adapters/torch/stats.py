"""Statistics of many tensors at once, on their device, stacked for one host copy.

``stat_matrix(tensors, ops, eps)`` returns a float64 tensor (len(tensors), len(ops)) on the
tensors' device. Norms use torch._foreach_norm over the whole list (fp32 accumulation for
half types); min and max come from one aminmax pass per tensor; sums accumulate in fp32 (fp64
for fp64 inputs); no whole-tensor float64 copy is ever made. Element counts (``zeros``,
``nans``) are taken in chunks so their boolean temporaries stay small.

NaN/Inf policy: min, max, norm and mean propagate NaN/Inf exactly as numpy does on the same
data; ``nans`` counts NaN elements; empty tensors give NaN for min/max/mean/zeros and 0 for
norm/nans. Nothing here raises on non-finite values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: elements per chunk for the counting ops (bounds their temporaries to 16 MiB of bools).
COUNT_CHUNK = 1 << 24
_HALF_TYPES = (torch.float16, torch.bfloat16)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(t: torch.Tensor) -> Sequence[torch.Tensor]:
    flat = t.reshape(-1)
    if flat.numel() <= COUNT_CHUNK:
        return (flat,)
    return flat.split(COUNT_CHUNK)


def _count(t: torch.Tensor, eps: float, kind: str) -> torch.Tensor:
    total = None
    for chunk in _chunks(t):
        if kind == "nans":
            part = torch.isnan(chunk).sum()
        else:
            part = torch.count_nonzero((chunk < eps) & (chunk > -eps))
        total = part if total is None else total + part
    return total


def _group_columns(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float) -> list[torch.Tensor]:
    """Columns (one 1-D tensor per op) for non-empty tensors that share a dtype and device."""
    acc = _accumulate_dtype(tensors[0].dtype)
    floating = tensors[0].is_floating_point()
    columns: dict[str, torch.Tensor] = {}
    if "norm" in ops:
        if floating:
            norms = torch._foreach_norm(list(tensors), 2, dtype=acc)
        else:
            norms = [torch.linalg.vector_norm(t.to(acc)) for t in tensors]
        columns["norm"] = torch.stack(norms).to(torch.float64)
    if "min" in ops or "max" in ops:
        pairs = [torch.aminmax(t) for t in tensors]
        columns["min"] = torch.stack([p.min for p in pairs]).to(torch.float64)
        columns["max"] = torch.stack([p.max for p in pairs]).to(torch.float64)
    numel = None
    if "mean" in ops or "zeros" in ops:
        numel = torch.tensor([t.numel() for t in tensors], dtype=torch.float64, device=tensors[0].device)
    if "mean" in ops:
        sums = torch.stack([t.sum(dtype=acc) for t in tensors]).to(torch.float64)
        columns["mean"] = sums / numel
    if "zeros" in ops:
        columns["zeros"] = torch.stack([_count(t, eps, "zeros") for t in tensors]).to(torch.float64) / numel
    if "nans" in ops:
        if floating:
            columns["nans"] = torch.stack([_count(t, eps, "nans") for t in tensors]).to(torch.float64)
        else:
            columns["nans"] = torch.zeros(len(tensors), dtype=torch.float64, device=tensors[0].device)
    if "id" in ops:
        columns["id"] = torch.stack(
            [
                t.reshape(()).to(torch.float64)
                if t.numel() == 1
                else t.new_full((), float("nan"), dtype=torch.float64)
                for t in tensors
            ]
        )
    return [columns[op] for op in ops]


_EMPTY_VALUE = {"norm": 0.0, "nans": 0.0}


def stat_matrix(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float = 1e-8) -> torch.Tensor:
    """Statistics (rows: tensors, columns: ops) as one float64 tensor on the tensors' device."""
    ops = tuple(ops)
    if not tensors:
        return torch.empty((0, len(ops)), dtype=torch.float64)
    device = tensors[0].device
    out = torch.empty((len(tensors), len(ops)), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            out[i] = torch.tensor([_EMPTY_VALUE.get(op, float("nan")) for op in ops], dtype=torch.float64)
            continue
        groups.setdefault((t.dtype, t.device), []).append(i)
    for index in groups.values():
        block = torch.stack(_group_columns([tensors[i] for i in index], ops, eps), dim=1)
        rows = torch.tensor(index, device=device)
        out.index_copy_(0, rows, block.to(device))
    return out


def tensor_stats(t: torch.Tensor, ops: Sequence[str], eps: float = 1e-8) -> torch.Tensor:
    """Statistics of one tensor as a float64 vector (len(ops),) on its device."""
    return stat_matrix((t,), ops, eps)[0]
