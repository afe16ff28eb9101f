"""The two model families of the fault-injection harness (benchmarks/faults.py), their data and targets.

``gpt`` is the demo's TinyGPT, shrunk to about 34k parameters; ``mlp`` is a residual MLP classifier
(about 11k parameters) on a fixed random teacher. Data are synthetic and a pure function of
(seed, rank, step, micro-batch), so a run is reproducible and every data-parallel rank gets its own.
``TARGETS`` names, per family and fault, the module or parameter a fault hits: fixed middle layers,
so that the expected root of an incident is known exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.torch.demo import GPTConfig, TinyGPT, synthetic_batch  # noqa: E402

GPT = GPTConfig(vocab=128, hidden=32, heads=2, layers=2, seq=16)
GPT_BATCH = 8
MLP_INPUTS, MLP_HIDDEN, MLP_CLASSES, MLP_BLOCKS, MLP_BATCH = 32, 64, 10, 2, 16
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
