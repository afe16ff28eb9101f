"""The models, data and fault injection of the harness benchmarks/faults.py.

``gpt`` is the demo's TinyGPT, shrunk to about 34k parameters; ``mlp`` is a residual MLP classifier
(about 11k parameters) on a fixed random teacher. Data are synthetic and a pure function of
(seed, rank, step, micro-batch), so a run is reproducible and every data-parallel rank gets its own.
``TARGETS`` names, per family and fault, the module or parameter a fault hits: fixed middle layers,
so that the expected root of an incident is known exactly. ``Injector`` applies a fault at the
training loop's points (the faults are listed in faults.py's docstring).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch  # noqa: E402

if TYPE_CHECKING:
    from faults import Case

GPT = GPTConfig(vocab=128, hidden=32, heads=2, layers=2, seq=16)
GPT_BATCH = 8
MLP_INPUTS, MLP_HIDDEN, MLP_CLASSES, MLP_BLOCKS, MLP_BATCH = 32, 64, 10, 2, 16
#: every fault, as described in faults.py's docstring
FAULTS = (
    "loss_x100",
    "loss_x1000",
    "nan_activation",
    "inf_overflow",
    "grad_after_backward",
    "grad_before_reduce",
    "weight_flip",
    "lr_x100",
    "bad_batch",
    "dead_layer",
)
#: faults that happen on one rank (``fault_rank`` under DDP); the others happen on every rank
ONE_RANK_FAULTS = ("nan_activation", "inf_overflow", "grad_before_reduce", "weight_flip", "bad_batch")
#: faults whose root is no single module or parameter
NO_MODULE = ("loss_x100", "loss_x1000", "lr_x100", "bad_batch")
LOSS_FACTORS = {"loss_x100": 100.0, "loss_x1000": 1000.0}
GRAD_FACTOR = 1e4  # grad_after_backward, grad_before_reduce
FLIPPED_VALUE = 1e4  # weight_flip
OVERFLOW_SCALE = 1e6  # inf_overflow: outputs of |y| > 0.066 overflow (about half of them at init)
#: base learning rates: (family, optimizer) -> lr at the end of the warm-up
BASE_LR = {("gpt", "adamw"): 3e-3, ("mlp", "adamw"): 1e-2, ("gpt", "sgd"): 0.05, ("mlp", "sgd"): 0.05}
#: family -> fault -> the module (activation faults) or parameter (gradient and weight faults) it hits
TARGETS = {
    "gpt": {
        "nan_activation": "layers.1.mlp.0",
        "inf_overflow": "layers.1.qkv",
        "grad_after_backward": "layers.0.mlp.2.weight",
        "grad_before_reduce": "layers.1.mlp.2.weight",
        "weight_flip": "layers.0.mlp.0.weight",
        "dead_layer": "layers.0.proj.weight",
    },
    "mlp": {
        "nan_activation": "blocks.1.fc",
        "inf_overflow": "blocks.0.fc",
        "grad_after_backward": "blocks.1.fc.weight",
        "grad_before_reduce": "blocks.0.fc.weight",
        "weight_flip": "blocks.0.fc.weight",
        "dead_layer": "blocks.1.fc.weight",
    },
}


class MLPBlock(nn.Module):
    """Pre-norm residual block: x + GELU(Linear(LayerNorm(x)))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


class ResidualMLP(nn.Module):
    """Stem Linear, residual blocks, final LayerNorm, classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(MLP_INPUTS, MLP_HIDDEN)
        self.blocks = nn.ModuleList(MLPBlock(MLP_HIDDEN) for _ in range(MLP_BLOCKS))
        self.norm = nn.LayerNorm(MLP_HIDDEN)
        self.head = nn.Linear(MLP_HIDDEN, MLP_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class Task:
    """A model with its data and loss: ``batch(rank, step, micro)`` -> (inputs, targets)."""

    model: nn.Module
    batch: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    #: replaces one batch by garbage that still has the batch's shape and dtype (the bad_batch fault)
    garbage: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """A generator seeded by (seed, rank, step, micro): data independent of what ran before."""
    return torch.Generator().manual_seed(((seed * 4099 + rank) * 1_000_003 + step) * 64 + micro)


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, GPT.vocab), targets.reshape(-1))


def build_task(family: str, seed: int) -> Task:
    """The model (initialised from ``seed``, the same on every rank) with its data and loss."""
    torch.manual_seed(seed)
    if family == "gpt":
        return Task(
            model=TinyGPT(GPT),
            batch=lambda rank, step, micro: synthetic_batch(
                GPT, GPT_BATCH, _generator(seed, rank, step, micro)
            ),
            loss=_gpt_loss,
            # one token repeated: far off the learnt pattern, and one embedding row takes every gradient
            garbage=lambda tokens, targets: (torch.zeros_like(tokens), torch.zeros_like(targets)),
        )
    if family == "mlp":
        teacher = torch.Generator().manual_seed(seed)
        first = torch.randn(MLP_INPUTS, MLP_HIDDEN, generator=teacher) / MLP_INPUTS**0.5
        second = torch.randn(MLP_HIDDEN, MLP_CLASSES, generator=teacher)

        def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
            generator = _generator(seed, rank, step, micro)
            x = torch.randn(MLP_BATCH, MLP_INPUTS, generator=generator)
            labels = (torch.tanh(x @ first) @ second).argmax(dim=1)
            noisy = torch.rand(MLP_BATCH, generator=generator) < 0.05
            random = torch.randint(0, MLP_CLASSES, (MLP_BATCH,), generator=generator)
            return x, torch.where(noisy, random, labels)

        return Task(
            model=ResidualMLP(),
            batch=batch,
            loss=nn.functional.cross_entropy,
            garbage=lambda x, labels: (x * 1e3, labels),  # a unit mix-up: inputs 1000x too large
        )
    raise ValueError(f"unknown family {family!r}: expected 'gpt' or 'mlp'")


def _amplify_largest(grad: torch.Tensor) -> None:
    """Multiply the largest-magnitude element by GRAD_FACTOR, in place (a small one could go unseen)."""
    flat = grad.view(-1)
    flat[flat.abs().argmax()] *= GRAD_FACTOR


class Injector:
    """Applies a case's fault at the training loop's points; inert on a clean run or an untouched rank."""

    def __init__(self, case: Case, task: Task, rank: int) -> None:
        self.case = case
        self.task = task
        faulty_rank = case.fault_rank if case.ranks > 1 else 0
        self.active = case.fault is not None and (case.fault not in ONE_RANK_FAULTS or rank == faulty_rank)
        self.fault = case.fault if self.active else None
        self.target = TARGETS[case.family].get(self.fault or "")
        self.calls = 0  # hook calls within the fault step
        self.handles: list = []  # hooks of the fault step, removed after it

    def now(self, step: int) -> bool:
        return self.fault is not None and step == self.case.fault_step

    def lr_factor(self, step: int) -> float:
        return 100.0 if self.fault == "lr_x100" and step >= self.case.fault_step else 1.0

    def loss_factor(self, step: int) -> float:
        return LOSS_FACTORS.get(self.fault or "", 1.0) if self.now(step) else 1.0

    def batch(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.task.garbage(*batch) if self.fault == "bad_batch" and self.now(step) else batch

    def begin_step(self, step: int) -> None:
        """Before the step's first forward: flip the weight, arm the step's hooks."""
        if not self.now(step):
            return
        model = self.task.model
        if self.fault == "weight_flip":
            with torch.no_grad():
                weight = model.get_parameter(self.target).view(-1)
                weight[weight.numel() // 2] = FLIPPED_VALUE
        elif self.fault == "nan_activation":
            module = model.get_submodule(self.target)
            self.handles.append(module.register_forward_hook(self._nan_output, prepend=True))
        elif self.fault == "inf_overflow":
            module = model.get_submodule(self.target)
            self.handles.append(module.register_forward_hook(self._float16_overflow, prepend=True))
        elif self.fault == "grad_before_reduce":
            self.handles.append(model.get_parameter(self.target).register_hook(self._corrupt_last))
        elif self.fault == "dead_layer":  # for good: never removed
            model.get_parameter(self.target).register_hook(torch.zeros_like)

    def end_backward(self, step: int) -> None:
        """After the step's last backward (and DDP's all-reduce), before clipping and the optimizer."""
        if self.fault == "grad_after_backward" and self.now(step):
            _amplify_largest(self.task.model.get_parameter(self.target).grad)

    def end_step(self, step: int) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # prepended forward hooks: they run before the monitor's, which therefore sees the faulty output
    def _nan_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.calls > 1:  # the first micro-batch only
            return None
        output = output.clone()
        output.view(-1)[output.numel() // 2] = math.nan
        return output

    def _float16_overflow(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        half = nn.functional.linear(args[0].half(), module.weight.half(), module.bias.half())
        return (half * OVERFLOW_SCALE).float()  # elements past float16's 65504 become +-Inf

    def _corrupt_last(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.calls < self.case.grad_acc:  # the step's last micro-batch only
            return None
        grad = grad.clone()
        _amplify_largest(grad)
        return grad
