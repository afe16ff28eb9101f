"""What the reliability tests train (the shared fixture of ``tests.training``) and how they look at
it: the everything-on config, hook and file probes."""

from __future__ import annotations

import csv
import glob
import os

import torch
from torch import nn

from tests.adapters.torch.helpers import ALL_OPS
from tests.shared_configs import DATA_TYPES
from tests.training import MLP, Net, make_batches, train

__all__ = [
    "ALL_OPS",
    "EVERYTHING",
    "MLP",
    "Net",
    "csv_steps",
    "hook_state",
    "make_batches",
    "read_csv_rows",
    "train",
]

#: every data type the torch adapter collects on one rank (cc needs ranks; see test_observer_effect).
EVERYTHING = {**DATA_TYPES["all"], "xy_distribution": True, "all_xy": True, "ops": ALL_OPS}


def hook_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every hook dictionary a monitor could touch, as lists of hook ids, plus torch's global hooks."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    return {
        "params": [
            (
                n,
                list(p._post_accumulate_grad_hooks or {}),
                list(p._backward_hooks or {}),
            )
            for n, p in model.named_parameters()
        ],
        "modules": [
            (
                n,
                list(m._forward_pre_hooks),
                list(m._forward_hooks),
                list(m._backward_hooks),
                list(m._backward_pre_hooks),
                list(m._state_dict_hooks),
                list(m._load_state_dict_pre_hooks),
            )
            for n, m in model.named_modules()
        ],
        "optimizer": (
            list(optimizer._optimizer_step_pre_hooks),
            list(optimizer._optimizer_step_post_hooks),
            list(getattr(optimizer, "_optimizer_state_dict_pre_hooks", {})),
            list(getattr(optimizer, "_optimizer_state_dict_post_hooks", {})),
        ),
        "global": [
            list(getattr(nn_module, name))
            for name in (
                "_global_forward_pre_hooks",
                "_global_forward_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
            )
        ],
        "optimizer_global": [
            list(getattr(optim_module, name, {}))
            for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
        ],
    }


def read_csv_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one CSV file; asserts that the file ends with a complete line."""
    with open(path, encoding="utf-8", newline="") as handle:
        text = handle.read()
    assert text.endswith("\n"), f"{path}: last line is incomplete: {text[-80:]!r}"
    rows = list(csv.reader(text.splitlines()))
    return rows[0], rows[1:]


def csv_steps(directory: str, prefix: str) -> dict[int, int]:
    """Rows per step over every ``{prefix}_*.csv`` in directory (files checked complete)."""
    counts: dict[int, int] = {}
    for path in sorted(glob.glob(os.path.join(directory, f"{prefix}_*.csv"))):
        header, rows = read_csv_rows(path)
        step_col = header.index("step")
        for row in rows:
            assert len(row) == len(header), f"{path}: short row {row}"
            counts[int(row[step_col])] = counts.get(int(row[step_col]), 0) + 1
    return counts
