"""Helpers for the torch adapter tests: small models; the numpy reference lives in tests.reference_stats."""

from __future__ import annotations

import numpy as np
import torch

from tests.reference_stats import (
    ALL_OPS,
    assert_stats_close,
    numpy_stats,
    read_histograms,
    sign_agreement,
    update_histogram_reference,
)
from tests.training import MLP, make_batches

__all__ = [
    "ALL_OPS",
    "MLP",
    "assert_stats_close",
    "clear_non_finite",
    "flat_values",
    "latest_rows",
    "make_batches",
    "measured_linear",
    "merge_piece_rows",
    "numpy_stats",
    "read_histograms",
    "replica_references",
    "update_histogram_reference",
]


def latest_rows(got: dict, prefix: str) -> dict[str, dict[str, float]]:
    """{parameter name[:micro-step]: row} of a monitor's latest record of ``prefix``, given as
    ``{prefix: {tag: row}}``."""
    return {tag.split("/")[0].split(":", 1)[1]: row for tag, row in got[prefix].items()}


def merge_piece_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """The whole tensor's statistics from pieces written with their element counts (numpy)."""
    n = np.array([r["numel"] for r in rows])
    column = {op: np.array([r[op] for r in rows]) for op in ALL_OPS}
    return {
        "min": column["min"].min(),
        "max": column["max"].max(),
        "norm": np.sqrt((column["norm"] ** 2).sum()),
        "mean": (column["mean"] * n).sum() / n.sum(),
        "zeros": (column["zeros"] * n).sum() / n.sum(),
        "nans": column["nans"].sum(),
        "numel": n.sum(),
    }


def flat_values(tensor: torch.Tensor) -> list[float]:
    """A tensor's values as a flat list of float64 (for JSON results of a rank)."""
    return tensor.detach().double().ravel().tolist()


def replica_references(replica, optimizer, local: list, reduced: list) -> dict:
    """An unsharded replica's numbers of one step, by parameter name, given this rank's local and
    the reduced gradients: both gradients, the parameters, mg_direction against the moments
    before the update; then the replica's own optimizer steps on the reduced gradients, and the
    parameters and moments after it."""
    names = [name for name, _ in replica.named_parameters()]
    params = list(replica.parameters())
    ref = {
        "grad_unreduced": {n: flat_values(g) for n, g in zip(names, local)},
        "grad_reduced": {n: flat_values(g) for n, g in zip(names, reduced)},
        "param_origin": {n: flat_values(p) for n, p in zip(names, params)},
        "other": {},
    }
    for name, param, grad in zip(names, params, reduced):
        state = optimizer.state.get(param)
        ref["other"][name] = sign_agreement(grad.numpy(), state["exp_avg"].numpy()) if state else 1.0
        param.grad = grad
    optimizer.step()
    ref["param_updated"] = {n: flat_values(p) for n, p in zip(names, params)}
    for key in ("exp_avg", "exp_avg_sq"):
        ref[key] = {n: flat_values(optimizer.state[p][key]) for n, p in zip(names, params)}
    return ref


def clear_non_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Zero every NaN/Inf of the weights and the optimizer's state: after an injected fault the
    next steps start clean, so a later fault is a new incident."""
    with torch.no_grad():
        for p in model.parameters():
            p.nan_to_num_(0.0)
            for value in optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.nan_to_num_(0.0)


def measured_linear(weights: list[torch.Tensor]) -> list[tuple[float, float]]:
    """``(kernel_norm, sr)`` of each weight in turn, as a collection measures it (L2Features on
    one linear layer, its own start vectors carried from weight to weight)."""
    from adapters.torch.l2 import L2Features
    from monitor.config.schema import load_config

    layer = torch.nn.Linear(weights[0].shape[1], weights[0].shape[0], bias=False)
    config = load_config({"recording_l2_features": True, "l2_targets": {"linear_hook": []}})
    features = L2Features([torch.nn.Sequential(layer)], config, lambda what, exc: None)
    measured = []
    for weight in weights:
        with torch.no_grad():
            layer.weight.copy_(weight)
        _, values = features.linear_values(0)
        measured.append((values[0, 0].item(), values[0, 1].item()))
    return measured
