"""mg_direction's values: per parameter with a gradient, the share of its gradient's signs that
agree with Adam's exp_avg before the update (msprobe's measure of update direction)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from adapters.torch.stats import sign_shares


def sign_agreement(
    backend: Any, params: Sequence[torch.nn.Parameter]
) -> tuple[list[float | torch.Tensor], list[tuple[int, int]], torch.device | None]:
    """The share of each parameter that has a gradient (1.0 without an exp_avg, as msprobe
    writes it; NaN where exp_avg is not shaped like the gradient), its ``(position, element
    count)`` in ``params``, and the gradients' device (None when no parameter has one). Shares
    are floats where the kernel reads the tensors in place, else 0-d tensors on the device."""
    values: list[float | torch.Tensor] = []
    present, compared, grads, moments = [], [], [], []
    device = None
    for position, param in enumerate(params):
        grad = backend.grad(param)
        if grad is None:
            continue
        device = grad.device if device is None else device
        moment = backend.moment(param, "exp_avg")
        if moment is None:
            values.append(1.0)
        elif moment.shape != grad.shape or moment.numel() == 0:
            values.append(float("nan"))
        else:
            compared.append(len(values))
            grads.append(grad)
            moments.append(moment)
            values.append(0.0)
        present.append((position, grad.numel()))
    for k, share in zip(compared, sign_shares(grads, moments)):
        values[k] = share
    return values, present, device
