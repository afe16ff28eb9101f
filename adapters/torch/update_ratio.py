"""ur_distribution on torch: Adam's update and m/sqrt(v) binned on the device (the buckets and
kinds are monitor.datatypes.update_ratio's), all counts of a step stacked and copied to the host once;
nothing is rendered on the training thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adapters.torch.stats import to_host
from monitor.datatypes.update_ratio import BINS


def _counts(values: torch.Tensor) -> torch.Tensor:
    """[bucket counts..., nan count, inf count] of one tensor, on its device."""
    flat = values.reshape(-1).float()
    # non-finite values moved outside the range, which histc leaves out: a boolean mask's
    # selection would make the host wait for the device to learn its size
    inside = torch.where(torch.isfinite(flat), flat.clamp(-1.0, 1.0), 2.0)
    binned = torch.histc(inside, bins=BINS, min=-1.0, max=1.0)
    nans = torch.isnan(flat).sum().to(binned.dtype).reshape(1)
    infs = torch.isinf(flat).sum().to(binned.dtype).reshape(1)
    return torch.cat([binned, nans, infs])


def update_histograms(
    backend: Any, params: Sequence[Any], merge: bool = False
) -> tuple[list[int], np.ndarray | Callable[[], np.ndarray]] | None:
    """Histograms of the parameters that have Adam state: ``(positions, counts)``.

    Moments and hyper-parameters come from the optimizer back-end: this rank's piece where the
    optimizer is sharded. ``merge``: sum the counts over the back-end's shard group(s) (bucket
    counts add up over pieces), so that every rank holds the whole tensor's histogram; every rank
    must call it then. ``counts`` is (len(positions), 2, BINS + 2): per kind (update,
    ratio) the bucket counts, then the NaN and Inf counts (without ``merge`` on an accelerator,
    a function that completes their copy, for the writer thread). None when no parameter has
    state yet.
    """
    rows: dict[int, torch.Tensor] = {}
    for position, param in enumerate(params):
        hyper = backend.adam_hyper(param)
        exp_avg, exp_avg_sq = backend.moment(param, "exp_avg"), backend.moment(param, "exp_avg_sq")
        if hyper is None or exp_avg is None or exp_avg_sq is None:
            continue
        step, beta1, beta2, eps, bias_correction = hyper
        m_hat, root_v = exp_avg, exp_avg_sq.sqrt()
        if bias_correction:
            m_hat, root_v = m_hat / (1.0 - beta1**step), root_v / (1.0 - beta2**step) ** 0.5
        rows[position] = torch.stack([_counts(m_hat / (root_v + eps)), _counts(m_hat / root_v)])
    if merge:
        return _merged(rows, len(params), backend.shard_group)
    if not rows:
        return None
    values, fetch = to_host(torch.stack(list(rows.values())))  # on an accelerator: copied later
    return list(rows), values if fetch is None else fetch


def _merged(rows: dict[int, torch.Tensor], count: int, groups: Any) -> tuple[list[int], np.ndarray] | None:
    """Every position's counts summed over the ranks of ``groups``; positions no rank has dropped."""
    device = next(iter(rows.values())).device if rows else torch.device("cpu")
    full = torch.zeros((count, 2, BINS + 2), dtype=torch.float32, device=device)
    for position, row in rows.items():
        full[position] = row
    for group in groups if isinstance(groups, tuple) else (groups,):
        dist.all_reduce(full, group=group)
    host = full.cpu().numpy()
    positions = [i for i in range(count) if host[i].sum() > 0]
    return (positions, host[positions]) if positions else None
