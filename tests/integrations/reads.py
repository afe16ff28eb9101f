"""What the integration tests compare: the test's own reads of each step, and the CSV rows written.

The reads are independent of the monitor: the test's own post-accumulate-grad hooks copy each
parameter's accumulated gradient as backward leaves it (before clipping and before any step),
the trainer's own hooks give the gradient the optimizer uses (after clipping) and the
parameters before the update, and ``optimizer.state`` after it. Numbers are compared with
numpy's on those copies (tests.reference_stats).
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pandas as pd
import torch

from tests.reference_stats import ALL_OPS, assert_stats_close

#: the six data types compared, with the CSV file prefix each is written under.
DATA_TYPES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")

CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ALL_OPS,
    "format": "csv",
    "ndigits": 15,
    "squash_name": False,  # rows named as the model names its parameters
}


def host_copy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy copy of a tensor on any device, in its own dtype (bf16 widened to float32)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy().copy()


class StepReads:
    """Per step (the trainer's logged step number): every data type's tensors, copied to numpy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.steps: dict[int, dict[str, dict[str, np.ndarray]]] = defaultdict(dict)
        self._accumulated: dict[str, np.ndarray] = {}
        #: step -> per micro-batch, each parameter's own gradient of that micro-batch (the
        #: gradient autograd hands over before accumulating it)
        self.own: dict[int, list[dict[str, np.ndarray]]] = {}
        self._own: list[dict[str, np.ndarray]] = []
        self.micro_batches: list[int] = []
        #: steps whose update a loss scaler skipped
        self.skipped: list[int] = []
        self._count = 0
        self._handles = [
            handle
            for name, param in self.named_parameters()
            for handle in (
                param.register_post_accumulate_grad_hook(self._copier(name)),
                param.register_hook(self._own_copier(name)),
            )
        ]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Each parameter once (a tied weight under its first name, as the model lists it)."""
        return list(self.model.named_parameters())

    def _copier(self, name: str):
        def copy(param: torch.Tensor) -> None:
            self._accumulated[name] = host_copy(param.grad)
            self._count += 1

        return copy

    def _own_copier(self, name: str):
        def copy(grad: torch.Tensor) -> None:
            if not self._own or name in self._own[-1]:  # a new micro-batch's backward
                self._own.append({})
            self._own[-1][name] = host_copy(grad)

        return copy

    def before_update(self, step: int) -> None:
        """At the optimizer's step, after clipping: the gradient it uses and the parameters."""
        params = self.named_parameters()
        self.steps[step]["grad_unreduced"] = dict(self._accumulated)
        self.steps[step]["grad_reduced"] = {n: host_copy(p.grad) for n, p in params}
        self.steps[step]["param_origin"] = {n: host_copy(p) for n, p in params}
        self.micro_batches.append(self._count // max(len(params), 1))
        self.own[step] = self._own
        self._accumulated, self._count, self._own = {}, 0, []

    def after_update(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """After the update: the parameters and Adam's moments, from ``optimizer.state``."""
        params = self.named_parameters()
        self.steps[step]["param_updated"] = {n: host_copy(p) for n, p in params}
        for key in ("exp_avg", "exp_avg_sq"):
            self.steps[step][key] = {n: host_copy(optimizer.state[p][key]) for n, p in params}

    def update_skipped(self, step: int) -> None:
        """The step's update was skipped (a loss scaler's overflow): of what the optimizer would
        have used and changed nothing is to be written, only the unreduced gradient."""
        self.steps[step] = {"grad_unreduced": self.steps[step]["grad_unreduced"]}
        self.skipped.append(step)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _records(output_dir: str):
    """(data type, CSV row as a dict) of every CSV file of a rank directory."""
    for file in os.listdir(output_dir):
        if file.endswith(".csv"):
            for record in pd.read_csv(os.path.join(output_dir, file)).to_dict("records"):
                yield file.rsplit("_", 1)[0], record


def written_rows(output_dir: str) -> dict[tuple[str, str, int], dict[str, float]]:
    """Every CSV row of a rank directory: (data type, parameter name, step) -> {op: value}."""
    return {
        (prefix, record["name"], int(record["step"])): {op: float(record[op]) for op in ALL_OPS}
        for prefix, record in _records(output_dir)
    }


def written_micro_rows(output_dir: str, prefix: str) -> dict[tuple[str, int, int], dict[str, float]]:
    """The CSV rows of one data type with a micro-step: (parameter name, step, micro-step) -> {op: value}."""
    return {
        (record["name"], int(record["step"]), int(record["micro_step"])): {
            op: float(record[op]) for op in ALL_OPS
        }
        for kind, record in _records(output_dir)
        if kind == prefix
    }


def compare(
    reads: dict[int, dict[str, dict[str, np.ndarray]]], rows: dict, what: str = "", skipped: tuple = ()
) -> int:
    """Assert that every read tensor has its row with numpy's statistics, and that a step whose
    update was ``skipped`` has its unreduced gradients' rows alone; returns the values compared."""
    compared = 0
    for step, kinds in sorted(reads.items()):
        for kind in ("grad_unreduced",) if step in skipped else DATA_TYPES:
            assert kind in kinds, f"{what} step {step}: the test read no {kind}"
            for name, array in kinds[kind].items():
                key = (kind, name, step)
                assert key in rows, f"{what}: no {kind} row for {name} at step {step}"
                assert_stats_close(rows[key], array, what=f"{what} {kind} {name} step {step}")
                compared += len(ALL_OPS)
    beyond = sorted({(kind, step) for kind, _, step in rows if step in skipped and kind != "grad_unreduced"})
    assert not beyond, f"{what}: rows of steps whose update was skipped: {beyond}"
    steps = {step for _, _, step in rows}
    assert steps == set(reads), f"{what}: rows for steps {sorted(steps)}, the trainer stepped {sorted(reads)}"
    return compared


def watch_ddp_verdicts() -> tuple[list[bool], list]:
    """Record, for each collection attached from now on in this process, the DDP wrappers the
    monitor found around the model and whether it then measures gradients at the backward
    pass's end: ``(verdicts, wrappers)``, appended to as the trainer attaches."""
    from adapters.torch import collection
    from adapters.torch.dist import ddp_reduces_after_pass_end

    verdicts: list[bool] = []
    found: list = []

    def spy(wrappers):
        found.append(wrappers)
        verdicts.append(ddp_reduces_after_pass_end(wrappers))
        return verdicts[-1]

    collection.ddp_reduces_after_pass_end = spy
    return verdicts, found


def ddp_rank_result(reads, output_dir: str, what: str, verdicts: list[bool]) -> dict:
    """What one DDP rank of an integration test reports: the values compared against its own
    reads, its steps, its unreduced gradients' norms (to show they differ from the peer's) and
    whether the monitor measured them at the backward pass's end."""
    rows = written_rows(output_dir)
    unreduced = {k: v for k, v in rows.items() if k[0] == "grad_unreduced"}
    return {
        "compared": compare(reads.steps, rows, what),
        "steps": sorted(reads.steps),
        "norms": {f"{n}@{s}": v["norm"] for (_, n, s), v in sorted(unreduced.items())},
        "measured_at_pass_end": verdicts,
    }
