"""ur_distribution: distributions of Adam's update and of m/sqrt(v), as TensorBoard histograms.

For each monitored parameter with Adam state after this step's update, with the betas and eps
of its own param group: ``m_hat = m / (1 - beta1^t)``, ``v_hat = v / (1 - beta2^t)``,
``update = m_hat / (sqrt(v_hat) + eps)`` and ``ratio = m_hat / sqrt(v_hat)``. Each is binned on
the device into 30 buckets over [-1, 1] (values beyond fall into the edge buckets), with NaN and
Inf counted separately, so one bad value never breaks the histogram. All counts of a step are
stacked and copied to the host once; nothing is rendered on the training thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

BINS = 30
EDGES = np.linspace(-1.0, 1.0, BINS + 1)
KINDS = ("adam_update", "adam_ratio")


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _counts(values: torch.Tensor) -> torch.Tensor:
    """[bucket counts..., nan count, inf count] of one tensor, on its device."""
    flat = values.reshape(-1).float()
    finite = torch.isfinite(flat)
    binned = torch.histc(flat[finite].clamp(-1.0, 1.0), bins=BINS, min=-1.0, max=1.0)
    nans = torch.isnan(flat).sum().to(binned.dtype).reshape(1)
    infs = torch.isinf(flat).sum().to(binned.dtype).reshape(1)
    return torch.cat([binned, nans, infs])


def update_histograms(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]
) -> tuple[list[int], np.ndarray] | None:
    """Histograms of the parameters that have Adam state: ``(positions, counts)``.

    ``counts`` is (len(positions), 2, BINS + 2): per kind (update, ratio) the bucket counts,
    then the NaN and Inf counts. None when no parameter has state yet.
    """
    groups = _group_of(optimizer)
    rows, positions = [], []
    for position, param in enumerate(params):
        state = optimizer.state.get(param)
        if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
            continue
        group = groups.get(id(param), optimizer.defaults)
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        eps = group.get("eps", 1e-8)
        step = float(state.get("step", 1))
        m_hat = state["exp_avg"] / (1.0 - beta1**step)
        root_v = (state["exp_avg_sq"] / (1.0 - beta2**step)).sqrt()
        rows.append(torch.stack([_counts(m_hat / (root_v + eps)), _counts(m_hat / root_v)]))
        positions.append(position)
    if not rows:
        return None
    return positions, torch.stack(rows).cpu().numpy()
